"""Linear layers written for tensor parallelism (Megatron style): column-parallel layers shard the
output features, row-parallel layers shard the input features and all-reduce. With ``TPGroup()`` (size 1)
they are plain linears. Each parameter carries a ``weight_loader(param, full_tensor, shard_id)`` that
copies this rank's slice of a checkpoint tensor (the loader hands over lazily-read slices)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model_executor.parallel_state import TPGroup


def _narrow(t: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    n = t.shape[dim] // size
    return t.narrow(dim, rank * n, n)


class ColumnParallelLinear(nn.Module):
    """y = x W^T (+ b); W [out, in] sharded along out. Output stays sharded (no gather)."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool, tp: TPGroup, dtype: torch.dtype):
        super().__init__()
        self.tp = tp
        self.out_sizes = [tp.shard(o, "output features") for o in out_sizes]  # per shard, this rank
        self.full_sizes = list(out_sizes)
        out = sum(self.out_sizes)
        self.weight = nn.Parameter(torch.empty(out, in_features, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self._load  # type: ignore[attr-defined]
        if bias:
            self.bias = nn.Parameter(torch.zeros(out, dtype=dtype), requires_grad=False)
            self.bias.weight_loader = self._load  # type: ignore[attr-defined]
        else:
            self.bias = None

    def _load(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        if shard_id is None:
            if len(self.out_sizes) != 1:  # an already-merged checkpoint tensor: shard each part
                parts = torch.split(loaded, self.full_sizes, dim=0)
                loaded = torch.cat([_narrow(p, 0, self.tp.rank, self.tp.size) for p in parts], dim=0)
            else:
                loaded = _narrow(loaded, 0, self.tp.rank, self.tp.size)
            param.data.copy_(loaded)
            return
        start = sum(self.out_sizes[:shard_id])
        piece = _narrow(loaded, 0, self.tp.rank, self.tp.size)
        param.data.narrow(0, start, self.out_sizes[shard_id]).copy_(piece)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = sum_ranks x_r W_r^T (+ b); W [out, in] sharded along in; input arrives sharded."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup, dtype: torch.dtype):
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(
            torch.empty(out_features, tp.shard(in_features, "input features"), dtype=dtype), requires_grad=False
        )
        self.weight.weight_loader = self._load_weight  # type: ignore[attr-defined]
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False)
        else:
            self.bias = None

    def _load_weight(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        param.data.copy_(_narrow(loaded, 1, self.tp.rank, self.tp.size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(F.linear(x, self.weight))
        return y + self.bias if self.bias is not None else y


class ReplicatedLinear(nn.Module):
    """The same full weight on every rank."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class QKVParallelLinear(ColumnParallelLinear):
    """Merged q/k/v projection; shard ids "q", "k", "v" map to the checkpoint's separate tensors.
    Heads are split across ranks (kv heads must divide by tp_size)."""

    SHARDS = {"q": 0, "k": 1, "v": 2}

    def __init__(self, hidden: int, head_dim: int, n_heads: int, n_kv_heads: int, bias: bool, tp: TPGroup,
                 dtype: torch.dtype):
        super().__init__(hidden, [n_heads * head_dim, n_kv_heads * head_dim, n_kv_heads * head_dim], bias, tp, dtype)
        self.q_size, self.kv_size = self.out_sizes[0], self.out_sizes[1]

    def _load(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: int | str | None = None) -> None:
        super()._load(param, loaded, self.SHARDS[shard_id] if isinstance(shard_id, str) else shard_id)
