"""The one owner of KV slot ids: the free list (``TokenSlotAllocator``) and the request -> token table
(``ReqToTokenPool``). Every other module reads the table (attention metadata) but writes slots only
through these methods, so slot accounting has one place to audit (docs/DESIGN.md, "KV slots").

Who holds a slot: the free list, a request row (``table[row, :n]`` of a running request), a step's
temporary draft block or tree, or the radix prefix cache (``model_executor/radix_cache.py``) that takes
finished tokens over. ``free`` returns slots to the free list exactly once (double frees raise).
"""

from __future__ import annotations

import torch

from model_executor.kv_cache import ReqToTokenPool, TokenSlotAllocator


class KVSlots:
    def __init__(self, num_slots: int, max_reqs: int, max_context: int, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self._alloc = TokenSlotAllocator(num_slots, self.device)
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
    def num_free(self) -> int:
        return self._alloc.num_free

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

    def place(self, rows: torch.Tensor, starts: torch.Tensor, lens: torch.Tensor) -> torch.Tensor | None:
        """Allocate ``sum(lens)`` slots and write them at ``table[rows[b], starts[b]:starts[b] + lens[b]]``,
        request after request. Returns the flat slots ``[T]`` (the forward's ``out_cache_loc``), or None
        (nothing changed) when too few are free. ``rows``, ``starts``, ``lens``: ``[bs]`` int64."""
        dev = self.device
        rows, starts, lens = rows.to(dev), starts.to(dev), lens.to(dev)
        flat = self._alloc.alloc(int(lens.sum()))  # [T]
        if flat is None:
            return None
        r = rows.repeat_interleave(lens)  # [T]
        first = (torch.cumsum(lens, 0) - lens).repeat_interleave(lens)  # [T] flat index of each row's first token
        pos = starts.repeat_interleave(lens) + torch.arange(flat.numel(), device=dev) - first  # [T]
        self._pool.table[r, pos] = flat
        return flat

    def place_block(self, rows: torch.Tensor, starts: torch.Tensor, width: int) -> torch.Tensor | None:
        """``place`` with ``width`` slots per request: a draft block's temporary slots ``[bs, width]``."""
        flat = self.place(rows, starts, torch.full_like(rows, width))
        return None if flat is None else flat.view(-1, width)

    def keep_path(self, rows: torch.Tensor, pos: torch.Tensor, kept: torch.Tensor, drop: torch.Tensor) -> None:
        """Commit a speculative step: point ``table[rows[i], pos[i]]`` at ``kept[i]`` (the accepted path's
        slots, compacted to consecutive positions) and free ``drop`` (every other tree slot)."""
        self._alloc.free(drop)
        self._pool.table[rows, pos] = kept
