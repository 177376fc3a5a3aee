"""The one owner of KV slot ids: the free list (``TokenSlotAllocator``) and the request -> token table
(``ReqToTokenPool``). Every other module reads the table (attention metadata) but writes slots only
through these methods, so slot accounting has one place to audit (docs/DESIGN.md, "KV slots").

Who holds a slot: the free list, a request row (``table[row, :n]`` of a running request), a step's
temporary draft block or tree, or the radix prefix cache (``ddtree_serve/model_executor/radix_cache.py``) that takes
finished tokens over. ``free`` returns slots to the free list exactly once (double frees raise).

Decode context parallelism (``shards`` = the DCP size N > 1): slot ids are global (``ShardedSlotAllocator``:
local slot ``g // N`` of DCP rank ``g % N``), ``num_slots`` is the pool of the whole group (N x each rank's
cache) and a new token is placed on the DCP rank of its position (``position % N``, falling back to the
emptiest rank when that one is full). Every TP rank runs the same slot operations (rank 0 decides what
runs); each DCP rank then writes and reads only the KV of its own slots (ddtree_serve/model_executor/layers/dcp_attention.py).
A speculative step's tree node is placed by its position (``place(..., positions=)``), so the commit that
moves the accepted path to consecutive positions (``point``) keeps every node on its rank.
"""

from __future__ import annotations

import torch

from ddtree_serve.model_executor.kv_cache import ReqToTokenPool, ShardedSlotAllocator


class KVSlots:
    def __init__(self, num_slots: int, max_reqs: int, max_context: int, device: torch.device | str = "cpu",
                 shards: int = 1):
        """``num_slots``: the pool in tokens (with ``shards`` > 1, rounded down to a multiple of it: each DCP
        rank's cache holds ``num_slots // shards``)."""
        self.device = torch.device(device)
        self.shards = shards
        self._alloc = ShardedSlotAllocator(num_slots // shards, shards, self.device)
        self._pool = ReqToTokenPool(max_reqs, max_context, self.device)

    # ---------------------------------------------------------------- reads
    @property
    def table(self) -> torch.Tensor:
        """``[max_reqs, max_context]`` slot of each (row, position); read-only for callers."""
        return self._pool.table

    @property
    def num_slots(self) -> int:
        return self._alloc.num_slots

    @property
    def local_slots(self) -> int:
        """Slots of one DCP rank's cache (``num_slots`` without DCP)."""
        return self._alloc.local_slots

    @property
    def id_space(self) -> int:
        """Rows a cache indexed by slot id needs (``num_slots + 1`` without DCP; the drafter's unsharded cache)."""
        return self._alloc.id_space

    @property
    def num_free(self) -> int:
        return self._alloc.num_free

    def free_per_rank(self) -> list[int]:
        """Free slots of each DCP rank (one entry without DCP)."""
        return self._alloc.free_per_rank()

    @property
    def num_free_rows(self) -> int:
        return self._pool.num_free

    @property
    def max_rows(self) -> int:
        return int(self._pool.table.shape[0])

    def row_slots(self, row: int, n: int) -> torch.Tensor:
        """A copy of ``table[row, :n]`` ``[n]``."""
        return self._pool.table[row, :n].clone()

    # ---------------------------------------------------------------- request rows
    def alloc_row(self) -> int | None:
        return self._pool.alloc()

    def release(self, row: int, n: int) -> None:
        """Free the ``n`` slots a request row holds (``table[row, :n]``) and the row itself."""
        self._alloc.free(self._pool.table[row, :n].clone())
        self._pool.free(row)

    def free_row(self, row: int) -> None:
        """Free the row alone (its slots were handed to another owner or freed already)."""
        self._pool.free(row)

    # ---------------------------------------------------------------- slots
    def alloc(self, n: int) -> torch.Tensor | None:
        """``n`` fresh slots ``[n]`` not written to any row, or None when fewer are free."""
        return self._alloc.alloc(n)

    def free(self, slots: torch.Tensor) -> None:
        self._alloc.free(slots)

    def allocated(self) -> torch.Tensor:
        """Every allocated slot ``[n]`` (O(num_slots))."""
        return self._alloc.allocated()

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        """Point ``table[row, start:start + len(slots)]`` at existing slots (a cached prefix)."""
        self._pool.table[row, start:start + slots.numel()] = slots

    def place(self, rows: torch.Tensor, starts: torch.Tensor, lens: torch.Tensor,
              positions: torch.Tensor | None = None, total: int | None = None) -> torch.Tensor | None:
        """Allocate ``sum(lens)`` slots and write them at ``table[rows[b], starts[b]:starts[b] + lens[b]]``,
        request after request. Returns the flat slots ``[T]`` (the forward's ``out_cache_loc``), or None
        (nothing changed) when too few are free. ``rows``, ``starts``, ``lens``: ``[bs]`` int64.
        ``positions`` ``[T]``: the tokens' positions when they are not their table columns (tree nodes share
        a position per depth); with DCP a token's slot is taken on the DCP rank of its position. ``total``:
        ``sum(lens)`` when the host knows it (no read back)."""
        dev = self.device
        rows, starts, lens = rows.to(dev), starts.to(dev), lens.to(dev)
        total = int(lens.sum()) if total is None else total
        first = (torch.cumsum(lens, 0) - lens).repeat_interleave(lens, output_size=total)  # [T] row's first token
        col = starts.repeat_interleave(lens, output_size=total) + torch.arange(total, device=dev) - first  # [T]
        ranks = None
        if self.shards > 1:
            ranks = (col if positions is None else positions.to(dev)) % self.shards  # [T]
        flat = self._alloc.alloc(total, ranks)  # [T]
        if flat is None:
            return None
        self._pool.table[rows.repeat_interleave(lens, output_size=total), col] = flat
        return flat

    def place_block(self, rows: torch.Tensor, starts: torch.Tensor, width: int) -> torch.Tensor | None:
        """``place`` with ``width`` slots per request: a draft block's temporary slots ``[bs, width]``."""
        flat = self.place(rows, starts, torch.full_like(rows, width), total=int(rows.shape[0]) * width)
        return None if flat is None else flat.view(-1, width)

    def point(self, rows: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor) -> None:
        """Point ``table[rows[i], pos[i]]`` at ``slots[i]`` (a speculative step's accepted path, compacted to
        consecutive positions; its other tree slots are freed with ``free``). Duplicate (row, position) pairs are
        not allowed."""
        self._pool.table[rows, pos] = slots

    def drop_tree(self, drop: torch.Tensor) -> None:
        """Free the tree slots a speculative commit did not keep (``free``; its own name, the commit's fault site)."""
        self._alloc.free(drop)
