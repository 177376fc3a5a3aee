"""The Triton MLA launch plan (ddtree_serve/kernels/triton_mla_plan.py) on CPU: tiles within the device's shared memory
(issue 33 item 7: float32 on sm120 needed 112,704 B of 101,376), the reference when nothing fits (backend
resolution, with a log line), and the split-K count chosen by context length and launch size (item 8)."""

from __future__ import annotations

import logging

import pytest
import torch

from ddtree_serve.kernels.triton_mla_plan import (
    COMPILED_SMEM,
    MAX_SPLITS,
    SMEM_OPTIN_BYTES,
    choose_kv_splits,
    choose_mla_tiles,
    device_sm_count,
    device_smem_limit,
    mla_smem_bytes,
    tiles_for,
)
from ddtree_serve.model_executor.kernel_backends import resolve_kernel_backends

SM120, SM90 = SMEM_OPTIN_BYTES[(12, 0)], SMEM_OPTIN_BYTES[(9, 0)]
KIMI = dict(kv_lora_rank=512, qk_rope_head_dim=64)  # latent 512 + rope 64; 8 local heads at TP 8


def test_estimate_matches_the_compiled_kernels():
    """The presets' tiles (bfloat16, latent 512 + rope 64) take the compiled figure (``COMPILED_SMEM``, checked
    against the cubins by benchmarks/triton_smem_check.py); other dtypes keep the estimate, which equals or lies
    above the float32 cubins read with Triton 3.9 (4 warps, no launch hints; not a preset dtype)."""
    for (arch, cache, bh, bn), shared in COMPILED_SMEM.items():
        cache_dtype = torch.float8_e4m3fn if cache == "fp8" else None
        assert mla_smem_bytes(bh, bn, 512, 64, torch.bfloat16, arch, cache_dtype) == shared
        assert mla_smem_bytes(bh, bn, 512, 64, torch.bfloat16, None, cache_dtype) >= shared  # arch unknown
    fp32 = {(16, 32, 120): 112_704, (16, 16, 120): 74_816, (32, 16, 120): 112_768, (64, 16, 120): 188_672,
            (64, 32, 90): 229_632}  # (BLOCK_H, BLOCK_N, arch): bytes
    for (bh, bn, arch), shared in fp32.items():
        assert mla_smem_bytes(bh, bn, 512, 64, torch.float32, arch) == shared, (bh, bn, arch)


def test_preset_tiles_stay_within_registers():
    """At most 32 rows per program (16 over an fp8 cache) and 8 warps: the tiles benchmarks/triton_smem_check.py
    compiles without spills on sm90 / sm100 / sm103 / sm120 (64 rows spilled at 4 and at 8 warps)."""
    for arch in (90, 100, 103, 120):
        limit = SMEM_OPTIN_BYTES[(arch // 10, arch % 10)]
        for heads in (8, 64):
            t = choose_mla_tiles(heads, 512, 64, torch.bfloat16, limit, arch)
            assert (t.block_h, t.block_n, t.num_warps) == (16 if heads == 8 else 32, 32, 8)
            f = choose_mla_tiles(heads, 512, 64, torch.bfloat16, limit, arch, torch.float8_e4m3fn)
            assert (f.block_h, f.block_n, f.num_warps) == (16, 32, 8)
            assert max(t.smem_bytes, f.smem_bytes) <= limit


def test_fp32_on_sm120_takes_smaller_tiles():
    preferred = choose_mla_tiles(8, 512, 64, torch.float32, None)
    assert (preferred.block_h, preferred.block_n, preferred.smem_bytes) == (16, 32, 112_704)
    assert preferred.smem_bytes > SM120  # the configuration item 7 found
    t = choose_mla_tiles(8, 512, 64, torch.float32, SM120)
    assert (t.block_h, t.block_n) == (16, 16) and t.smem_bytes <= SM120
    assert choose_mla_tiles(8, 512, 64, torch.float32, SM90) == preferred  # Hopper keeps them
    assert choose_mla_tiles(8, 512, 64, torch.bfloat16, SM120).block_n == 32  # bf16 fits as it was


def test_wide_head_blocks_shrink_keys_first_then_heads():
    bf16 = choose_mla_tiles(64, 512, 64, torch.bfloat16, SM120, 120)  # TP 1 of a 64-head model
    assert (bf16.block_h, bf16.block_n) == (32, 32)  # at most 32 heads per program (registers)
    fp32 = choose_mla_tiles(64, 512, 64, torch.float32, SM120)
    assert (fp32.block_h, fp32.block_n) == (16, 16)
    for heads in (1, 8, 16, 20, 64, 128):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            for limit in (SM120, SM90, SMEM_OPTIN_BYTES[(8, 0)]):
                for arch in (None, 90, 100, 120):
                    t = choose_mla_tiles(heads, 512, 64, dtype, limit, arch)
                    assert t.smem_bytes <= limit and t.block_h <= max(16, heads * 2)


def test_nothing_fits_raises_at_launch_and_resolves_to_the_reference(caplog, monkeypatch):
    monkeypatch.delenv("DDTREE_KERNELS", raising=False)  # "auto" on a CUDA device name picks triton
    assert choose_mla_tiles(8, 1024, 64, torch.float32, SM120) is None
    with pytest.raises(RuntimeError, match="does not fit"):
        tiles_for(8, 1024, 64, torch.float32, SM120)
    wide = dict(kv_lora_rank=1024, qk_rope_head_dim=64)  # 16 x 16 tiles need 140,352 B
    assert resolve_kernel_backends(KIMI, "auto", "torch", "cuda", torch.float32, smem_limit=SM120)[0] == "triton"
    with caplog.at_level(logging.INFO, logger="ddtree_serve.model_executor.kernel_backends"):
        got = resolve_kernel_backends(wide, "auto", "torch", "cuda", torch.float32, smem_limit=SM120)
    assert got[0] == "torch" and "torch reference" in caplog.text and "101376 B" in caplog.text
    with pytest.raises(ValueError, match="shared memory"):
        resolve_kernel_backends(wide, "triton", "torch", "cuda", torch.float32, smem_limit=SM120)
    # Kimi's latent fits with its smallest tiles on every GPU: triton stays
    assert resolve_kernel_backends(KIMI, "triton", "torch", "cuda", torch.float32, smem_limit=SM120)[0] == "triton"
    assert resolve_kernel_backends(wide, "triton", "torch", "cuda", torch.float32, smem_limit=SM90)[0] == "triton"


def test_shrunk_tiles_are_logged_once(caplog):
    with caplog.at_level(logging.INFO, logger="ddtree_serve.kernels.triton_mla_plan"):
        a = tiles_for(8, 512, 64, torch.float32, SM120)
        b = tiles_for(8, 512, 64, torch.float32, SM120)
    assert a == b and a.block_n == 16
    assert caplog.text.count("BLOCK_N 16") <= 1  # memoised (0 when an earlier test already asked)


def test_split_count_by_context_and_launch():
    sms = 132  # H100 / H200
    assert choose_kv_splits(1, 131_072, sms) == MAX_SPLITS  # Kimi TP 8, batch 1, 128k: one program alone
    assert choose_kv_splits(1, 4096, sms) == 8  # each split walks >= 512 keys
    assert choose_kv_splits(1, 1023, sms) == 1  # short contexts never split
    assert choose_kv_splits(8, 32_768, sms) == 33  # two programs per SM
    assert choose_kv_splits(17, 65_536, sms) == 16  # a 17-node tree of one request
    assert choose_kv_splits(128 * 17, 262_144, sms) == 1  # big batches fill the GPU on their own
    assert choose_kv_splits(264, 262_144, sms) == 1
    assert choose_kv_splits(1, 262_144, None) == 1  # CPU: no SM count, no split
    assert device_sm_count("cpu", None) is None and device_smem_limit("cpu", None) is None


@pytest.mark.slow
def test_preset_kernels_compile_without_spills_within_shared_memory():
    """Compile every MLA kernel the presets launch (and the sampling kernel) as their real launches specialise them
    (alignment hints), for sm90, sm100, sm103 and sm120, with Triton's ptxas (no GPU needed): no spilled byte,
    shared memory within each arch's limit and equal to the plan's figure (~5 min on 2 cores)."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    cmd = [sys.executable, "benchmarks/triton_smem_check.py", "--jobs", "2"]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    assert res.returncode == 0 and "ALL OK" in res.stdout, res.stdout[-6000:] + res.stderr[-3000:]
    assert "B spilled" in res.stdout and "sm103" in res.stdout and "_sample_rows" in res.stdout
    assert "_rmsnorm_kernel" in res.stdout
