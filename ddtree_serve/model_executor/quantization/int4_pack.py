"""compressed-tensors ``pack-quantized`` INT4 (the format of Kimi K2.x routed experts).

Layout, per quantized linear with dense weight ``W [out, in]`` (the checkpoint tensors end in):

- ``weight_packed`` int32 ``[out, ceil(in / 8)]``: along the input dim, value ``j`` of a row lives in word
  ``j // 8`` at bits ``4 * (j % 8)`` (least significant nibble first). Each nibble holds ``q + 8`` for a
  signed value ``q`` in ``[-8, 7]`` (offset binary; no sign extension inside the word).
- ``weight_scale`` (BF16) ``[out, in / group]``: one scale per ``group`` consecutive input columns.
- ``weight_shape`` integer ``[2]``: ``(out, in)`` of the dense weight.

Symmetric: no zero point, ``W = q * scale`` (scale broadcast over its group). Quantization as the
compressed-tensors minmax observer does it: ``scale = absmax(group) / 7.5``, ``q = clamp(round(W / scale),
-8, 7)``.

Two ways to serve it (``ModelConfig.int4_experts``): "dequant" (the CPU default) dequantizes at load
(``dequantize_int4``) and runs dense experts; "packed" (the CUDA default) keeps ``weight_packed`` /
``weight_scale`` resident and dequantizes per expert on the fly (layers/moe_int4.py). The fast CUDA path
would run a grouped WNA16 MoE kernel over them (Marlin-style, as sgl-kernel / vLLM ship for compressed-tensors
W4A16 MoE, which works on sm120 RTX PRO 6000 where DeepGEMM and FlashMLA do not; Marlin needs its own
repacking at load): not wired yet.
"""

from __future__ import annotations

import torch

PACK_FACTOR = 8  # int4 values per int32 word
OFFSET = 8  # nibble = q + 8


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Signed int4 values (int8 ``[..., n]``, each in [-8, 7]) -> int32 ``[..., ceil(n / 8)]``."""
    if q.dtype != torch.int8:
        raise ValueError(f"pack_int4 expects int8 values, got {q.dtype}")
    if bool((q < -8).any()) or bool((q > 7).any()):
        raise ValueError("int4 values must lie in [-8, 7]")
    n = q.shape[-1]
    pad = (-n) % PACK_FACTOR
    u = (q.to(torch.int64) + OFFSET)  # [..., n] nibbles 0..15
    if pad:
        u = torch.nn.functional.pad(u, (0, pad))
    u = u.view(*q.shape[:-1], -1, PACK_FACTOR)  # [..., words, 8]
    shifts = torch.arange(PACK_FACTOR, dtype=torch.int64, device=q.device) * 4  # [8]
    words = (u << shifts).sum(-1)  # [..., words] in [0, 2^32)
    words = torch.where(words >= 2**31, words - 2**32, words)  # reinterpret as signed int32
    return words.to(torch.int32)


def unpack_int4(packed: torch.Tensor, n: int) -> torch.Tensor:
    """int32 ``[..., words]`` -> signed int4 values as int8 ``[..., n]`` (inverse of ``pack_int4``)."""
    if packed.dtype != torch.int32:
        raise ValueError(f"unpack_int4 expects int32 words, got {packed.dtype}")
    shifts = torch.arange(PACK_FACTOR, dtype=torch.int32, device=packed.device) * 4  # [8]
    nib = (packed[..., None] >> shifts) & 0xF  # [..., words, 8]; & drops the arithmetic-shift sign bits
    vals = nib.flatten(-2)[..., :n] - OFFSET  # [..., n]
    return vals.to(torch.int8)


def quantize_int4(w: torch.Tensor, group_size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric group quantization of ``w [out, in]`` -> (q int8 ``[out, in]``, scale ``[out, in / group]``
    in ``w.dtype``). ``in`` must divide by ``group_size``."""
    out_f, in_f = w.shape
    if in_f % group_size:
        raise ValueError(f"input dim {in_f} is not a multiple of group size {group_size}")
    g = w.float().view(out_f, in_f // group_size, group_size)  # [out, G, group]
    scale = (g.abs().amax(-1) / 7.5).to(w.dtype)  # [out, G] rounded to the stored dtype first
    s = scale.float().clamp_min(torch.finfo(torch.float32).tiny)[..., None]  # [out, G, 1]
    q = torch.round(g / s).clamp(-8, 7).to(torch.int8).view(out_f, in_f)
    return q, scale


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, shape: tuple[int, int] | torch.Tensor,
                    dtype: torch.dtype) -> torch.Tensor:
    """(weight_packed, weight_scale, weight_shape) -> dense ``W [out, in]`` in ``dtype``. The group size is
    ``in / scale.shape[-1]``."""
    out_f, in_f = (int(x) for x in (shape.tolist() if isinstance(shape, torch.Tensor) else shape))
    if in_f % scale.shape[-1]:
        raise ValueError(f"weight_scale {tuple(scale.shape)} does not tile input dim {in_f}")
    group = in_f // scale.shape[-1]
    q = unpack_int4(packed, in_f).float().view(out_f, in_f // group, group)  # [out, G, group]
    w = q * scale.float()[..., None]  # [out, G, group]
    return w.view(out_f, in_f).to(dtype)


def pack_quantized(w: torch.Tensor, group_size: int = 32) -> dict[str, torch.Tensor]:
    """Dense ``w [out, in]`` -> the three checkpoint tensors (suffixes of ``<module>.``)."""
    q, scale = quantize_int4(w, group_size)
    return {"weight_packed": pack_int4(q), "weight_scale": scale,
            "weight_shape": torch.tensor(list(w.shape), dtype=torch.int64)}


def packed_nbytes(out_features: int, in_features: int, group_size: int = 32, scale_bytes: int = 2) -> int:
    """Bytes one pack-quantized linear occupies (packed words + scales + the shape vector)."""
    words = out_features * -(-in_features // PACK_FACTOR)
    return words * 4 + out_features * (in_features // group_size) * scale_bytes + 2 * 8
