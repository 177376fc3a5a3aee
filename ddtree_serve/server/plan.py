"""``ddtree-serve plan``'s computation: what ``serve`` with the same configuration will size at start-up.

``make_plan(config, gpu_memory_gb, overhead_gb)`` resolves the configuration as serve does
(ddtree_serve/server/startup.py: default paths, draft sources, the drafter check), builds the target and drafter of every
distinct TP rank on the meta device (ddtree_serve/model_executor/plan.py), and sizes the step workspace and KV pool with
the server's own start-up function (ddtree_serve/server/memory_sizing.py) against a device of the planned memory in
which the rank's weights, drafter and ``overhead_gb`` (CUDA context, kernels' workspaces; NCCL buffers and CUDA graphs are reserved by the sizing itself) are in use.
``Plan.log_line`` is then the line the scheduler logs at start-up on such a device.

Device memory per GPU, in order: ``gpu_memory_gb``; the configuration's ``machine`` class
(ddtree_serve/server/machines.py); this machine's device (host RAM for ``cpu``, GPU 0 for ``cuda``). It is only needed
when neither ``max_total_tokens`` nor ``kv_memory_gb`` sizes the pool.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ddtree_serve.model_executor.default_model import default_model_config_dir, default_model_present
from ddtree_serve.model_executor.memory import GIB, device_memory, logit_rows_bytes
from ddtree_serve.model_executor.model_registry import get_model_class
from ddtree_serve.model_executor.plan import (
    BUDGETS,
    BudgetRow,
    best_row,
    budget_rows,
    module_bytes,
    rank_models,
    weight_breakdown,
)
from ddtree_serve.server.config import ServerConfig
from ddtree_serve.server.machines import GPU_MEMORY_GIB
from ddtree_serve.server.memory_sizing import ModelFacts, StartupSizing, size_startup_memory
from ddtree_serve.server.startup import (
    is_default_path,
    resolve_config,
    resolve_cuda_graphs,
    target_model_config,
)
from ddtree_serve.speculative.worker_shape import drafter_model_config, resolve_block, step_shape


@dataclass(frozen=True)
class RankPlan:
    rank: int
    weight_bytes: int
    weight_breakdown: dict[str, int]
    draft_bytes: int
    draft_kv_bytes: int  # the drafter's KV bytes per token of the pool (inside facts.kv_bytes_per_token)
    facts: ModelFacts
    kv_tokens: int  # what this rank alone could hold


@dataclass(frozen=True)
class Plan:
    config: ServerConfig  # resolved as serve resolves it
    architecture: str
    memory_source: str  # where the device memory came from (or why none was needed)
    overhead_bytes: int
    ranks: tuple[RankPlan, ...]  # rank 0 first; one entry when every rank holds the same shapes
    sizing: StartupSizing  # rank 0's, with the pool the minimum over ranks (what the scheduler logs)
    rows: tuple[BudgetRow, ...]

    @property
    def log_line(self) -> str:
        return self.sizing.log_line()

    @property
    def best(self) -> BudgetRow | None:
        return best_row(self.rows)

    def table(self) -> str:
        g = lambda b: f"{b / GIB:8.2f} GiB"  # noqa: E731
        c, r0 = self.config, self.ranks[0]
        dcp = c.parallel.decode_context_parallel_size
        lines = [f"{self.architecture} at TP {c.parallel.tp_size}{f' (DCP {dcp})' if dcp > 1 else ''} on "
                 f"{c.model.device}, "
                 f"{self.memory_source}, context {r0.facts.max_context_len}, "
                 f"{c.scheduler.max_running_requests} requests",
                 f"  weights per rank      {g(r0.weight_bytes)}"]
        lines += [f"    {k:<19} {g(v)}" for k, v in r0.weight_breakdown.items()]
        if r0.draft_bytes:
            lines += self._drafter_lines()
        lines.append(f"  overhead assumed      {g(self.overhead_bytes)} (CUDA context, kernel workspaces)")
        for r in self.ranks[1:]:
            lines.append(f"  rank {r.rank}: weights {r.weight_bytes / GIB:.2f} GiB, {r.facts.kv_bytes_per_token} B "
                         f"per token, {r.kv_tokens} KV tokens alone")
        lines += ["start-up log (rank 0):", f"  {self.log_line}",
                  "  budget  max_batch  (kv bound, workspace bound)  verify tokens"]
        lines += [f"  {r.budget:>6}  {r.max_batch:>9}  ({r.kv_bound:>8}, {r.workspace_bound:>8})  {r.verify_tokens:>13}"
                  for r in self.rows]
        b = self.best
        lines.append(f"  largest budget x batch: {b.budget} x {b.max_batch}" if b else
                     f"  no request of {r0.facts.max_context_len} tokens fits: the KV pool holds "
                     f"{self.sizing.kv.tokens} tokens")
        return "\n".join(lines)

    def drafter_share(self) -> dict[str, int]:
        """Rank 0's memory for the drafter: weights, its KV cache in the pool (bytes per token x pool tokens:
        one slot per target slot, never split by DCP), its drafted rows in the step workspace."""
        r0, kv = self.ranks[0], self.sizing.kv
        return {"weights": r0.draft_bytes, "kv_bytes_per_token": r0.draft_kv_bytes,
                "kv_pool_bytes": r0.draft_kv_bytes * kv.tokens,
                "workspace_bytes": logit_rows_bytes(self.sizing.workspace.draft_rows, r0.facts.vocab_size)}

    def _drafter_lines(self) -> list[str]:
        d, per_token = self.drafter_share(), self.ranks[0].facts.kv_bytes_per_token
        return [f"  drafter per rank      {d['weights'] / GIB:8.2f} GiB weights, "
                f"{(d['kv_pool_bytes'] + d['workspace_bytes']) / GIB:.2f} GiB of KV pool and workspace",
                f"    drafter KV          {d['kv_pool_bytes'] / GIB:8.2f} GiB: {d['kv_bytes_per_token']} of "
                f"{per_token} B per pool token ({100 * d['kv_bytes_per_token'] / per_token:.0f}%; a slot per "
                "target slot, its own K/V per layer, not split by DCP)",
                f"    drafter workspace   {d['workspace_bytes'] / GIB:8.2f} GiB: "
                f"{self.sizing.workspace.draft_rows} drafted rows of logits per step (requests x (block - 1))"]

    def as_dict(self) -> dict[str, Any]:
        kv, ws, r0 = self.sizing.kv, self.sizing.workspace, self.ranks[0]
        best = self.best
        return {"architecture": self.architecture, "tp_size": self.config.parallel.tp_size,
                "decode_context_parallel_size": self.config.parallel.decode_context_parallel_size,
                "kv_tokens_per_dcp_rank": kv.tokens // self.config.parallel.decode_context_parallel_size,
                "longest_context_batch_1": self.sizing.longest_context(1),
                "longest_context_max_batch": self.sizing.longest_context(self.config.scheduler.max_running_requests),
                "device": self.config.model.device, "memory": self.memory_source,
                "device_memory_bytes": kv.total_bytes, "in_use_bytes": kv.used_bytes,
                "weight_bytes_per_rank": r0.weight_bytes, "weight_breakdown": r0.weight_breakdown,
                "draft_bytes_per_rank": r0.draft_bytes, "overhead_bytes": self.overhead_bytes,
                "drafter_share": self.drafter_share() if r0.draft_bytes else None,
                "kv_bytes_per_token": kv.bytes_per_token, "kv_tokens": kv.tokens, "kv_source": kv.source,
                "workspace_bytes": ws.bytes, "max_verify_tokens": ws.max_verify_tokens,
                "nccl_reserve_bytes": kv.reserve.nccl_bytes, "graph_reserve_bytes": kv.reserve.graph_bytes,
                "encoder_reserve_bytes": kv.reserve.encoder_bytes,
                "context_length": r0.facts.max_context_len, "log_line": self.log_line,
                "rows": [dict(budget=r.budget, max_batch=r.max_batch, kv_bound=r.kv_bound,
                              workspace_bound=r.workspace_bound) for r in self.rows],
                "best": None if best is None else dict(budget=best.budget, max_batch=best.max_batch)}


class _MinOverRanks:
    """The ``tp`` of ``size_kv_pool`` for a plan: the minimum over the ranks' own capacities."""

    def __init__(self, size: int, tokens: list[int]) -> None:
        self.size, self._tokens = size, tokens

    def min_int(self, value: int) -> int:
        return min([value, *self._tokens])


def _device_total(config: ServerConfig, gpu_memory_gb: float | None) -> tuple[int | None, str]:
    """(bytes per device or None when unknown, where the figure comes from)."""
    if gpu_memory_gb is not None:
        return int(gpu_memory_gb * GIB), f"{gpu_memory_gb:g} GiB per device (--gpu-memory-gb)"
    machine = config.cache.machine
    if machine is not None:
        return int(GPU_MEMORY_GIB[machine] * GIB), f"{GPU_MEMORY_GIB[machine]:g} GiB per device (machine {machine})"
    device = config.model.device
    if device == "cpu" or torch.cuda.is_available():
        total = device_memory("cpu" if device == "cpu" else "cuda:0")[0]
        return total, f"{total / GIB:.2f} GiB per device (this machine's {device})"
    return None, "device memory unknown"


def plan_budgets(budget: int | str, max_budget: int) -> tuple[int, ...]:
    """The budgets the table shows: a fixed budget alone; for ``auto`` the powers of two up to the configured
    bound (it is what the auto budget can choose), the bound itself included."""
    if budget != "auto":
        return (int(budget),)
    return tuple(sorted({b for b in BUDGETS if b < max_budget} | {max_budget}))


def make_plan(config: ServerConfig, gpu_memory_gb: float | None = None, overhead_gb: float = 2.0) -> Plan:
    """Plan ``config`` (unresolved, as ``serve`` receives it). ValueError as serve's start-up raises it (the
    pool too small, no memory left), or when the device memory is needed and unknown."""
    if gpu_memory_gb is not None and gpu_memory_gb <= 0 or overhead_gb < 0:
        raise ValueError("--gpu-memory-gb must be > 0 and --overhead-gb >= 0")
    if is_default_path(config.model.model_path) and not default_model_present():  # config.json alone: no download
        config = config.replace("model", model_path=str(default_model_config_dir()))
    config = resolve_config(config)
    m, spec = config.model, config.speculative
    target = target_model_config(config)
    config = resolve_cuda_graphs(config, target)  # the bound serving captures up to (its reserve below)
    drafter = drafter_model_config(spec.draft_model_path, target, m.device) if spec.uses_drafter else None
    dcp = config.parallel.decode_context_parallel_size
    if dcp > 1 and not getattr(get_model_class(target.architecture), "supports_dcp", False):
        raise ValueError(f"--decode-context-parallel-size {dcp} needs an MLA model (DeepSeek-V3 / Kimi K2 family); "
                         f"{target.architecture} keeps its KV heads split over the TP ranks")
    max_context = m.context_length or target.max_context_len
    total, source = _device_total(config, gpu_memory_gb)
    if config.cache.max_total_tokens is not None or config.cache.kv_memory_gb is not None:
        source = "KV pool set by " + ("max_total_tokens" if config.cache.max_total_tokens is not None
                                      else "kv_memory_gb")
    overhead = int(overhead_gb * GIB)
    ranks: list[RankPlan] = []
    sizings: list[StartupSizing] = []
    for models in rank_models(target, drafter, config.parallel.tp_size, config.parallel.expert_parallel):
        block, budget = None, None
        if spec.enabled:
            block, budget = step_shape(spec.algorithm, spec.ddtree_budget, spec.ddtree_max_budget,
                                       resolve_block(spec.block_size, models.drafter) if models.drafter else None)
        kv_bytes = models.target.kv_cache_layout().bytes_per_token(target.kv_dtype)  # fp8 with --kv-cache-dtype
        kv_bytes = -(-kv_bytes // dcp)  # DCP: a rank stores 1/N of the tokens
        draft_kv = models.drafter.kv_cache_layout().bytes_per_token(target.dtype) if models.drafter else 0
        kv_bytes += draft_kv  # the drafter's cache: one slot per pool token, not split by DCP
        layers = len(getattr(models.drafter, "target_layer_ids", ())) if models.drafter is not None else 0
        facts = ModelFacts(target.vocab_size, max_context, kv_bytes, budget, block, target.hidden_size,
                           target.dtype.itemsize, target.hidden_size * layers,
                           getattr(models.target, "encoder_peak_bytes", lambda _d: 0)(m.device))
        weights, draft = module_bytes(models.target), module_bytes(models.drafter)
        in_use = weights + draft + overhead

        def probe(_device: torch.device, in_use: int = in_use) -> tuple[int, int]:
            if total is None:
                raise ValueError(f"the memory of a {config.model.device} device is unknown here: pass "
                                 "--gpu-memory-gb or --machine")
            return total, in_use

        sizing = size_startup_memory(config, facts, m.device, None, probe)
        sizings.append(sizing)
        ranks.append(RankPlan(models.rank, weights, weight_breakdown(models.target), draft, draft_kv, facts,
                              sizing.kv.tokens))
    if len(ranks) > 1 or config.parallel.tp_size > 1:  # rank 0's line with the pool every rank agrees on
        r0 = ranks[0]
        sizing = size_startup_memory(config, r0.facts, m.device,
                                     _MinOverRanks(config.parallel.tp_size, [r.kv_tokens for r in ranks]),
                                     lambda _d: (total or 0, r0.weight_bytes + r0.draft_bytes + overhead))
    else:
        sizing = sizings[0]
    rows = budget_rows(sizing.kv.tokens, max_context, sizing.workspace.max_verify_tokens,
                       plan_budgets(spec.ddtree_budget, spec.ddtree_max_budget) if spec.enabled else BUDGETS)
    return Plan(config, target.architecture, source, overhead, tuple(ranks), sizing, rows)
