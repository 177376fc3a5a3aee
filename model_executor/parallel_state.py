"""Tensor-parallel group handle, passed explicitly to every layer (no process-global state).

``TPGroup()`` is the single-process default. Under tensor parallelism each rank builds one
``TPGroup(rank, size, group)`` after ``torch.distributed`` is initialised (gloo on CPU, NCCL on GPU).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    group: Any = None  # torch.distributed ProcessGroup, None = default world group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] on every rank -> [..., size * n] in rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def shard(self, n: int, what: str = "dimension") -> int:
        if n % self.size:
            raise ValueError(f"{what} {n} is not divisible by tp_size {self.size}")
        return n // self.size
