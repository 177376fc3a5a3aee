"""Vocab-parallel embedding and LM head: each rank holds a contiguous slice of the vocabulary."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ddtree_serve.kernels.batch_invariant import invariant_linear
from ddtree_serve.model_executor.parallel_state import TPGroup


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden: int, tp: TPGroup, dtype: torch.dtype):
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.shard = (vocab_size + tp.size - 1) // tp.size
        self.start = tp.rank * self.shard
        self.end = min(self.start + self.shard, vocab_size)
        self.weight = nn.Parameter(torch.zeros(self.shard, hidden, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self._load  # type: ignore[attr-defined]

    def _load(self, param: torch.Tensor, loaded, shard_id: int | None = None) -> None:
        """``loaded``: the full [V, H] tensor or a lazy slice; only rows [start, end) are read."""
        n = max(0, self.end - self.start)
        if n:
            param.data[:n].copy_(loaded.narrow(0, self.start, n))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        ok = (local >= 0) & (ids < self.end)  # [T]
        out = F.embedding(torch.where(ok, local, torch.zeros_like(local)), self.weight)
        out = out * ok[:, None].to(out.dtype)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """logits = h W^T over the vocabulary, returned in float32: gathered from all ranks (``compute_logits``), or
    this rank's columns alone (``local_logits``: vocabulary-parallel sampling, ``model_executor.vocab_shard``).
    ``row_invariant`` (``layers.linear.use_invariant_linears``): the product through ``invariant_linear``."""

    row_invariant = False

    def _product(self, hidden: torch.Tensor) -> torch.Tensor:
        return invariant_linear(hidden, self.weight) if self.row_invariant else F.linear(hidden, self.weight)

    def local_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[n, end - start]``: this rank's vocabulary columns (the shard's padding rows dropped after the product:
        the very numbers ``compute_logits`` gathers)."""
        return self._product(hidden).float()[:, : max(0, self.end - self.start)]  # [n, V/tp]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self._product(hidden).float()  # [n, shard]
        logits = self.tp.all_gather_last_dim(logits)
        return logits[:, : self.vocab_size]
