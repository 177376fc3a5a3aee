"""Token-granular paged KV cache: one slot per token, slot 0 reserved as the padding slot.

- ``KVCache``: per-layer K and V buffers ``[num_slots + 1, kv_heads, dim]`` (MLA stores its latent as
  K with ``v_dim = 0``). An fp8 cache (``--kv-cache-dtype fp8_e4m3``, MLA only) also holds per-layer scales
  ``k_scale [num_slots + 1, 2]`` float32 (kernels/kv_quant.py: the format and its error bound).
- ``TokenSlotAllocator``: the free list. Allocation failure returns None (the scheduler queues or
  retracts); freeing is exact and double frees are detected.
- ``ReqToTokenPool``: request -> token-slot table ``[max_reqs, max_context]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.kv_quant import SCALE_BYTES_PER_ROW, SCALES_PER_ROW, is_fp8, kv_elem_bytes


@dataclass(frozen=True)
class KVCacheLayout:
    num_layers: int
    kv_heads: int  # per TP rank
    k_dim: int
    v_dim: int  # 0: no separate V buffer (MLA latent)

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        """KV bytes one token takes on this rank in a cache of ``dtype`` (fp8: plus its two float32 scales
        per layer)."""
        scales = SCALE_BYTES_PER_ROW if is_fp8(dtype) else 0
        return self.num_layers * self.kv_heads * ((self.k_dim + self.v_dim) * kv_elem_bytes(dtype) + scales)


class KVCache:
    def __init__(self, layout: KVCacheLayout, num_slots: int, dtype: torch.dtype, device: torch.device | str):
        self.layout = layout
        self.num_slots = num_slots
        self.dtype = dtype
        n = num_slots + 1
        self.k = [torch.zeros(n, layout.kv_heads, layout.k_dim, dtype=dtype, device=device)
                  for _ in range(layout.num_layers)]
        self.v = [torch.zeros(n, layout.kv_heads, layout.v_dim, dtype=dtype, device=device)
                  for _ in range(layout.num_layers)] if layout.v_dim else []
        if is_fp8(dtype) and (layout.v_dim or layout.kv_heads != 1):
            raise ValueError("an fp8 KV cache (--kv-cache-dtype fp8_e4m3) is wired for MLA latent caches only")
        # fp8: per-layer (latent, rope) scales of each row; None otherwise (readers test ``k_scale is None``)
        self.k_scale: list[torch.Tensor] | list[None] = (
            [torch.zeros(n, SCALES_PER_ROW, dtype=torch.float32, device=device) for _ in range(layout.num_layers)]
            if is_fp8(dtype) else [None] * layout.num_layers)


class TokenSlotAllocator:
    """Free list over slots 1..num_slots."""

    def __init__(self, num_slots: int, device: torch.device | str = "cpu"):
        self.num_slots = num_slots
        self.device = device
        self._free = torch.arange(1, num_slots + 1, dtype=torch.int64, device=device)
        self._used = torch.zeros(num_slots + 1, dtype=torch.bool, device=device)

    @property
    def num_free(self) -> int:
        return int(self._free.numel())

    def alloc(self, n: int) -> torch.Tensor | None:
        if n > self._free.numel():
            return None
        out, self._free = self._free[:n], self._free[n:]
        self._used[out] = True
        return out

    def free(self, slots: torch.Tensor) -> None:
        if slots.numel() == 0:
            return
        slots = slots.to(device=self.device, dtype=torch.int64)
        if bool((slots <= 0).any()) or not bool(self._used[slots].all()) or slots.unique().numel() != slots.numel():
            raise RuntimeError("KV slot freed twice or never allocated")
        self._used[slots] = False
        self._free = torch.cat([self._free, slots])

    def allocated(self) -> torch.Tensor:
        """Every allocated slot ``[num_slots - num_free]`` (O(num_slots): the recovery from a failed step)."""
        return torch.nonzero(self._used).squeeze(1)


class ReqToTokenPool:
    def __init__(self, max_reqs: int, max_context: int, device: torch.device | str = "cpu"):
        self.table = torch.zeros(max_reqs, max_context, dtype=torch.int64, device=device)  # [R, C]
        self.max_context = max_context
        self._free = list(range(max_reqs))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        return self._free.pop() if self._free else None

    def free(self, idx: int) -> None:
        if idx in self._free:
            raise RuntimeError(f"request slot {idx} freed twice")
        self._free.append(idx)
