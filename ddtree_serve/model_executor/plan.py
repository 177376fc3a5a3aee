"""Capacity planning without weights: the model classes the server loads, built on the meta device.

``rank_models`` constructs the target (and a DFlash drafter) exactly as ``load_model`` does for a TP rank,
but on ``torch.device("meta")``: no memory, no checkpoint, only config.json. Their parameters and buffers
are then the bytes the rank will hold (dtype, INT4 packing, TP sharding and expert parallelism as served),
and ``kv_cache_layout()`` gives the KV bytes per token. ddtree_serve/server/plan.py turns these facts into the server's
own start-up sizing (ddtree_serve/server/memory_sizing.py).

Ranks: when every TP partition is even, all ranks hold the same shapes and rank 0 stands for all; otherwise
(e.g. 3 KV heads over 2 ranks) every rank is built.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from ddtree_serve.model_executor.model_config import ModelConfig
from ddtree_serve.model_executor.model_registry import get_model_class
from ddtree_serve.model_executor.models.dflash import drafter_group
from ddtree_serve.model_executor.parallel_state import TPGroup

BUDGETS = (8, 16, 32, 64, 128, 256, 512, 1024)


@dataclass(frozen=True)
class _PlanTP(TPGroup):
    """A TP rank's handle for construction only; records partitions that do not split evenly."""

    uneven: list[str] = field(default_factory=list, compare=False)

    def partition(self, n: int, what: str = "dimension") -> tuple[int, int]:
        if n % self.size:
            self.uneven.append(what)
        return super().partition(n, what)


@dataclass(frozen=True)
class RankModels:
    rank: int
    target: torch.nn.Module  # on the meta device
    drafter: torch.nn.Module | None


def meta_model(config: ModelConfig, tp: TPGroup) -> torch.nn.Module:
    """The model class of ``config`` built for rank ``tp.rank`` on the meta device (as ``load_model``)."""
    with torch.device("meta"):
        return get_model_class(config.architecture)(config, tp)


def rank_models(target: ModelConfig, drafter: ModelConfig | None, tp_size: int,
                expert_parallel: bool) -> list[RankModels]:
    """Rank 0's target and drafter, then every other rank's when some partition is uneven."""
    out: list[RankModels] = []
    for rank in range(tp_size):
        tp = _PlanTP(rank=rank, size=tp_size, expert_parallel=expert_parallel)
        draft_tp = drafter_group(drafter.hf, tp) if drafter else tp  # unsharded when its KV heads do not split
        out.append(RankModels(rank, meta_model(target, tp), meta_model(drafter, draft_tp) if drafter else None))
        if rank == 0 and not tp.uneven:
            break
    return out


def module_bytes(module: torch.nn.Module | None) -> int:
    """Bytes of a module's parameters and buffers (shared tensors once)."""
    if module is None:
        return 0
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))


_PARTS = (("vision tower+proj", r"^vision\."), ("embed+lm_head", r"(^|\.)(embed_tokens|lm_head)\."), ("routed experts", r"\.mlp\.experts\."),
          ("shared experts", r"\.mlp\.shared_experts\."), ("router (fp32)", r"\.mlp\.gate\."),
          ("dense mlp", r"\.mlp\."))


def weight_breakdown(module: torch.nn.Module) -> dict[str, int]:
    """Bytes by part (embeddings, routed / shared experts, router, dense MLPs, the rest: attention and
    norms), from the parameter and buffer names of our model classes."""
    out = {name: 0 for name, _ in _PARTS} | {"attention+norms": 0}
    for name, t in (*module.named_parameters(), *module.named_buffers()):
        part = next((p for p, pattern in _PARTS if re.search(pattern, name)), "attention+norms")
        out[part] += t.numel() * t.element_size()
    return {k: v for k, v in out.items() if v}


@dataclass(frozen=True)
class BudgetRow:
    budget: int  # non-root tree nodes per request
    max_batch: int  # requests per verify step at the planned context length
    kv_bound: int
    workspace_bound: int

    @property
    def verify_tokens(self) -> int:
        return self.max_batch * (self.budget + 1)


def budget_rows(kv_tokens: int, context_len: int, max_verify_tokens: int,
                budgets: tuple[int, ...] = BUDGETS) -> tuple[BudgetRow, ...]:
    """Per budget B: a request at ``context_len`` holds ``context_len + B + 1`` KV slots during verify, the
    workspace verifies ``max_verify_tokens // (B + 1)`` requests per step; the batch is the smaller bound."""
    rows = []
    for b in budgets:
        kv_b, ws_b = kv_tokens // (context_len + b + 1), max_verify_tokens // (b + 1)
        rows.append(BudgetRow(b, min(kv_b, ws_b), kv_b, ws_b))
    return tuple(rows)


def best_row(rows: tuple[BudgetRow, ...]) -> BudgetRow | None:
    """The row with the most verify tokens (budget x batch); ties go to the larger budget."""
    ok = [r for r in rows if r.max_batch > 0]
    return max(ok, key=lambda r: (r.budget * r.max_batch, r.budget)) if ok else None
