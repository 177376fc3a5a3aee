"""Routed experts kept in memory as compressed-tensors pack-quantized INT4 (Kimi K2.x), never dequantized
as a whole: 4.25 bits per weight resident instead of 16 (Kimi K2.6 at TP 8: ~66 GiB of experts per GPU
instead of ~250 GiB).

Storage per local expert (layout: ``quantization/int4_pack.py``; ``g`` = group size, 32 for Kimi):
``w13_packed`` int32 ``[E_r, 2 * I_r, H / 8]`` with ``w13_scale`` ``[E_r, 2 * I_r, H / g]`` ([gate; up] rows)
and ``w2_packed`` int32 ``[E_r, H, I_r / 8]`` with ``w2_scale`` ``[E_r, H, I_r / g]``. TP slices whole rows
of gate/up and whole quantization groups of down's input columns, so ``I_r`` must be a multiple of ``g``
(Kimi at TP 8: 2048 / 8 = 256); expert parallelism holds whole experts.

Compute, backend "torch" (the reference, every device): each expert that received tokens is dequantized
on the fly into a temporary dense weight for its GEMM. Exact (the same ``dequantize_int4`` as the load-time
path), memory-light, but it moves ~4x the INT4 bytes per step. Backend "triton": the W4A16 grouped GEMM of
ddtree_serve/kernels/triton_moe.py reads these packed words and scales directly, dequantizing tile by tile in registers
(no dense copy). A Marlin-style kernel (sgl-kernel / vLLM ``fused_marlin_moe``, after their repacking at
load) is not wired.
"""

from __future__ import annotations

import torch
from torch import nn

from ddtree_serve.model_executor.layers.moe_experts import FusedExperts
from ddtree_serve.model_executor.parallel_state import TPGroup
from ddtree_serve.model_executor.quantization.int4_pack import PACK_FACTOR, dequantize_int4

PACKED_PARTS = ("weight_packed", "weight_scale")


class Int4Experts(FusedExperts):
    """``FusedExperts`` (same routing, TP/EP layout and output contract) over INT4-resident weights."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, tp: TPGroup, dtype: torch.dtype,
                 group_size: int, backend: str = "torch"):
        self.group, self.hidden = group_size, hidden
        super().__init__(num_experts, hidden, intermediate, tp, dtype, backend)

    def _make_weights(self, hidden: int, dtype: torch.dtype) -> None:
        g, n = self.group, self.inter
        if hidden % g or n % g or g % PACK_FACTOR:
            raise ValueError(f"INT4 experts: hidden {hidden} and the per-rank intermediate size {n} must be "
                             f"multiples of the group size {g} (use --int4-experts dequant or --expert-parallel)")

        def param(*shape: int, dt: torch.dtype) -> nn.Parameter:
            p = nn.Parameter(torch.empty(*shape, dtype=dt), requires_grad=False)
            p.weight_loader = self._load_packed  # type: ignore[attr-defined]
            return p

        e = self.num_local
        self.w13_packed = param(e, 2 * n, hidden // PACK_FACTOR, dt=torch.int32)
        self.w13_scale = param(e, 2 * n, hidden // g, dt=dtype)
        self.w2_packed = param(e, hidden, n // PACK_FACTOR, dt=torch.int32)
        self.w2_scale = param(e, hidden, n // g, dt=dtype)

    def _load_packed(self, param: torch.Tensor, loaded, shard_id: tuple[int, str]) -> None:
        """shard_id = (global expert id, "gate" | "up" | "down"); ``loaded`` is this projection's
        ``weight_packed`` or ``weight_scale`` (tensor or lazy slice): rows for gate/up, whole groups (or
        whole int32 words) of input columns for down. Other ranks' experts are skipped unread."""
        expert, kind = shard_id
        local = expert - self.expert_start
        if not 0 <= local < self.num_local:
            return
        dst = param.data[local]
        s, n = self.inter_start, self.inter
        if kind == "down":  # columns in units of words (packed) or groups (scale)
            unit = PACK_FACTOR if param.dtype == torch.int32 else self.group
            dst.copy_(loaded.narrow(-1, s // unit, n // unit))
        else:
            off = 0 if kind == "gate" else n
            dst[off:off + n].copy_(loaded.narrow(0, s, n))

    def forward_triton(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, invariant: bool = False
                       ) -> torch.Tensor:
        from ddtree_serve.kernels.triton_moe import fused_moe

        return fused_moe(x, weights, ids, self.w13_packed, self.w2_packed, self.expert_start,
                         w13_scale=self.w13_scale, w2_scale=self.w2_scale, group_size=self.group, invariant=invariant)

    def expert_weights(self, e: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        n, h = self.inter, self.hidden
        w13 = dequantize_int4(self.w13_packed[e], self.w13_scale[e], (2 * n, h), dtype)  # [2 * I_r, H]
        w2 = dequantize_int4(self.w2_packed[e], self.w2_scale[e], (h, n), dtype)  # [H, I_r]
        return w13, w2
