"""Start-up memory sizing: the step workspace and the KV pool from the configuration and the model's facts.

One function, ``size_startup_memory``, serves both callers, so they print the same line:
- the scheduler (ddtree_serve/server/scheduling/scheduler.py), with the facts of the loaded target and drafter and the device's
  memory probe, once the weights are resident; it logs ``StartupSizing.log_line()``;
- ``ddtree-serve plan`` (ddtree_serve/server/plan.py), with the same facts read from the model classes built on the meta
  device, and a probe that reports the planned GPU and the weights it would hold.
The arithmetic itself is ddtree_serve/model_executor/memory.py (``verify_workspace``, ``size_kv_pool``).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import torch

from ddtree_serve.model_executor.cuda_graph_runner import graph_batch_sizes
from ddtree_serve.model_executor.memory import (
    KVSizing,
    MemoryProbe,
    Workspace,
    runtime_reserve,
    size_kv_pool,
    verify_workspace,
)
from ddtree_serve.server.config import ServerConfig
from ddtree_serve.server.machines import machine_memory_mismatch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelFacts:
    """What sizing reads from the target and drafter of one TP rank."""

    vocab_size: int
    max_context_len: int  # the configured context length, or the model's
    kv_bytes_per_token: int  # target + drafter caches, this rank, per token of the pool (DCP: target / N)
    budget: int | None  # tree nodes per request of one verify step at most (None: no speculation)
    block_size: int | None  # drafter block (1: no drafter; None: no speculation)
    hidden_size: int = 0  # the target's (CUDA-graph outputs)
    dtype_bytes: int = 2  # the target's activation dtype
    captured_features: int = 0  # the drafter's captured target-layer width per token (0: no drafter)
    encoder_peak_bytes: int = 0  # the vision tower's activation peak for one image (0: no tower)


@dataclass(frozen=True)
class StartupSizing:
    workspace: Workspace
    kv: KVSizing
    dcp_size: int = 1  # decode context parallelism: each rank holds kv.tokens / dcp_size of the pool
    max_batch: int = 1  # max_running_requests
    step_margin: int = 1  # slots a request needs beyond its context in a step (the scheduler's admission margin)

    def longest_context(self, batch: int) -> int:
        """The longest context (prompt + output tokens) each of ``batch`` requests can hold at once in the pool,
        a step's temporary slots left free (at batch 1: the scheduler's admission limit for one request)."""
        return max(self.kv.tokens // max(batch, 1) - self.step_margin, 0)

    def log_line(self) -> str:
        """The scheduler's start-up log line for memory (``ddtree-serve plan`` prints it verbatim)."""
        dcp = (f"; sharded over {self.dcp_size} DCP ranks ({self.kv.tokens // self.dcp_size} tokens each)"
               if self.dcp_size > 1 else "")
        return (f"{self.kv.describe()}{dcp}; longest context {self.longest_context(1)} tokens at batch 1, "
                f"{self.longest_context(self.max_batch)} at batch {self.max_batch}; max verify tokens per step "
                f"{self.workspace.max_verify_tokens}")


def size_startup_memory(config: ServerConfig, facts: ModelFacts, device: str, tp: Any,
                        probe: MemoryProbe) -> StartupSizing:
    """Reserve the step workspace for ``max_running_requests`` at ``facts.budget``, then size the KV pool
    (precedence: ``max_total_tokens`` > ``kv_memory_gb`` > the probed device, less ``runtime_reserve``'s NCCL
    buffers and CUDA graphs on CUDA), at most ``(max_running_requests
    + 1) x max_context_len`` tokens (on CUDA the vision encoder's peak, ``facts.encoder_peak_bytes``, is reserved
    too); ``tp``: a TPGroup (the pool is the minimum over ranks) or None. On CUDA a device whose memory is not the
    configured ``machine`` class's is logged as a warning. With decode context parallelism (N > 1)
    ``facts.kv_bytes_per_token`` counts 1/N of the target's bytes per token (each rank stores every N-th token)
    and the pool is rounded down to a multiple of N."""
    cache, max_reqs = config.cache, config.scheduler.max_running_requests + 1
    workspace = verify_workspace(facts.vocab_size, config.scheduler.max_running_requests, facts.budget,
                                 facts.block_size, cache.verify_workspace_gb)
    max_bs = config.model.cuda_graph_max_bs
    if max_bs is None:
        raise ValueError("size_startup_memory needs the CUDA graph bound resolved (startup.resolve_cuda_graphs)")
    graphs = graph_batch_sizes(max_bs) if max_bs > 0 else ()
    tp_size = config.parallel.tp_size
    columns = -(-facts.vocab_size // tp_size) if config.parallel.vocab_parallel_logits else facts.vocab_size
    drafted = max((facts.block_size or 1) - 1, 0) * columns if facts.captured_features else 0  # a DFlash drafter's
    reserve = runtime_reserve(  # NCCL and the CUDA graphs allocate after sizing: left out of the pool
        torch.device(device).type, tp_size, graphs, (facts.budget or 0) + 1, facts.max_context_len,
        facts.hidden_size, facts.dtype_bytes, facts.captured_features, drafted)
    if torch.device(device).type == "cuda":  # an image's encoder activations at prefill, as the others: CUDA only
        reserve = dataclasses.replace(reserve, encoder_bytes=facts.encoder_peak_bytes)
    kv = size_kv_pool(device, facts.kv_bytes_per_token, workspace.bytes, max_reqs * facts.max_context_len,
                      max_total_tokens=cache.max_total_tokens, kv_memory_gb=cache.kv_memory_gb,
                      mem_fraction_static=cache.mem_fraction_static, tp=tp, probe=probe, reserve=reserve)
    warning = machine_memory_mismatch(cache.machine, kv.total_bytes) if str(device).startswith("cuda") else None
    if warning:
        logger.warning(warning)
    dcp = config.parallel.decode_context_parallel_size  # the pool splits evenly over the DCP ranks
    kv = dataclasses.replace(kv, tokens=kv.tokens // dcp * dcp)
    margin = max(facts.block_size or 0, facts.budget + 1) if facts.budget is not None else 1  # Scheduler._spec_margin
    return StartupSizing(workspace, kv, dcp, config.scheduler.max_running_requests, margin)
