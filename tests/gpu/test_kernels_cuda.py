"""CUDA paths of ddtree_serve/kernels/ (sgl-kernel, flashinfer) against the PyTorch reference run on CPU copies."""

from __future__ import annotations

import inspect
import random

import pytest
import torch

from ddtree_serve.kernels.attention import TorchAttentionBackend
from ddtree_serve.kernels.dispatch import FLASHINFER, SGL_KERNEL, import_cuda_library, use_cuda_kernels
from ddtree_serve.kernels.sampling import sampling_from_probs, top_k_renorm_prob, top_p_renorm_prob
from ddtree_serve.model_executor.forward_batch import ForwardMode
from tests.gpu.spy import spy
from tests.kernels.test_attention_flashinfer_glue import _batch
from tests.kernels.tree_helpers import pack_trees, random_tree, run_greedy, run_sampling

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def need(lib: str) -> None:
    """Skip when ``lib`` cannot run (a failure under DDTREE_REQUIRE_CUDA_KERNELS=1: conftest.py)."""
    if not use_cuda_kernels(torch.zeros(1, device="cuda"), library=lib):
        pytest.skip(f"{lib} not usable (not installed or DDTREE_KERNELS=torch)")


def cuda(d: dict) -> dict:
    return {k: v.cuda() for k, v in d.items()}


def random_batch(seed: int, bs: int, d: int, vocab: int):
    rng = random.Random(seed)
    trees = [random_tree(rng, rng.randint(1, d), min(vocab, 8)) for _ in range(bs)]
    tree = pack_trees(trees, d)
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(bs, d, vocab, generator=g)
    nt = tree["retrive_next_token"]
    for b, (parents, tokens) in enumerate(trees):  # make the target agree with first children often
        for i in range(len(parents)):
            if 0 <= nt[b, i] < d and rng.random() < 0.7:
                logits[b, i, tokens[int(nt[b, i])]] += 6.0
    return tree, logits, int(tree["depth"].max()) + 1


def compare(ref: dict, got: dict, bs: int, d: int) -> None:
    assert torch.equal(ref["accept_token_num"], got["accept_token_num"].cpu())
    assert torch.equal(ref["accept_index"], got["accept_index"].cpu())
    written = torch.zeros(bs * d, dtype=torch.bool)
    written[ref["accept_index"][ref["accept_index"] >= 0].long()] = True
    assert torch.equal(ref["predicts"][written], got["predicts"].cpu()[written])


@pytest.mark.parametrize("seed", range(4))
def test_verify_tree_greedy_matches_reference(seed, monkeypatch, backend_report):
    need(SGL_KERNEL)
    calls = spy(monkeypatch, SGL_KERNEL, "verify_tree_greedy")
    tree, logits, s = random_batch(seed, bs=16, d=12, vocab=64)
    tp = logits.argmax(-1)
    ref = run_greedy(tree, tp, s)
    got = run_greedy(cuda(tree), tp.cuda(), s)
    compare(ref, got, 16, 12)
    assert len(calls) == 1
    backend_report.append(f"verify_tree_greedy (seed {seed}): sgl-kernel vs torch reference on CPU")


@pytest.mark.parametrize("seed,vocab", [(0, 64), (1, 1000), (2, 32000)])
def test_tree_sampling_matches_reference(seed, vocab, monkeypatch, backend_report):
    need(SGL_KERNEL)
    calls = spy(monkeypatch, SGL_KERNEL, "tree_speculative_sampling_target_only")
    bs, d = 16, 12
    tree, logits, s = random_batch(seed, bs, d, vocab)
    target = logits.softmax(-1)
    g = torch.Generator().manual_seed(seed)
    coins, final = torch.rand(bs, d, generator=g), torch.rand(bs, generator=g)
    ref = run_sampling(tree, coins, final, target, s=s)
    got = run_sampling(cuda(tree), coins.cuda(), final.cuda(), target.cuda(), s=s)
    compare(ref, got, bs, d)
    fn = import_cuda_library(SGL_KERNEL).tree_speculative_sampling_target_only
    if "draft_probs" in inspect.signature(fn).parameters:  # older sgl-kernel: rejected siblings written there
        assert torch.allclose(ref["draft_probs"], got["draft_probs"].cpu())
    assert len(calls) == 1
    backend_report.append(f"tree_speculative_sampling_target_only (V={vocab}): sgl-kernel vs torch reference")


def test_tree_sampling_one_hot_equals_greedy_on_cuda():
    need(SGL_KERNEL)
    tree, logits, s = random_batch(7, bs=32, d=10, vocab=50)
    tp = logits.argmax(-1)
    one_hot = torch.nn.functional.one_hot(tp, 50).float()
    greedy = run_greedy(cuda(tree), tp.cuda(), s)
    sampled = run_sampling(cuda(tree), torch.rand(32, 10).cuda(), torch.rand(32).cuda(), one_hot.cuda(), s=s)
    compare({k: v.cpu() for k, v in greedy.items()}, sampled, 32, 10)


@pytest.mark.parametrize("vocab", [1000, 129280])
def test_renorm_filters_match_reference(vocab, monkeypatch, backend_report):
    need(FLASHINFER + ".sampling")
    calls = spy(monkeypatch, FLASHINFER + ".sampling", "top_p_renorm_probs")
    g = torch.Generator().manual_seed(vocab)
    probs = (torch.randn(24, vocab, generator=g) * 3).softmax(-1)
    top_k = torch.randint(1, 100, (24,), generator=g)
    top_p = torch.rand(24, generator=g) * 0.9 + 0.05
    for fn, param in ((top_k_renorm_prob, top_k), (top_p_renorm_prob, top_p), (top_k_renorm_prob, 20)):
        ref = fn(probs, param)
        got = fn(probs.cuda(), param.cuda() if isinstance(param, torch.Tensor) else param).cpu()
        assert torch.equal(ref > 0, got > 0), fn.__name__
        assert torch.allclose(ref, got, atol=1e-5), fn.__name__
        again = fn(probs.cuda(), param.cuda() if isinstance(param, torch.Tensor) else param).cpu()
        assert torch.equal(got, again), f"{fn.__name__} is not deterministic"
    assert len(calls) == 2
    backend_report.append(
        f"top_k/top_p renorm (V={vocab}): flashinfer, is_deterministic=True, bitwise replay"
    )


def test_renorm_filters_keep_ties_on_cuda():
    need(FLASHINFER + ".sampling")
    p = torch.tensor([[0.1, 0.2, 0.2, 0.5, 0.0]]).cuda()
    assert torch.equal(top_k_renorm_prob(p, 2).cpu() > 0, torch.tensor([[False, True, True, True, False]]))
    assert torch.equal(top_p_renorm_prob(p, 0.6).cpu() > 0, torch.tensor([[False, True, True, True, False]]))


def test_sampling_from_probs_on_cuda_matches_cpu():
    g = torch.Generator().manual_seed(0)
    probs = (torch.randn(64, 5000, generator=g) * 3).softmax(-1)
    probs[:, ::3] = 0
    u = torch.rand(64, generator=g)
    assert torch.equal(sampling_from_probs(probs, u), sampling_from_probs(probs.cuda(), u.cuda()).cpu())


@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.TARGET_VERIFY])
def test_flashinfer_attention_matches_torch_backend(mode, monkeypatch, backend_report):
    """Each forward kind on flashinfer (causal prefill, decode, custom-mask prefill) against the torch
    reference, metadata built in inference mode as the engine does, bf16."""
    need(FLASHINFER)
    from ddtree_serve.kernels.attention_flashinfer import FlashInferAttentionBackend

    kernel = (
        "BatchDecodeWithPagedKVCacheWrapper"
        if mode == ForwardMode.DECODE
        else "BatchPrefillWithPagedKVCacheWrapper"
    )
    runs = spy(monkeypatch, FLASHINFER, f"{kernel}.run")
    prefix, extend = ([3, 6], [1, 1]) if mode == ForwardMode.DECODE else ([2, 5], [3, 4])
    fb, k_cache, v_cache, qkv = _batch(mode, prefix, extend, d=64)
    ref = TorchAttentionBackend().forward(
        *qkv,
        k_cache.clone(),
        v_cache.clone(),
        fb.out_cache_loc,
        fb.kv_indices,
        fb.attn_mask,
        fb.q_index,
        64**-0.5,
    )
    dev = torch.device("cuda")
    with torch.inference_mode():
        fb_cuda = type(fb)(
            **{k: (v.to(dev) if isinstance(v, torch.Tensor) else v) for k, v in vars(fb).items()}
        )
        kc, vc = k_cache.to(dev, torch.bfloat16), v_cache.to(dev, torch.bfloat16)
        backend = FlashInferAttentionBackend()
        backend.begin_forward(fb_cuda.attention_meta())
        args = [t.to(dev, torch.bfloat16) for t in qkv]
        got = backend.forward(
            *args,
            kc,
            vc,
            fb_cuda.out_cache_loc,
            fb_cuda.kv_indices,
            fb_cuda.attn_mask,
            fb_cuda.q_index,
            64**-0.5,
        )
        again = backend.forward(
            *args,
            kc,
            vc,
            fb_cuda.out_cache_loc,
            fb_cuda.kv_indices,
            fb_cuda.attn_mask,
            fb_cuda.q_index,
            64**-0.5,
        )  # a second layer reuses the plan
    assert torch.allclose(ref, got.float().cpu(), atol=3e-2, rtol=3e-2)
    assert torch.equal(got, again) and len(runs) == 2
    backend_report.append(f"attention {mode.value}: flashinfer {kernel} (bf16) vs torch reference")


def test_flashinfer_chosen_for_bf16_and_warm_up_runs(backend_report):
    need(FLASHINFER)
    from ddtree_serve.kernels.attention_flashinfer import FlashInferAttentionBackend
    from ddtree_serve.kernels.attention_select import get_attention_backend

    backend = get_attention_backend("auto", "cuda", torch.bfloat16, 64, 64)
    assert isinstance(backend, FlashInferAttentionBackend)
    assert not isinstance(
        get_attention_backend("auto", "cuda", torch.float32, 64, 64), FlashInferAttentionBackend
    )
    ran = backend.warmup(9, 3, 64, 64, torch.bfloat16, "cuda")  # decode -> extend -> tree: FA3 first on sm90
    ran = backend.warmup(9, 3, 64, 64, torch.bfloat16, "cuda")  # and again, as serving interleaves them
    causal_be = getattr(backend._prefill, "_backend", "?")  # flashinfer resolves "auto" at the first plan
    assert getattr(backend._masked_prefill, "_backend", "fa2") == "fa2"  # custom masks never on FA3
    backend_report.append(
        f"attention warm-up: flashinfer {', '.join(ran)} (causal prefill on {causal_be}, masked on fa2); "
        "float32 -> torch reference"
    )
