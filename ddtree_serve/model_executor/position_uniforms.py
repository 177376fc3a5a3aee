"""Position-keyed uniforms: the random number behind a sampled token depends on the request's seed and the
token's output position alone, never on how many numbers were drawn before it.

``u(seed, t)`` is a counter-based generator (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3",
SC 2011: a bijective mix of a key and a counter instead of a stream consumed in order). The mix is
SplitMix64's finaliser (Steele, Lea, Flood, "Fast splittable pseudorandom number generators", OOPSLA 2014)
applied twice: once to the seed (the key), once to the key plus the golden-ratio increment times ``t + 1``
(the counter). Integer arithmetic is modulo 2^64 in int64 tensors (two's-complement wrap, logical right
shifts by masking), so CPU and CUDA give the same bits; ``position_uniform_reference`` is the same function
in plain Python integers (the test oracle). The top 53 bits make a float64 in [0, 1).

Sampling a token as ``F^-1(u(seed, t))`` (inverse CDF of the processed distribution at output position
``t``) gives plain decoding and tree verification the same draw at the same position: docs/DESIGN.md 4.16.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ddtree_serve.model_executor.uploads import upload

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB


def _signed(x: int) -> int:
    """An unsigned 64-bit value as the int64 with the same bits."""
    x &= _MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


def seed_key(seed: int) -> int:
    """Any Python int seed (negative or beyond 64 bits: taken modulo 2^64) as an int64 key."""
    return _signed(seed)


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    return (x >> k) & ((1 << (64 - k)) - 1)  # logical shift of int64 bits


def _mix(z: torch.Tensor) -> torch.Tensor:
    z = (z ^ _shr(z, 30)) * _signed(_M1)
    z = (z ^ _shr(z, 27)) * _signed(_M2)
    return z ^ _shr(z, 31)


def position_uniforms(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """u(seed, t) for int64 ``seeds [bs]`` (keys from ``seed_key``) and int64 ``positions [bs, n]``:
    float64 ``[bs, n]`` in [0, 1)."""
    key = _mix(seeds.to(torch.int64) + _signed(_GOLDEN))[:, None]  # [bs, 1]
    z = _mix(key + (positions.to(torch.int64) + 1) * _signed(_GOLDEN))  # [bs, n]
    return _shr(z, 11).to(torch.float64) * (2.0 ** -53)


def position_uniform_reference(seed: int, position: int) -> float:
    """The same u(seed, t) in Python integers (for tests)."""
    def mix(z: int) -> int:
        z &= _MASK64
        z = ((z ^ (z >> 30)) * _M1) & _MASK64
        z = ((z ^ (z >> 27)) * _M2) & _MASK64
        return z ^ (z >> 31)

    key = mix(seed + _GOLDEN)
    z = mix(key + (position + 1) * _GOLDEN)
    return (z >> 11) * 2.0 ** -53


@dataclass(frozen=True)
class SampleKeys:
    """What makes each row's draws: the request's seed key and the output position of its next token
    (the root's child in a tree; node at depth d draws at ``position + d``)."""

    seeds: torch.Tensor  # [bs] int64 (seed_key of the request's seed)
    positions: torch.Tensor  # [bs] int64: output tokens the request already holds

    @classmethod
    def build(cls, seeds: list[int], positions: list[int], device: torch.device) -> SampleKeys:
        return cls(upload([seed_key(s) for s in seeds], device, torch.int64),  # asynchronous copies (uploads.py)
                   upload(positions, device, torch.int64))

    def uniforms(self, offsets: torch.Tensor) -> torch.Tensor:
        """float64 ``[bs, n]``: u(seed_b, positions_b + offsets[b, j]) for int ``offsets [bs, n]``."""
        return position_uniforms(self.seeds, self.positions[:, None] + offsets.to(torch.int64))
