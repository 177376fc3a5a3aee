"""Rotary position embedding with default, llama3 and YaRN frequency scaling (transformers semantics).

``rope_params`` is the checkpoint's ``rope_parameters`` (transformers 5) or ``rope_scaling`` merged with
``rope_theta``; see ``ddtree_serve.model_executor.model_config.rope_parameters``.
"""

from __future__ import annotations

import math

import torch
from torch import nn


def _yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def compute_inv_freq(dim: int, params: dict, max_position: int) -> tuple[torch.Tensor, float]:
    """Return (inv_freq [dim/2], attention_factor) for rope type default | linear | llama3 | yarn."""
    base = float(params.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))  # [dim/2]
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / float(params["factor"]), 1.0
    if rope_type == "llama3":
        factor = float(params["factor"])
        low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
        old_ctx = float(params["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_ctx / high) & ~(wavelen > old_ctx / low)
        return torch.where(medium, smoothed, scaled), 1.0
    if rope_type == "yarn":
        orig = float(params.get("original_max_position_embeddings") or max_position)
        factor = params.get("factor") or max_position / orig
        factor = float(factor)
        attn = params.get("attention_factor")
        mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
        if attn is None:
            if mscale and mscale_all:
                attn = _yarn_get_mscale(factor, mscale) / _yarn_get_mscale(factor, mscale_all)
            else:
                attn = _yarn_get_mscale(factor)
        beta_fast = params.get("beta_fast") or 32
        beta_slow = params.get("beta_slow") or 1

        def corr_dim(rot: float) -> float:
            return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

        lo, hi = corr_dim(beta_fast), corr_dim(beta_slow)
        if params.get("truncate", True):
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, dim - 1)
        if lo == hi:
            hi += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
        extra = 1 - ramp
        pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
        inv = (1.0 / (factor * pos_freqs)) * (1 - extra) + (1.0 / pos_freqs) * extra
        return inv, float(attn)
    raise ValueError(f"unsupported rope_type {rope_type!r}")


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q [T, H, d] and k [T, Hk, d] at ``positions`` [T]. ``rotary_dim`` <= d (partial
    rotary rotates the leading dims). Neox style rotates halves; interleaved (GPT-J) rotates pairs."""

    def __init__(self, rotary_dim: int, params: dict, max_position: int, is_neox_style: bool = True):
        super().__init__()
        inv_freq, self.attention_factor = compute_inv_freq(rotary_dim, params, max_position)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.rotary_dim = rotary_dim
        self.is_neox_style = is_neox_style

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, d/2]
        return freqs.cos() * self.attention_factor, freqs.sin() * self.attention_factor

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rd = self.rotary_dim
        xr, xp = x[..., :rd].float(), x[..., rd:]
        c, s = cos[:, None, :], sin[:, None, :]  # [T, 1, d/2]
        if self.is_neox_style:
            x1, x2 = xr.chunk(2, dim=-1)
            out = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
        else:
            x1, x2 = xr[..., 0::2], xr[..., 1::2]
            out = torch.stack([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).flatten(-2)
        out = out.to(x.dtype)
        return torch.cat([out, xp], dim=-1) if xp.shape[-1] else out

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.cos_sin(positions)
        return self.apply(q, cos, sin), self.apply(k, cos, sin)
