"""Drafter context features of plain decode steps, written to the drafter's cache in batches.

A plain decode step (the adaptive budget's budget 0 everywhere) captures the target layers the drafter's
context needs, so that speculation can resume at any later step. Writing them (``write_context``: the
drafter's projection and per-layer context K/V, a dozen small ops) cost ~0.7 ms per step on the dev CPU
whatever the batch size, 1-2% of a plain step (docs/BENCHMARKS.md). Nothing reads the drafter's cache
until the drafter runs again, so the features wait here and are written in one call: before the next
drafter forward, before any other write to the drafter's cache (a prefill's context, a tree step's commit),
and whenever ``max_tokens`` are waiting.

Invariant: the drafter's cache after ``flush`` equals the cache that writing every call in order would
give. Slots may be freed and reused while features wait (a finished request's slot taken by another
request's next token), so a slot written twice keeps its last write; writes from outside go through
``flush`` first, so they land after every earlier deferred one.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

WriteFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]  # (captured [T, F], positions [T], slots [T])


class DeferredContext:
    """Pending ``(captured, positions, slots)`` chunks; ``write`` stores one batch in the drafter's cache."""

    def __init__(self, write: WriteFn, max_tokens: int):
        self.write = write
        self.max_tokens = max_tokens
        self.chunks: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.pending = 0  # tokens waiting

    def add(self, captured: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """Defer the write of ``captured`` [T, F] at ``positions`` [T] into ``slots`` [T]."""
        self.chunks.append((captured, positions, slots))
        self.pending += int(slots.shape[0])
        if self.pending >= self.max_tokens:
            self.flush()

    def flush(self) -> None:
        """Write every pending feature, the last write of each slot winning."""
        if not self.chunks:
            return
        captured = torch.cat([c for c, _, _ in self.chunks])  # [T, F]
        positions = torch.cat([p for _, p, _ in self.chunks])  # [T]
        slots = torch.cat([s for _, _, s in self.chunks])  # [T]
        self.chunks, self.pending = [], 0
        uniq, inverse = torch.unique(slots, return_inverse=True)  # [U], [T]
        if uniq.shape[0] < slots.shape[0]:  # a reused slot: keep the row of its last write
            order = torch.arange(slots.shape[0], device=slots.device)  # [T]
            last = torch.full_like(uniq, -1).scatter_reduce(0, inverse, order, reduce="amax")  # [U]
            captured, positions, slots = captured[last], positions[last], slots[last]
        self.write(captured, positions, slots)
