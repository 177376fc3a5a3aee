"""Device memory: the probe, the verify-step workspace and the KV pool size (docs/DEPLOY.md, "KV sizing").

The server and ``ddtree-serve plan`` compute their numbers with these same functions.

- ``device_memory(device) -> (total_bytes, used_bytes)`` is the one device-memory probe. CUDA: from
  ``cudaMemGetInfo`` (used = total - free, so other processes' allocations count, as SGLang's free-memory
  probe does). CPU: host RAM, used = total - available. Callers that size from memory take the probe as a
  parameter (``MemoryProbe``), so tests pass a fake device instead.
- Workspace: the transient memory of one step is dominated by rows of vocabulary-sized float32 tensors:
  per verified token (``bs x (budget + 1)`` tree nodes) the target logits, their tempered float32 copy,
  the target probabilities and the zero draft probabilities the tree-sampling kernel takes
  (``LOGIT_ROW_BYTES_PER_ENTRY`` = 4 x 4 bytes per vocabulary entry), and the same again per drafted row
  (``bs x (block - 1)``). ``verify_workspace`` turns a stated workspace into ``max_verify_tokens``, the most
  tree nodes one verify forward may hold summed over the batch; the speculative worker lowers the
  per-request budget of a step that would exceed it.
- KV pool, in order of precedence: ``max_total_tokens`` (tokens) > ``kv_memory_gb`` (bytes) > on CUDA
  ``mem_fraction_static x total - used - workspace`` measured after the target weights, the drafter and the
  CUDA context are resident (SGLang's rule, with the workspace reserved first) > on CPU
  ``min(CPU_KV_CAP_BYTES, CPU_KV_FRACTION x (available - workspace))``. Bytes become tokens at the per-token
  KV bytes of the target and drafter caches together; under tensor parallelism every rank takes the
  minimum over ranks (ranks schedule identically, so they must agree on the capacity).
- Runtime reserve (``runtime_reserve``), on CUDA only, taken from the pool like the workspace: memory that
  is allocated *after* the KV pool is sized, so the probe cannot see it. NCCL's communicator buffers under
  TP (created at the first device collective: ``NCCL_RESERVE_BYTES`` per rank, an estimate that covers the
  default ``NCCL_BUFFSIZE`` over the channels of an 8-GPU node; NVLS/SHARP buffers on NVSwitch systems can
  need more: raise ``--mem-fraction-static`` headroom there) and the CUDA graphs (captured at the warm-up):
  their static inputs, counted exactly (``kv_indices [max_bs, max_context]`` int64 and the small per-request
  buffers), and their shared memory pool, estimated as ``GRAPH_ACTIVATION_ROWS`` hidden-sized rows per token
  of the largest captured forward (``max_bs x max_q`` tokens) plus the output rows the graphs share (one
  ``[max_bs x q]`` buffer per tokens-per-request q: ``cuda_graph_runner``), the graphed drafts' float32 logits
  (``[pad_bs, block - 1, V / tp]`` per padded size) included.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)

GIB = 1 << 30
LOGIT_ROW_BYTES_PER_ENTRY = 16  # 4 float32 copies of a vocabulary row per verified or drafted token
CPU_KV_FRACTION = 0.25  # CPU default: a quarter of the available host memory ...
CPU_KV_CAP_BYTES = 2 * GIB  # ... and at most 2 GiB
MIN_KV_TOKENS = 16

NCCL_RESERVE_BYTES = 1 * GIB  # per rank, CUDA and tp_size > 1 (module docstring)
GRAPH_ACTIVATION_ROWS = 32  # hidden-sized rows per token a captured forward keeps in the graph pool

MemoryProbe = Callable[[torch.device], tuple[int, int]]


def device_memory(device: torch.device | str) -> tuple[int, int]:
    """(total bytes, bytes in use) of ``device``: a CUDA device from cudaMemGetInfo, else host RAM."""
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.empty_cache()  # cached-but-free blocks (loading temporaries) are not "in use"
        free, total = torch.cuda.mem_get_info(dev)
        return int(total), int(total - free)
    return _host_memory()


def _host_memory() -> tuple[int, int]:
    info: dict[str, int] = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, _, rest = line.partition(":")
            info[key] = int(rest.split()[0]) * 1024
    total = info["MemTotal"]
    available = info.get("MemAvailable", info.get("MemFree", 0))
    return total, total - available


# ---------------------------------------------------------------- workspace
@dataclass(frozen=True)
class Workspace:
    bytes: int  # transient memory reserved for one step's vocabulary-sized tensors
    max_verify_tokens: int  # tree nodes (root included) one verify forward may hold, summed over the batch
    draft_rows: int  # drafted rows per step at the full batch, counted inside ``bytes``


def logit_rows_bytes(rows: int, vocab: int) -> int:
    return rows * vocab * LOGIT_ROW_BYTES_PER_ENTRY


def verify_workspace(
    vocab: int, max_batch: int, budget: int | None, block_size: int | None, workspace_gb: float | None = None
) -> Workspace:
    """The step workspace and the verify tokens it allows.

    ``budget``: non-root tree nodes per request (None: no speculation, a decode step is ``max_batch``
    rows). ``block_size``: the drafter block (its ``block - 1`` drafted rows per request count too).
    ``workspace_gb`` None sizes the workspace for ``max_batch x (budget + 1)`` verify tokens, so the cap
    only binds when a smaller workspace is stated. Raises ValueError when the workspace cannot hold even a
    budget-0 step (one verify token per request) at ``max_batch``."""
    if vocab < 1 or max_batch < 1:
        raise ValueError("vocab and max_batch must be >= 1")
    draft_rows = max_batch * (block_size - 1) if budget is not None and block_size else 0
    row = logit_rows_bytes(1, vocab)
    if workspace_gb is None:
        verify = max_batch * (budget + 1) if budget is not None else max_batch
        total = logit_rows_bytes(verify + draft_rows, vocab)
    else:
        if workspace_gb <= 0:
            raise ValueError(f"verify_workspace_gb must be > 0, got {workspace_gb}")
        total = int(workspace_gb * GIB)
    max_verify = total // row - draft_rows
    if max_verify < max_batch:
        need = logit_rows_bytes(max_batch + draft_rows, vocab) / GIB
        raise ValueError(
            f"verify_workspace_gb {total / GIB:.3f} GiB cannot hold one step of {max_batch} requests "
            f"(vocabulary {vocab}: at least {need:.3f} GiB); raise it or lower max_running_requests"
        )
    return Workspace(total, max_verify, draft_rows)


def step_budget(budget: int, batch: int, max_verify_tokens: int) -> int:
    """The per-request budget of one step: ``budget``, lowered so that ``batch x (budget + 1)`` verify
    tokens fit ``max_verify_tokens``; 0 (root only: a plain decode step) at the floor."""
    return max(0, min(budget, max_verify_tokens // max(batch, 1) - 1))


# ---------------------------------------------------------------- runtime reserve
@dataclass(frozen=True)
class RuntimeReserve:
    nccl_bytes: int  # NCCL communicator buffers (CUDA, TP)
    graph_bytes: int  # CUDA graphs: static inputs + memory pool
    encoder_bytes: int = 0  # a vision tower's activation peak for one image (CUDA; models/kimi_k25.py)

    @property
    def bytes(self) -> int:
        return self.nccl_bytes + self.graph_bytes + self.encoder_bytes


def runtime_reserve(device_type: str, tp_size: int, graph_batch_sizes: tuple[int, ...], graph_max_q: int,
                    max_context: int, hidden_size: int, dtype_bytes: int, captured_features: int = 0,
                    draft_logit_columns: int = 0) -> RuntimeReserve:
    """What the KV pool must leave for NCCL and the CUDA graphs (module docstring). ``graph_batch_sizes``:
    the padded sizes captured (empty: no graphs); ``graph_max_q``: tokens per request of the widest
    captured forward (1 for decode, budget + 1 for verify); ``captured_features``: the drafter's captured
    target-layer width per token (0 without a drafter); ``draft_logit_columns``: the float32 logits a request's
    graphed draft keeps (block - 1 rows of this rank's vocabulary columns; 0 without a DFlash drafter). Zero off
    CUDA."""
    if device_type != "cuda":
        return RuntimeReserve(0, 0)
    nccl = NCCL_RESERVE_BYTES if tp_size > 1 else 0
    graphs = 0
    if graph_batch_sizes:
        max_bs, q = max(graph_batch_sizes), max(graph_max_q, 1)
        static = max_bs * max_context * 8 + max_bs * q * (8 * 4 + q)  # kv_indices; ids, positions, slots; tree mask
        pool = max_bs * q * hidden_size * dtype_bytes * GRAPH_ACTIVATION_ROWS
        # one output buffer per tokens-per-request q, shared by its graphs of every batch size: decode's 1 and
        # the verify widths up to q (the auto budget's 2, 3, 5, 9, ..., q sum to under 2q + log2 q)
        outputs = max_bs * (2 * q + q.bit_length()) * (hidden_size + captured_features) * dtype_bytes
        drafts = sum(graph_batch_sizes) * draft_logit_columns * 4  # the graphed drafts' logits (draft_graphs.py)
        graphs = static + pool + outputs + drafts
    return RuntimeReserve(nccl, graphs)


# ---------------------------------------------------------------- KV pool
@dataclass(frozen=True)
class KVSizing:
    tokens: int  # KV slots (the same on every TP rank)
    bytes_per_token: int  # target + drafter caches, this rank
    pool_bytes: int  # bytes this rank could give the KV cache (before the minimum over ranks)
    workspace_bytes: int
    total_bytes: int  # device (or host) memory as probed; 0 when not probed
    used_bytes: int
    source: str  # "max_total_tokens" | "kv_memory_gb" | "mem_fraction_static" | "host_memory"
    reserve: RuntimeReserve = RuntimeReserve(0, 0)  # NCCL and CUDA graphs, left out of the pool

    def describe(self) -> str:
        return (
            f"KV pool: {self.tokens} tokens x {self.bytes_per_token} B = {self.tokens * self.bytes_per_token / GIB:.2f}"
            f" GiB (from {self.source}; device {self.total_bytes / GIB:.2f} GiB, in use {self.used_bytes / GIB:.2f}"
            f" GiB, workspace {self.workspace_bytes / GIB:.2f} GiB, NCCL {self.reserve.nccl_bytes / GIB:.2f} GiB,"
            f" CUDA graphs {self.reserve.graph_bytes / GIB:.2f} GiB"
            + (f", vision encoder {self.reserve.encoder_bytes / GIB:.2f} GiB)" if self.reserve.encoder_bytes else ")")
        )


def kv_pool_bytes(
    device_type: str, total: int, used: int, mem_fraction_static: float, workspace_bytes: int
) -> int:
    """Bytes for the KV cache on one rank, measured after weights and drafter are resident."""
    if device_type == "cuda":
        return int(mem_fraction_static * total) - used - workspace_bytes
    return min(CPU_KV_CAP_BYTES, int(CPU_KV_FRACTION * (total - used - workspace_bytes)))


def size_kv_pool(
    device: torch.device | str,
    bytes_per_token: int,
    workspace_bytes: int,
    token_limit: int,
    max_total_tokens: int | None = None,
    kv_memory_gb: float | None = None,
    mem_fraction_static: float = 0.85,
    tp: Any = None,
    probe: MemoryProbe = device_memory,
    reserve: RuntimeReserve = RuntimeReserve(0, 0),
) -> KVSizing:
    """KV slots for this server (precedence in the module docstring), at most ``token_limit`` (no request
    mix can use more: max requests x context). ``tp``: a TPGroup; the result is the minimum over ranks.
    ``reserve``: memory allocated after sizing (``runtime_reserve``), left out of a measured pool."""
    if bytes_per_token < 1:
        raise ValueError("bytes_per_token must be >= 1")
    if not 0 < mem_fraction_static <= 1:
        raise ValueError(f"mem_fraction_static must be in (0, 1], got {mem_fraction_static}")
    dev = torch.device(device)
    total = used = 0
    if max_total_tokens is not None:
        source, pool, tokens = "max_total_tokens", max_total_tokens * bytes_per_token, max_total_tokens
    else:
        if kv_memory_gb is not None:
            source, pool = "kv_memory_gb", int(kv_memory_gb * GIB)
        else:
            total, used = probe(dev)
            source = "mem_fraction_static" if dev.type == "cuda" else "host_memory"
            pool = kv_pool_bytes(dev.type, total, used, mem_fraction_static, workspace_bytes + reserve.bytes)
            if pool <= 0:
                raise ValueError(
                    f"no memory left for the KV cache: {used / GIB:.2f} GiB in use of {total / GIB:.2f} GiB after "
                    f"loading, workspace {workspace_bytes / GIB:.2f} GiB, NCCL and CUDA graphs "
                    f"{reserve.bytes / GIB:.2f} GiB, mem_fraction_static {mem_fraction_static}"
                )
        tokens = min(max(pool, 0) // bytes_per_token, token_limit)
    if tp is not None and tp.size > 1:
        tokens = tp.min_int(tokens)
    if tokens < MIN_KV_TOKENS:
        raise ValueError(
            f"the KV cache holds {tokens} tokens ({source}); at least {MIN_KV_TOKENS} are needed"
        )
    return KVSizing(tokens, bytes_per_token, pool, workspace_bytes, total, used, source, reserve)
