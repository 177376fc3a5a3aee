"""This rank's slice of the vocabulary in a step's logits, and the O(1)-per-row exchanges between the slices.

Under TP with vocabulary-parallel logits (``ParallelArgs.vocab_parallel_logits``, the default) the LM head's
rows stay on their rank: a step's logits are ``[n, end - start]`` on each rank and every reduction of the
logits pipeline (the argmax, the softmax's max and mass, the top-k / top-p thresholds, the inverse-CDF
crossing; ``ddtree_serve.model_executor.sharded_sampling``) exchanges a constant number of values per row
with ``gather``, never the vocabulary. ``VocabShard.whole(V)`` is the one-rank case (TP 1, or gathered
logits): the same code, with a gather that returns its input. docs/DESIGN.md 4.16 ("Vocabulary-parallel logits").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

# gather(x) -> [size, *x.shape]: every rank's ``x`` (same shape on every rank) in rank order
Gather = Callable[[torch.Tensor], torch.Tensor]


def _alone(x: torch.Tensor) -> torch.Tensor:
    return x[None]


@dataclass(frozen=True)
class VocabShard:
    """Columns ``[start, end)`` of a vocabulary of ``vocab`` tokens, on rank ``rank`` of ``size`` (shards in
    rank order, contiguous, covering the vocabulary). ``gather``: the exchange between the ranks."""

    vocab: int
    start: int = 0
    end: int = -1  # -1: vocab
    rank: int = 0
    size: int = 1
    gather: Gather = _alone
    # the whole-vocabulary CUDA kernel may draw (``sampler.draw_tokens``); False under TP with gathered logits, so
    # that both TP modes draw by the same integer rule on a GPU too
    device_kernel: bool = True

    def __post_init__(self) -> None:
        if self.end < 0:
            object.__setattr__(self, "end", self.vocab)

    @classmethod
    def whole(cls, vocab: int, device_kernel: bool = True) -> VocabShard:
        """The whole vocabulary on one rank (TP 1 or gathered logits)."""
        return cls(vocab, device_kernel=device_kernel)

    @classmethod
    def of_group(cls, vocab: int, start: int, end: int, tp) -> VocabShard:  # noqa: ANN001 (TPGroup: no cycle)
        """Rank ``tp.rank``'s columns, exchanging over ``tp``'s device group (``TPGroup.gather_stacked``)."""
        return cls(vocab, start, min(end, vocab), tp.rank, tp.size, tp.gather_stacked)

    @property
    def sharded(self) -> bool:
        return self.size > 1

    @property
    def width(self) -> int:
        return self.end - self.start

    def cols(self, x: torch.Tensor) -> torch.Tensor:
        """This shard's columns of a full-vocabulary tensor ``[..., V]`` (a view)."""
        return x[..., self.start:self.end] if self.sharded else x

    def local_ids(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Global token ids -> (local column, clamped into the shard; whether the id is in this shard)."""
        inside = (ids >= self.start) & (ids < self.end)
        return (ids - self.start).clamp(0, max(self.width - 1, 0)), inside

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks (integer tensors: exact in any order; float tensors: rank order)."""
        return self.gather(x).sum(0) if self.sharded else x

    def max(self, x: torch.Tensor) -> torch.Tensor:
        return self.gather(x).amax(0) if self.sharded else x

    def full_rows(self, logits: torch.Tensor) -> torch.Tensor:
        """``[n, V]``: these rows of every shard, concatenated (for rows that need the whole vocabulary: logprobs,
        relaxed acceptance). Shards may differ in width (the last one short): each rank pads to the widest."""
        if not self.sharded:
            return logits
        widest = -(-self.vocab // self.size)
        pad = torch.full((*logits.shape[:-1], widest), float("-inf"), dtype=logits.dtype, device=logits.device)
        pad[..., :self.width] = logits
        parts = self.gather(pad)  # [size, ..., widest]
        return torch.cat(list(parts), dim=-1)[..., :self.vocab]
