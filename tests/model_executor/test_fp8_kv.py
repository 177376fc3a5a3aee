"""FP8 MLA KV cache (``--kv-cache-dtype fp8_e4m3``, ddtree_serve/kernels/kv_quant.py) on CPU.

- the format: round-trip error within e4m3's bound (2^-4 relative) per part, the rope part on its own scale,
  zero rows, dequantized values a fixed point; bytes per token (Kimi K2.6: 61 x 584 B, 0.507x bfloat16);
- the tiny DeepSeek-V3 checkpoint with MLA and dense MLPs (tests/model_executor/tiny_deepseek.py,
  ``first_k_dense_replace=3``: no router whose discrete choices would amplify any perturbation): logprob
  deviation vs a float32 cache over chunked extend, decode and a tree verify. Measured (seeds 0 and 2): fp8
  top-token |d logprob| max 0.40 / mean 0.12, KL max 0.09, argmax agreement 94 %; bfloat16 KV max 0.04 /
  mean 0.007. Tolerances: fp8 max 0.6 / mean 0.2 / agreement >= 0.9; bfloat16 max 0.08;
- the Engine: greedy tokens with fp8 KV, plain and DDTree, are identical (speculation stays lossless over
  the same cache); against the float32 cache they agree for the first 2, 3 and 6 of 8 tokens of the three
  prompts (random weights: near-tied logits, so one flipped argmax changes the rest); the Triton kernels (interpreter)
  over the fp8 cache match the torch reference over it;
- bad input: fp8 on an MHA model, unknown dtype names, Triton on a GPU without fp8 conversions.
"""

from __future__ import annotations

import pytest
import torch

from ddtree_serve.kernels.kv_quant import (
    FP8_KV_DTYPE,
    dequantize_latent,
    quantize_latent,
    resolve_kv_cache_dtype,
)
from ddtree_serve.model_executor.kernel_backends import resolve_kernel_backends
from ddtree_serve.model_executor.kv_cache import KVCache, KVCacheLayout
from ddtree_serve.model_executor.model_config import ModelConfig
from ddtree_serve.model_executor.model_runner import ModelRunner
from ddtree_serve.model_executor.sampling_params import SamplingParams
from tests.model_executor.test_deepseek_triton import _tree_logits
from tests.model_executor.test_deepseek_v3 import _extend, _ids
from tests.model_executor.tiny_deepseek import write_tiny_deepseek

# of 3 prompts x 8 greedy tokens, the float32 cache's tokens the fp8 cache reproduces before the first difference:
# measured 2, 3 and 6 (11 of 24; random weights have near-tied logits, top-2 margins down to 0.002); asserted >= 8
GREEDY_COMMON = 8


def test_round_trip_error_bound_separate_scales_and_fixed_point():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(300, 1, 40, generator=g) * torch.rand(300, 1, 1, generator=g) * 50  # [T, 1, L + R]
    x[:, :, 32:] *= 1e-3  # rope part far smaller than the latent
    x[7] = 0.0
    q, s = quantize_latent(x, 32)
    assert q.dtype == FP8_KV_DTYPE and q.shape == x.shape and s.shape == (300, 2)
    assert bool((s[7] == 1).all()) and bool((torch.log2(s) == torch.log2(s).round()).all())  # powers of two
    live = torch.arange(300) != 7
    assert bool((s[live, 1] < s[live, 0] / 100).all())  # the rope part has its own scale
    y = dequantize_latent(q, s, 32, torch.float32)
    per_elem = torch.cat([s[:, :1].expand(-1, 32), s[:, 1:].expand(-1, 8)], dim=1)[:, None, :]  # [T, 1, W]
    normal = x.abs() >= per_elem * 2**-6
    rel = (y - x).abs() / x.abs().clamp(min=1e-30)
    assert float(rel[normal].max()) <= 2**-4
    assert float(((y - x).abs() - per_elem * 2**-10)[~normal].max()) <= 0  # subnormal spacing / 2
    assert bool((y[7] == 0).all())
    q2, s2 = quantize_latent(y, 32)
    assert torch.equal(dequantize_latent(q2, s2, 32, torch.float32), y)


def test_bytes_per_token_halve(tmp_path):
    layout = KVCacheLayout(61, 1, 576, 0)  # Kimi K2.6's MLA latent: 61 layers x (512 + 64)
    assert (layout.bytes_per_token(torch.bfloat16), layout.bytes_per_token(FP8_KV_DTYPE)) == (61 * 576 * 2, 61 * 584)
    assert layout.bytes_per_token(FP8_KV_DTYPE) / layout.bytes_per_token(torch.bfloat16) == pytest.approx(0.507, 1e-3)
    cache = KVCache(KVCacheLayout(2, 1, 40, 0), 16, FP8_KV_DTYPE, "cpu")
    assert cache.k[0].dtype == FP8_KV_DTYPE and cache.k_scale[1].shape == (17, 2)
    assert KVCache(KVCacheLayout(2, 1, 40, 0), 16, torch.bfloat16, "cpu").k_scale == [None, None]


@pytest.fixture(scope="module")
def dense_ds(tmp_path_factory):
    return write_tiny_deepseek(tmp_path_factory.mktemp("ds-dense"), seed=0, first_k_dense_replace=3)


def _runner(path: str, kv: str, **backends) -> ModelRunner:
    cfg = ModelConfig.load(path, "float32", "cpu", kv_cache_dtype=kv, **backends)
    return ModelRunner(cfg, max_total_tokens=256, max_reqs=2, max_context=128)


def _logprobs(r: ModelRunner, n: int = 30) -> torch.Tensor:
    ids = _ids(n, 3)
    steps = [_extend(r, ids[:12]), _extend(r, ids[:24], prefix=12)]
    steps += [_extend(r, ids[: p + 1], prefix=p) for p in range(24, n)]
    return torch.cat([torch.cat(steps), _tree_logits(r, n)]).log_softmax(-1)  # [positions + tree nodes, V]


def test_logprob_deviation_vs_float32_kv(dense_ds):
    ref = _logprobs(_runner(dense_ds.path, "auto"))
    top = ref.argmax(-1, keepdim=True)
    for kv, max_dev, mean_dev, agree in (("fp8_e4m3", 0.6, 0.2, 0.9), ("bfloat16", 0.08, 0.02, 1.0)):
        r = _runner(dense_ds.path, kv)
        assert r.kv.k[0].dtype == resolve_kv_cache_dtype(kv, torch.float32)
        out = _logprobs(r)
        dev = (out.gather(1, top) - ref.gather(1, top)).abs()
        assert float(dev.max()) <= max_dev and float(dev.mean()) <= mean_dev, (kv, dev.max(), dev.mean())
        assert float((out.argmax(-1, keepdim=True) == top).float().mean()) >= agree, kv
        if kv == "fp8_e4m3":
            assert float(dev.max()) > 1e-3  # the cache really is fp8


def test_triton_kernels_over_fp8_cache_match_reference(dense_ds):
    pytest.importorskip("triton")
    ref = _logprobs(_runner(dense_ds.path, "fp8_e4m3", attention_backend="torch"), n=14)
    tri = _runner(dense_ds.path, "fp8_e4m3", attention_backend="triton")
    assert tri.model.layers[0].self_attn.backend == "triton"
    torch.testing.assert_close(_logprobs(tri, n=14), ref, atol=1e-4, rtol=1e-4)


def test_engine_greedy_fp8_plain_equals_ddtree_and_agrees_with_float32(dense_ds, tmp_path):
    from ddtree_serve.server.engine import Engine
    from tests.speculative.drafter_utils import write_random_drafter

    drafter = write_random_drafter(dense_ds.path, tmp_path / "d", num_layers=1, block_size=4)
    prompts = [_ids(7, 11), _ids(4, 12), _ids(12, 13)]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ddtree = dict(speculative_algorithm="ddtree", draft_model_path=drafter, ddtree_budget=5)
    got = {}
    for kv, spec in (("auto", {}), ("fp8_e4m3", {}), ("fp8_e4m3", ddtree)):
        eng = Engine(dense_ds.path, device="cpu", dtype="float32", max_total_tokens=256, kv_cache_dtype=kv, **spec)
        try:
            got[kv, bool(spec)] = [o.token_ids for o in eng.generate(input_ids=prompts, sampling_params=sp)]
        finally:
            eng.shutdown()
    assert got["fp8_e4m3", True] == got["fp8_e4m3", False]  # lossless over the same (fp8) cache
    common = []  # greedy agreement with the float32 cache: tokens before the first difference
    for a, b in zip(got["fp8_e4m3", False], got["auto", False], strict=True):
        common.append(next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a)))
    print("fp8 vs float32 KV, common greedy prefix per prompt:", common)
    assert min(common) >= 1 and sum(common) >= GREEDY_COMMON, common


def test_bad_inputs(dense_ds, default_model_path):
    with pytest.raises(ValueError, match="--kv-cache-dtype fp8_e4m3 is wired for MLA models"):
        ModelConfig.load(default_model_path, "float32", "cpu", kv_cache_dtype="fp8_e4m3")
    from ddtree_serve.server.engine import Engine

    with pytest.raises(ValueError, match="--kv-cache-dtype fp8_e4m3 is wired for MLA models"):  # start-up
        Engine(default_model_path, device="cpu", dtype="float32", kv_cache_dtype="fp8_e4m3", max_total_tokens=64)
    with pytest.raises(ValueError, match="kv_cache_dtype"):  # the config's choices
        Engine(default_model_path, device="cpu", dtype="float32", kv_cache_dtype="fp8", max_total_tokens=64)
    with pytest.raises(ValueError, match="--kv-cache-dtype must be one of"):
        ModelConfig.load(dense_ds.path, "float32", "cpu", kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="MLA latent caches only"):
        KVCache(KVCacheLayout(2, 3, 64, 64), 16, FP8_KV_DTYPE, "cpu")
    pytest.importorskip("triton")
    hf, fp8 = dense_ds.text_config, (torch.bfloat16, 101_376, FP8_KV_DTYPE)  # model dtype, smem, cache dtype
    with pytest.raises(ValueError, match=r"fp8 KV cache on compute capability >= 8.9 only \(this GPU: sm80\)"):
        resolve_kernel_backends(hf, "triton", "torch", "cuda", *fp8, arch=80)
    assert resolve_kernel_backends(hf, "auto", "torch", "cuda", *fp8, arch=80)[0] == "torch"
    assert resolve_kernel_backends(hf, "triton", "torch", "cuda", *fp8, arch=120)[0] == "triton"


def test_plan_reports_fp8_capacity(tmp_path, capsys):
    """``ddtree-serve plan`` on the B300 preset (Kimi K2.6's config.json, suffix drafts alone): fp8 KV takes
    61 x (576 + 8) B per token against 61 x 576 x 2 in bfloat16, so the pool holds ~1.97x the tokens; an fp8
    KV on an MHA model is serve's start-up error."""
    import json

    from ddtree_serve.server.cli.main import main

    (tmp_path / "config.json").write_text(open("tests/data/kimi-k2.6-config.json").read())
    base = ["plan", "--config", "configs/kimi-k2.6-8x-b300.yaml", "--model-path", str(tmp_path),
            "--speculative-draft-sources", "suffix", "--speculative-draft-model-path", "", "--json"]
    plans = {}
    for kv in ("bfloat16", "fp8_e4m3"):
        assert main([*base, "--kv-cache-dtype", kv]) == 0
        plans[kv] = json.loads(capsys.readouterr().out)
    assert (plans["bfloat16"]["kv_bytes_per_token"], plans["fp8_e4m3"]["kv_bytes_per_token"]) == (70272, 35624)
    assert plans["fp8_e4m3"]["kv_tokens"] > 1.9 * plans["bfloat16"]["kv_tokens"]
    with pytest.raises(SystemExit):
        main([*base, "--kv-cache-dtype", "fp8"])
    capsys.readouterr()
    with pytest.raises(ValueError, match="wired for MLA models"):
        _mha_fp8(tmp_path / "mha")


def _mha_fp8(path) -> None:
    """A tiny Llama config.json loaded with fp8 KV (raises as serve's start-up does)."""
    import json

    path.mkdir()
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
        "intermediate_size": 128, "vocab_size": 100, "max_position_embeddings": 64}))
    ModelConfig.load(str(path), "bfloat16", "cpu", kv_cache_dtype="fp8_e4m3")
