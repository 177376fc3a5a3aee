"""Grouped dynamic causal convolution around a DFlash drafter's sublayers (the DFlash2 variant of github
z-lab/dflash, without its candidate selector; docs/DESIGN.md 4.5).

Each wrapped sublayer (attention, MLP) of a decoder layer gets a two-stage convolution over the block's token
axis: ``prepare`` convolves the sublayer's input, the sublayer runs on that, and ``finish`` convolves its
output. A stage with ``K`` taps computes, at block position ``t`` and channel ``c`` of group ``g``,

    y[t, c] = sum_{o < K} (base[o, c] + dyn[t, o, g]) * x[t - o, c]     (x[t - o] = 0 before the block's start)

with ``base`` a learned per-channel kernel and ``dyn`` a per-group kernel projected from the stage-0 input at
the OUTPUT position ``t`` (``kernel_projection``: H -> 2*K*G; stage 0 uses the first half, stage 1 the
second). The shift acts along the block axis of ``[n_blocks, B, H]`` only, so a block never sees the one
before it. ``identity_`` sets both stages to ``y = x``: the wrapped drafter then computes what the plain one
does (the starting point of training and of a warm start from a plain drafter).

Config (``dflash_config``, z-lab's keys): ``conv_kernel_size`` (0 or absent: no convolution) and
``conv_group_size`` (default 16). Checkpoint names: ``layers.N.{attention,mlp}_conv.base_kernel`` [2, K, H]
and ``layers.N.{attention,mlp}_conv.kernel_projection.weight`` [2*K*G, H].
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ddtree_serve.model_executor.layers.linear import ReplicatedLinear

DEFAULT_GROUP_SIZE = 16
_SELECTOR_KEYS = ("selector_rank", "selector_top_k")


def conv_settings(hf: dict[str, Any]) -> tuple[int, int]:
    """``(kernel_size, group_size)`` of a drafter config (``dflash_config`` first, then the top level);
    ``(0, 0)`` without a convolution. ValueError when the hidden size is not a multiple of the group size."""
    dcfg = hf.get("dflash_config") or {}
    k = int(dcfg.get("conv_kernel_size", hf.get("conv_kernel_size")) or 0)
    if k <= 0:
        return 0, 0
    gs = int(dcfg.get("conv_group_size", hf.get("conv_group_size")) or DEFAULT_GROUP_SIZE)
    hidden = int(hf["hidden_size"])
    if gs <= 0 or hidden % gs:
        raise ValueError(f"DFlash conv_group_size {gs} does not divide the drafter's hidden size {hidden}")
    return k, gs


def check_no_candidate_selector(hf: dict[str, Any], what: str) -> None:
    """ValueError for a z-lab DFlash2 drafter (``architectures`` DFlash2DraftModel or selector keys in
    ``dflash_config``): its candidate selector re-scores each depth given the previous token, while DDTree's
    tree builder needs the drafter's independent per-depth distributions."""
    dcfg = hf.get("dflash_config") or {}
    keys = [k for k in _SELECTOR_KEYS if k in dcfg or k in hf]
    if "DFlash2DraftModel" in (hf.get("architectures") or []) or keys:
        found = f" (dflash_config has {', '.join(keys)})" if keys else ""
        raise ValueError(f"{what} is a DFlash2 drafter with a candidate selector{found}: the candidate selector is "
                         "not supported (DDTree needs independent per-depth distributions); a drafter with the "
                         "grouped dynamic convolution alone (dflash_config.conv_kernel_size) is")


def grouped_dynamic_conv(x: torch.Tensor, dyn: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """One stage. x [n, B, H] (n blocks of B tokens), dyn [n, B, K, G] (per output position, tap, group),
    base [K, H] -> [n, B, H]; position t of a block reads x[t - o] of the same block only."""
    n, blk, hidden = x.shape
    taps, groups = dyn.shape[-2], dyn.shape[-1]
    xg = x.view(n, blk, groups, hidden // groups)  # [n, B, G, gs]
    base = base.to(x.dtype).view(taps, groups, hidden // groups)  # [K, G, gs]
    out = (base[0] + dyn[:, :, 0, :, None]) * xg  # [n, B, G, gs]
    for o in range(1, min(taps, blk)):  # a tap reaching past the block's start reads zeros only
        shifted = F.pad(xg[:, :blk - o], (0, 0, 0, 0, o, 0))  # [n, B, G, gs]: position t holds x[t - o]
        out = out + (base[o] + dyn[:, :, o, :, None]) * shifted
    return out.view(n, blk, hidden)


class GroupedDynamicCausalConv(nn.Module):
    """The two-stage convolution around one sublayer; parameters ``base_kernel`` [2, K, H] and
    ``kernel_projection`` (H -> 2*K*G, no bias), replicated on every TP rank (it acts on full hidden states)."""

    def __init__(self, hidden: int, kernel_size: int, group_size: int, dtype: torch.dtype):
        super().__init__()
        if kernel_size <= 0 or group_size <= 0 or hidden % group_size:
            raise ValueError(f"bad conv shape: hidden {hidden}, kernel {kernel_size}, group {group_size}")
        self.kernel_size, self.group_size, self.groups = kernel_size, group_size, hidden // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden, dtype=dtype), requires_grad=False)
        self.kernel_projection = ReplicatedLinear(hidden, 2 * kernel_size * self.groups, False, dtype)
        self.identity_()

    @torch.no_grad()
    def identity_(self) -> GroupedDynamicCausalConv:
        """Both stages become ``y = x``: tap 0 of the base kernel 1, the other taps and the projection 0."""
        self.base_kernel.zero_()
        self.base_kernel[:, 0, :] = 1.0
        self.kernel_projection.weight.zero_()
        return self

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [n, B, H] (the sublayer's normed input) -> (stage-0 output [n, B, H], stage-1 kernel [n, B, K, G])."""
        dyn = self.kernel_projection(x).view(*x.shape[:-1], 2, self.kernel_size, self.groups)  # [n, B, 2, K, G]
        return grouped_dynamic_conv(x, dyn[:, :, 0], self.base_kernel[0]), dyn[:, :, 1]

    def finish(self, x: torch.Tensor, dyn: torch.Tensor) -> torch.Tensor:
        """x [n, B, H] (the sublayer's output), dyn [n, B, K, G] from ``prepare`` -> [n, B, H]."""
        return grouped_dynamic_conv(x, dyn, self.base_kernel[1])


def conv_prepare(conv: GroupedDynamicCausalConv | None, x: torch.Tensor,
                 block: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-major form of ``prepare``: x [T, H] with T = n * ``block`` (each block's tokens contiguous) ->
    (x' [T, H], stage-1 kernel or None); the identity without a convolution."""
    if conv is None:
        return x, None
    y, dyn = conv.prepare(x.view(-1, block, x.shape[-1]))  # [n, B, H], [n, B, K, G]
    return y.view_as(x), dyn


def conv_finish(conv: GroupedDynamicCausalConv | None, x: torch.Tensor, dyn: torch.Tensor | None,
                block: int) -> torch.Tensor:
    """Token-major form of ``finish``: x [T, H] -> [T, H]; the identity without a convolution."""
    if conv is None or dyn is None:
        return x
    return conv.finish(x.view(-1, block, x.shape[-1]), dyn).view_as(x)
