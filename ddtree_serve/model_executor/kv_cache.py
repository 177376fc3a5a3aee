"""Token-granular paged KV cache: one slot per token, slot 0 reserved as the padding slot.

- ``KVCache``: per-layer K and V buffers ``[num_slots + 1, kv_heads, dim]`` (MLA stores its latent as
  K with ``v_dim = 0``). An fp8 cache (``--kv-cache-dtype fp8_e4m3``, MLA only) also holds per-layer scales
  ``k_scale [num_slots + 1, 2]`` float32 (ddtree_serve/kernels/kv_quant.py: the format and its error bound).
- ``TokenSlotAllocator``: the free list. Allocation failure returns None (the scheduler queues or
  retracts); freeing is exact and double frees are detected.
- ``ShardedSlotAllocator``: the free lists of a KV pool sharded over a decode-context-parallel group
  (``--decode-context-parallel-size N``): global slot ``g`` is local slot ``g // N`` of DCP rank ``g % N``
  (ids ``0..N-1`` are the ranks' padding slots), so a table of global ids says where each token lives.
- ``ReqToTokenPool``: request -> token-slot table ``[max_reqs, max_context]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ddtree_serve.kernels.kv_quant import SCALE_BYTES_PER_ROW, SCALES_PER_ROW, is_fp8, kv_elem_bytes


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

    def check_free(self, slots: torch.Tensor) -> torch.Tensor:
        """``slots`` as int64 on this device; RuntimeError when one is not allocated or is listed twice."""
        slots = slots.to(device=self.device, dtype=torch.int64)
        ok = (slots > 0) & (slots <= self.num_slots) & self._used[slots.clamp(0, self.num_slots)]  # [n]
        ordered = slots.sort().values  # [n]
        # checked on the device (no read back: CUDA raises asynchronously, the CPU at once)
        torch._assert_async(ok.all() & (ordered[1:] != ordered[:-1]).all(), "KV slot freed twice or never allocated")
        return slots

    def free(self, slots: torch.Tensor) -> None:
        if slots.numel() == 0:
            return
        slots = self.check_free(slots)
        self._used[slots] = False
        self._free = torch.cat([self._free, slots])

    def allocated(self) -> torch.Tensor:
        """Every allocated slot ``[num_slots - num_free]`` (O(num_slots): the recovery from a failed step)."""
        return torch.nonzero(self._used).squeeze(1)


class ShardedSlotAllocator:
    """Free lists of ``shards`` DCP ranks, ``local_slots`` each, over global slot ids (module docstring).

    ``alloc(n, ranks)``: token ``i`` goes to DCP rank ``ranks[i]`` (its position ``% shards``: a sequence is
    interleaved over the group) while that rank has free slots; the tokens a full rank cannot take go to the
    ranks with the most free slots, so an allocation succeeds exactly when ``n <= num_free`` (attention reads
    each key where its slot says, so a moved token stays correct). ``shards == 1`` is ``TokenSlotAllocator``."""

    def __init__(self, local_slots: int, shards: int, device: torch.device | str = "cpu"):
        self.shards = shards
        self.local_slots = local_slots
        self.device = device
        self._parts = [TokenSlotAllocator(local_slots, device) for _ in range(shards)]

    @property
    def num_slots(self) -> int:
        return self.local_slots * self.shards

    @property
    def id_space(self) -> int:
        """Distinct global ids, padding ones included (rows of a cache indexed by global id)."""
        return (self.local_slots + 1) * self.shards

    @property
    def num_free(self) -> int:
        return sum(p.num_free for p in self._parts)

    def free_per_rank(self) -> list[int]:
        return [p.num_free for p in self._parts]

    def alloc(self, n: int, ranks: torch.Tensor | None = None) -> torch.Tensor | None:
        """``n`` global slots ``[n]``; ``ranks`` ``[n]`` the preferred DCP rank of each (default round robin);
        None when fewer than ``n`` are free."""
        if n > self.num_free:
            return None
        if self.shards == 1:
            return self._parts[0].alloc(n)
        want = (torch.arange(n, device=self.device) if ranks is None else ranks.to(self.device)) % self.shards
        want = want.clone()  # [n]
        spare = [p.num_free - int((want == r).sum()) for r, p in enumerate(self._parts)]
        moved = [torch.nonzero(want == r).squeeze(1)[spare[r]:] for r in range(self.shards) if spare[r] < 0]
        if moved:  # overflow of full ranks to the ranks with the most spare slots (deterministic order)
            extra = torch.cat(moved)  # [m]
            at = 0
            for r in sorted(range(self.shards), key=lambda r: (-spare[r], r)):
                take = min(max(spare[r], 0), extra.numel() - at)
                want[extra[at:at + take]] = r
                at += take
        out = torch.empty(n, dtype=torch.int64, device=self.device)  # [n]
        for r, part in enumerate(self._parts):
            sel = torch.nonzero(want == r).squeeze(1)
            if sel.numel():
                out[sel] = part.alloc(sel.numel()) * self.shards + r
        return out

    def free(self, slots: torch.Tensor) -> None:
        """Free global slots; nothing changes when one of them is not allocated (RuntimeError)."""
        if slots.numel() == 0:
            return
        slots = slots.to(device=self.device, dtype=torch.int64)
        if self.shards == 1:
            self._parts[0].free(slots)
            return
        rank = slots % self.shards  # [n]
        local = [slots[rank == r] // self.shards for r in range(self.shards)]
        for part, loc in zip(self._parts, local, strict=True):
            if loc.numel():
                part.check_free(loc)
        for part, loc in zip(self._parts, local, strict=True):
            part.free(loc)

    def allocated(self) -> torch.Tensor:
        """Every allocated global slot ``[n]``, ascending."""
        parts = [p.allocated() * self.shards + r for r, p in enumerate(self._parts)]
        return torch.cat(parts).sort().values


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
