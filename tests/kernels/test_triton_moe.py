"""Triton fused MoE (ddtree_serve/kernels/triton_moe.py) under ``TRITON_INTERPRET=1`` against the torch reference experts
(layers/moe.py ``FusedExperts``, layers/moe_int4.py ``Int4Experts``) at tiny shapes.

Tolerances: float32 atol 1e-5 / rtol 1e-5 (same products, float32 accumulation in another order); bfloat16
atol 2e-2 / rtol 2e-2 (the kernel keeps gate/up in float32 through the activation where the reference
rounds them to bfloat16 first). INT4 compares against the reference's own dequantization of the same words.
"""

from __future__ import annotations

import pytest
import torch

from ddtree_serve.kernels.moe_align import align_pairs_by_expert
from ddtree_serve.model_executor.layers.moe_experts import FusedExperts
from ddtree_serve.model_executor.layers.moe_int4 import Int4Experts
from ddtree_serve.model_executor.parallel_state import TPGroup
from ddtree_serve.model_executor.quantization.int4_pack import pack_quantized

pytest.importorskip("triton")

E, H, N_I = 8, 96, 64  # H = 3 INT4 groups of 32 (a 64-wide K tile straddles a group boundary), N_I = 2 groups


def _dense_experts(seed: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(E, 2 * N_I, H, generator=g) * 0.1).to(dtype)  # [E, 2I, H] = [gate; up]
    w2 = (torch.randn(E, H, N_I, generator=g) * 0.1).to(dtype)  # [E, H, N_I]
    return w13, w2


def _load(mod: FusedExperts, w13: torch.Tensor, w2: torch.Tensor, int4: bool) -> FusedExperts:
    """Feed per-expert checkpoint tensors through the modules' own weight loaders (TP/EP slicing included)."""
    for e in range(E):
        parts = {"gate": w13[e, :N_I], "up": w13[e, N_I:], "down": w2[e]}
        for kind, w in parts.items():
            if int4:
                packed = pack_quantized(w, 32)
                name = "w2" if kind == "down" else "w13"
                for suffix, key in (("packed", "weight_packed"), ("scale", "weight_scale")):
                    p = getattr(mod, f"{name}_{suffix}")
                    p.weight_loader(p, packed[key], (e, kind))
            else:
                p = mod.w2 if kind == "down" else mod.w13
                p.weight_loader(p, w, (e, kind))
    return mod


def _experts(int4: bool, tp: TPGroup, backend: str, dtype: torch.dtype, seed: int = 0) -> FusedExperts:
    w13, w2 = _dense_experts(seed, dtype)
    mod = (
        Int4Experts(E, H, N_I, tp, dtype, 32, backend)
        if int4
        else FusedExperts(E, H, N_I, tp, dtype, backend)
    )
    return _load(mod, w13, w2, int4)


def _routing(t: int, k: int, seed: int, experts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    pool = torch.tensor(experts)
    ids = torch.stack([pool[torch.randperm(len(experts), generator=g)[:k]] for _ in range(t)])  # [T, k]
    return torch.rand(t, k, generator=g) * 2, ids


def test_align_groups_each_local_pair_once_in_single_expert_blocks():
    ids = torch.tensor([[5, 1], [1, 3], [3, 5], [7, 1], [6, 0]])  # expert 2 and 4 get no pairs
    for start, num_local, bm in ((0, 8, 4), (4, 4, 2), (2, 3, 16)):
        a = align_pairs_by_expert(ids, start, num_local, bm)
        flat = ids.reshape(-1) - start
        rows = a.sorted_pairs.view(-1, bm).long()  # [B, bm]
        real = rows < a.num_pairs
        got = sorted(rows[real].tolist())
        want = [p for p in range(ids.numel()) if 0 <= flat[p] < num_local]
        assert got == want
        for b in range(rows.shape[0]):
            pairs = rows[b][real[b]]
            if a.block_expert[b] < 0:
                assert pairs.numel() == 0
            else:
                assert pairs.numel() > 0 and bool((flat[pairs] == a.block_expert[b]).all())
                assert pairs.tolist() == sorted(pairs.tolist())  # stable within an expert


@pytest.mark.parametrize("int4", [False, True])
@pytest.mark.parametrize("t", [1, 5, 37])
def test_fused_moe_matches_reference_ragged(int4, t):
    """Ragged token counts (1 to more than two BLOCK_M blocks per expert); only experts 0, 3, 5, 6 routed,
    so the others receive no tokens."""
    ref = _experts(int4, TPGroup(), "torch", torch.float32)
    tri = _experts(int4, TPGroup(), "triton", torch.float32)
    x = torch.randn(t, H, generator=torch.Generator().manual_seed(t))
    weights, ids = _routing(t, 2, t, [0, 3, 5, 6])
    torch.testing.assert_close(tri(x, weights, ids), ref(x, weights, ids), atol=1e-5, rtol=1e-5)


def test_fused_moe_bf16_dense_and_int4():
    x = torch.randn(9, H, generator=torch.Generator().manual_seed(3)).bfloat16()
    weights, ids = _routing(9, 3, 3, list(range(E)))
    for int4 in (False, True):
        ref = _experts(int4, TPGroup(), "torch", torch.bfloat16)(x, weights, ids)
        got = _experts(int4, TPGroup(), "triton", torch.bfloat16)(x, weights, ids)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), ref.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("expert_parallel", [False, True])
@pytest.mark.parametrize("int4", [False, True])
def test_fused_moe_tp_and_ep_partial_sums_add_up(int4, expert_parallel):
    """TP 2: each rank's slice of the intermediate dim (INT4: one whole group each) or, under expert
    parallelism, its 4 whole experts; the ranks' partial sums add up to the unsharded reference."""
    x = torch.randn(6, H, generator=torch.Generator().manual_seed(11))
    weights, ids = _routing(6, 2, 11, list(range(E)))
    full = _experts(int4, TPGroup(), "torch", torch.float32)(x, weights, ids)
    parts = []
    for rank in range(2):
        tp = TPGroup(rank, 2, expert_parallel=expert_parallel)
        mod = _experts(int4, tp, "triton", torch.float32)
        ref_rank = _experts(int4, tp, "torch", torch.float32)(x, weights, ids, reduce=False)
        got = mod(x, weights, ids, reduce=False)
        torch.testing.assert_close(got, ref_rank, atol=1e-5, rtol=1e-5)
        parts.append(got)
    torch.testing.assert_close(parts[0] + parts[1], full, atol=1e-5, rtol=1e-5)
