"""FP8 (float8_e4m3fn) storage of the MLA latent KV cache (``--kv-cache-dtype fp8_e4m3``).

Format. A cache row (one token, one layer) is ``[c_kv (L) ; k_pe (R)]`` stored as float8_e4m3fn, plus two
float32 scales in a side buffer ``k_scale [slots, 2]``: ``(s_lat, s_pe)``, one per part, per token. Each scale
is a power of two, ``s = 2 ** ceil(log2(amax / 448))`` over that part of that row (448: e4m3fn's largest
finite value; ``s = 1`` for an all-zero part), so ``x / s`` is exact and only the final rounding to e4m3
(3 mantissa bits, round-to-nearest-even) loses precision:

    stored   q = e4m3(x / s)          |x / s| <= 448 by construction (no saturation, no NaN)
    read     x' = float(q) * s        exact in float32
    error    |x - x'| <= 2^-4 |x|     for |x / s| >= 2^-6 (e4m3's smallest normal); below that the absolute
                                      error is at most 2^-10 s (subnormal spacing 2^-9, half of it)

Per-token scales (not a static per-layer scale such as SGLang's default ``k_scale = 1.0``) need no
calibration and keep the relative error bound whatever the checkpoint's activation range; separate scales for
the latent and the rope part keep a small ``k_pe`` from being flushed by a large ``c_kv``. Power-of-two scales
make dequantization exact and quantization idempotent (``quantize(dequantize(q, s)) == (q, s)``). Readers
(the torch reference in ddtree_serve/model_executor/layers/mla.py and the Triton kernels) dequantize a key tile to the
query's dtype before the dot products: two float32 loads per key on top of ``L + R`` bytes.

Bytes per token and layer: ``L + R + 8`` (Kimi K2.6: 584) against ``2 (L + R)`` in bfloat16 (1152): 0.507x.
"""

from __future__ import annotations

import torch

FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
SCALES_PER_ROW = 2  # (latent, rope) float32 scales per cache row
SCALE_BYTES_PER_ROW = SCALES_PER_ROW * 4

# --kv-cache-dtype values (SGLang's spelling) -> cache dtype; "auto" = the model's dtype
KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8_e4m3")


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == FP8_KV_DTYPE


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """``--kv-cache-dtype`` -> the cache's torch dtype (ValueError naming the flag for anything else)."""
    if name == "auto":
        return model_dtype
    if name == "bfloat16":
        return torch.bfloat16
    if name == "fp8_e4m3":
        return FP8_KV_DTYPE
    raise ValueError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {name!r}")


def kv_elem_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def pow2_scale(amax: torch.Tensor) -> torch.Tensor:
    """Smallest power of two ``s`` with ``amax / s <= 448`` (1 where ``amax`` is 0). amax float32 [...]."""
    s = torch.exp2(torch.ceil(torch.log2(amax / FP8_MAX)))
    return torch.where(amax > 0, s, torch.ones_like(s))


def quantize_latent(latent: torch.Tensor, lat: int) -> tuple[torch.Tensor, torch.Tensor]:
    """latent [T, W] or [T, 1, W] (W = L + R, any float dtype) -> (fp8 rows of the same shape, scales [T, 2]
    float32)."""
    x = latent.float().reshape(latent.shape[0], -1)  # [T, W]
    parts = (x[:, :lat], x[:, lat:])
    scales = torch.stack([pow2_scale(p.abs().amax(dim=1)) if p.shape[1] else torch.ones(x.shape[0], device=x.device)
                          for p in parts], dim=1)  # [T, 2]
    q = torch.cat([(p / scales[:, i : i + 1]).clamp(-FP8_MAX, FP8_MAX) for i, p in enumerate(parts)], dim=1)
    return q.to(FP8_KV_DTYPE).view(latent.shape), scales


def dequantize_latent(q: torch.Tensor, scales: torch.Tensor, lat: int, dtype: torch.dtype) -> torch.Tensor:
    """fp8 rows q [N, W] (or [N, 1, W]) with scales [N, 2] -> [same shape] in ``dtype``."""
    x = q.float().reshape(q.shape[0], -1)  # [N, W]
    out = torch.cat([x[:, :lat] * scales[:, :1], x[:, lat:] * scales[:, 1:2]], dim=1)
    return out.to(dtype).view(q.shape)


def write_latent(k_cache: torch.Tensor, k_scale: torch.Tensor | None, loc: torch.Tensor, latent: torch.Tensor,
                 lat: int) -> None:
    """Store latent rows [T, 1, W] at slots ``loc`` [T]: quantized with their scales when ``k_scale`` is given
    (an fp8 cache), else cast to the cache dtype."""
    if k_scale is None:
        k_cache[loc] = latent.to(k_cache.dtype)
        return
    q, s = quantize_latent(latent, lat)
    k_cache[loc] = q
    k_scale[loc] = s


def read_latent(k_cache: torch.Tensor, k_scale: torch.Tensor | None, slots: torch.Tensor, lat: int,
                dtype: torch.dtype) -> torch.Tensor:
    """Rows at ``slots`` [N] of k_cache [slots, 1, W] -> [N, 1, W] in ``dtype`` (dequantized when fp8)."""
    rows = k_cache[slots]  # [N, 1, W]
    if k_scale is None:
        return rows.to(dtype)
    return dequantize_latent(rows, k_scale[slots], lat, dtype)
