"""CUDA paths of kernels/ (sgl-kernel, flashinfer) against the PyTorch reference run on CPU copies."""

from __future__ import annotations

import inspect
import random

import pytest
import torch

from kernels.attention import TorchAttentionBackend
from kernels.dispatch import FLASHINFER, SGL_KERNEL, import_cuda_library, use_cuda_kernels
from kernels.sampling import sampling_from_probs, top_k_renorm_prob, top_p_renorm_prob
from tests.kernels.tree_helpers import pack_trees, random_tree, run_greedy, run_sampling

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def need(lib: str) -> None:
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
def test_verify_tree_greedy_matches_reference(seed):
    need(SGL_KERNEL)
    tree, logits, s = random_batch(seed, bs=16, d=12, vocab=64)
    tp = logits.argmax(-1)
    ref = run_greedy(tree, tp, s)
    got = run_greedy(cuda(tree), tp.cuda(), s)
    compare(ref, got, 16, 12)


@pytest.mark.parametrize("seed,vocab", [(0, 64), (1, 1000), (2, 32000)])
def test_tree_sampling_matches_reference(seed, vocab):
    need(SGL_KERNEL)
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


def test_tree_sampling_one_hot_equals_greedy_on_cuda():
    need(SGL_KERNEL)
    tree, logits, s = random_batch(7, bs=32, d=10, vocab=50)
    tp = logits.argmax(-1)
    one_hot = torch.nn.functional.one_hot(tp, 50).float()
    greedy = run_greedy(cuda(tree), tp.cuda(), s)
    sampled = run_sampling(cuda(tree), torch.rand(32, 10).cuda(), torch.rand(32).cuda(), one_hot.cuda(), s=s)
    compare({k: v.cpu() for k, v in greedy.items()}, sampled, 32, 10)


@pytest.mark.parametrize("vocab", [1000, 129280])
def test_renorm_filters_match_reference(vocab):
    need(FLASHINFER + ".sampling")
    g = torch.Generator().manual_seed(vocab)
    probs = (torch.randn(24, vocab, generator=g) * 3).softmax(-1)
    top_k = torch.randint(1, 100, (24,), generator=g)
    top_p = torch.rand(24, generator=g) * 0.9 + 0.05
    for fn, param in ((top_k_renorm_prob, top_k), (top_p_renorm_prob, top_p), (top_k_renorm_prob, 20)):
        ref = fn(probs, param)
        got = fn(probs.cuda(), param.cuda() if isinstance(param, torch.Tensor) else param).cpu()
        assert torch.equal(ref > 0, got > 0), fn.__name__
        assert torch.allclose(ref, got, atol=1e-5), fn.__name__


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


def tree_attention_inputs(dtype: torch.dtype):
    """Two requests with prefixes 5 and 3 and trees of 4 and 2 nodes (ancestor-only mask)."""
    hq, hkv, d = 8, 2, 64
    prefix, parents = [5, 3], [[-1, 0, 0, 1], [-1, 0]]
    bs, q_max = 2, 4
    k_max = max(p + len(t) for p, t in zip(prefix, parents, strict=True))
    num_slots = 64
    slots = torch.randperm(num_slots - 1)[: sum(prefix) + 6] + 1  # slot 0 is padding
    kv_indices = torch.zeros(bs, k_max, dtype=torch.long)
    mask = torch.zeros(bs, q_max, k_max, dtype=torch.bool)
    mask[:, :, 0] = True  # padded query rows see key 0 only
    out_loc, q_index, used = [], [], 0
    for b in range(bs):
        n = len(parents[b])
        kv_indices[b, : prefix[b] + n] = slots[used : used + prefix[b] + n]
        out_loc.append(slots[used + prefix[b] : used + prefix[b] + n])
        used += prefix[b] + n
        for i in range(n):
            mask[b, i, : prefix[b]] = True
            j = i
            while j != -1:
                mask[b, i, prefix[b] + j] = True
                j = parents[b][j]
            q_index.append(b * q_max + i)
    t = len(q_index)
    g = torch.Generator().manual_seed(0)
    k_cache = torch.randn(num_slots, hkv, d, generator=g).to(dtype)
    v_cache = torch.randn(num_slots, hkv, d, generator=g).to(dtype)
    q, k, v = (torch.randn(t, h, d, generator=g).to(dtype) for h in (hq, hkv, hkv))
    return dict(
        q=q,
        k=k,
        v=v,
        k_cache=k_cache,
        v_cache=v_cache,
        out_cache_loc=torch.cat(out_loc),
        kv_indices=kv_indices,
        attn_mask=mask,
        q_index=torch.tensor(q_index),
        scale=d**-0.5,
    )


def test_flashinfer_attention_matches_torch_backend():
    if import_cuda_library(FLASHINFER) is None:
        pytest.skip("flashinfer not installed")
    from kernels.attention_flashinfer import FlashInferAttentionBackend
    from kernels.attention_select import get_attention_backend

    inputs = tree_attention_inputs(torch.bfloat16)
    ref_in = {
        k: (v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
        for k, v in inputs.items()
    }
    ref = TorchAttentionBackend().forward(**ref_in)
    got_in = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}
    backend = FlashInferAttentionBackend()
    got = backend.forward(**got_in)
    assert torch.allclose(ref, got.float().cpu(), atol=3e-2, rtol=3e-2)
    assert torch.equal(got_in["k_cache"][got_in["out_cache_loc"]].cpu(), inputs["k"])
    again = backend.forward(**got_in)  # second layer of the same forward reuses the plan
    assert torch.equal(got, again)
    if not use_cuda_kernels(torch.zeros(1, device="cuda"), library=FLASHINFER):
        return
    assert isinstance(get_attention_backend("auto"), FlashInferAttentionBackend)
