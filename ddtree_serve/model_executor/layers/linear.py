"""Linear layers written for tensor parallelism (Megatron style): column-parallel layers shard the
output features, row-parallel layers shard the input features and all-reduce. With ``TPGroup()`` (size 1)
they are plain linears.

Sharding unit: each sharded dimension is split in whole ``unit``s (an attention layer passes a head's
width; default 1) with ``TPGroup.partition`` (balanced, leftovers to the low ranks), so 9 query heads over
3 KV heads split 6 + 3 at TP=2.

Each parameter carries a ``weight_loader(param, loaded, shard_id)`` that copies this rank's slice of a
checkpoint tensor. ``loaded`` is a tensor or a lazy slice (``ddtree_serve.model_executor.weight_loader.LazyWeight``):
the loaders only use ``shape`` and ``narrow``, so a rank reads only its own rows/columns from disk."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ddtree_serve.kernels.batch_invariant import invariant_linear
from ddtree_serve.model_executor.layers.embedding import ParallelLMHead
from ddtree_serve.model_executor.parallel_state import TPGroup


class _Linear(nn.Module):
    """Base of the linears: ``row_invariant`` (set per instance by ``use_invariant_linears``) routes the GEMM
    through ``invariant_linear`` (ddtree_serve/kernels/batch_invariant.py)."""

    row_invariant = False

    def _mm(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return invariant_linear(x, weight, bias) if self.row_invariant else F.linear(x, weight, bias)


def use_invariant_linears(model: nn.Module) -> int:
    """``--enable-deterministic-inference``: every linear of ``model``, the LM head included, computes a row
    independently of the number of rows beside it; so does every other layer with a ``row_invariant`` mode
    (layers/mla.py's MLA attention, layers/moe.py's router, layers/moe_experts.py's routed experts and
    layers/norm.py's RMSNorm). Returns how many modules were switched."""
    n = 0
    for mod in model.modules():
        if isinstance(mod, (_Linear, ParallelLMHead)) or hasattr(mod, "row_invariant"):
            mod.row_invariant = True
            n += 1
    return n


def _part(tp: TPGroup, n: int, unit: int, what: str) -> tuple[int, int]:
    """(start, length) in elements of this rank's block of an ``n``-wide dimension split in ``unit``s."""
    if n % unit:
        raise ValueError(f"{what} {n} is not a multiple of its sharding unit {unit}")
    start, count = tp.partition(n // unit, what)
    return start * unit, count * unit


class ColumnParallelLinear(_Linear):
    """y = x W^T (+ b); W [out, in] sharded along out. Output stays sharded (no gather). ``out_sizes``
    lists the parts of a merged projection (e.g. gate and up); each part is sharded on its own."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool, tp: TPGroup, dtype: torch.dtype,
                 units: list[int] | None = None):
        super().__init__()
        self.tp = tp
        units = units or [1] * len(out_sizes)
        self.full_sizes = list(out_sizes)
        parts = [_part(tp, o, u, "output features") for o, u in zip(out_sizes, units, strict=True)]
        self.part_starts = [s for s, _ in parts]  # offset of this rank's block inside each full part
        self.out_sizes = [n for _, n in parts]  # per part, this rank
        out = sum(self.out_sizes)
        self.weight = nn.Parameter(torch.empty(out, in_features, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self._load  # type: ignore[attr-defined]
        if bias:
            self.bias = nn.Parameter(torch.zeros(out, dtype=dtype), requires_grad=False)
            self.bias.weight_loader = self._load  # type: ignore[attr-defined]
        else:
            self.bias = None

    def _load(self, param: torch.Tensor, loaded, shard_id: int | None = None) -> None:
        """shard_id None: ``loaded`` holds all parts (merged checkpoint tensor); i: ``loaded`` is part i."""
        ids = range(len(self.out_sizes)) if shard_id is None else [shard_id]
        for i in ids:
            src = (sum(self.full_sizes[:i]) if shard_id is None else 0) + self.part_starts[i]
            dst = sum(self.out_sizes[:i])
            param.data.narrow(0, dst, self.out_sizes[i]).copy_(loaded.narrow(0, src, self.out_sizes[i]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._mm(x, self.weight, self.bias)


class RowParallelLinear(_Linear):
    """y = sum_ranks x_r W_r^T (+ b); W [out, in] sharded along in; input arrives sharded."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup, dtype: torch.dtype,
                 unit: int = 1):
        super().__init__()
        self.tp = tp
        self.in_start, self.in_local = _part(tp, in_features, unit, "input features")
        self.weight = nn.Parameter(torch.empty(out_features, self.in_local, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self._load_weight  # type: ignore[attr-defined]
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False)
        else:
            self.bias = None

    def _load_weight(self, param: torch.Tensor, loaded, shard_id: int | None = None) -> None:
        param.data.copy_(loaded.narrow(1, self.in_start, self.in_local))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(self._mm(x, self.weight))
        return y + self.bias if self.bias is not None else y


class ReplicatedLinear(_Linear):
    """The same full weight on every rank."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._mm(x, self.weight, self.bias)


class QKVParallelLinear(ColumnParallelLinear):
    """Merged q/k/v projection; shard ids "q", "k", "v" map to the checkpoint's separate tensors.
    KV heads are split across ranks (unevenly if need be); each rank keeps the query heads of its KV heads."""

    SHARDS = {"q": 0, "k": 1, "v": 2}

    def __init__(self, hidden: int, head_dim: int, n_heads: int, n_kv_heads: int, bias: bool, tp: TPGroup,
                 dtype: torch.dtype):
        if n_heads % n_kv_heads:
            raise ValueError(f"{n_heads} attention heads are not a multiple of {n_kv_heads} KV heads")
        group = n_heads // n_kv_heads
        super().__init__(hidden, [n_heads * head_dim, n_kv_heads * head_dim, n_kv_heads * head_dim], bias, tp, dtype,
                         units=[group * head_dim, head_dim, head_dim])
        self.q_size, self.kv_size = self.out_sizes[0], self.out_sizes[1]
        self.local_heads, self.local_kv = self.q_size // head_dim, self.kv_size // head_dim
        self.o_unit = group * head_dim  # the matching row-parallel o_proj's sharding unit

    def _load(self, param: torch.Tensor, loaded, shard_id: int | str | None = None) -> None:
        super()._load(param, loaded, self.SHARDS[shard_id] if isinstance(shard_id, str) else shard_id)
