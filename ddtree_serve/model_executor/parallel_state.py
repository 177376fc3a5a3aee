"""Tensor-parallel group handle, passed explicitly to every layer (no process-global state).

``TPGroup()`` is the single-process default. Under tensor parallelism each rank builds one ``TPGroup``
with ``init_tp`` (gloo on CPU, NCCL on CUDA). Two process groups per rank:

- ``group``: the device group used inside the model (all-reduce of row-parallel outputs, all-gather of
  the vocab-parallel logits). NCCL on CUDA, gloo on CPU; bounded by ``collective_timeout_s`` so a dead rank
  is an error, never a hang forever.
- ``cpu_group``: a gloo group for small control messages (the scheduler's step inputs, consistency
  hashes, the KV capacity minimum). Its timeout is long (``control_timeout_s``): a follower legitimately
  waits there while rank 0 is idle.

Start-up vs steady state: ranks load ~600 GB and JIT-compile kernels at their own pace, so the first
collectives (the KV sizing's ``min_int``, the warm-up forwards) may wait long for a late rank. ``init_tp``
creates both groups with the start-up timeout (``startup_timeout_s``, default 30 min, logged); once the
scheduler is built and warmed up, ``end_startup`` sets the steady-state timeouts (``collective_timeout_s``,
120 s; the followers' control group keeps its long wait) and logs how long start-up took.

Uneven splits: ``partition(n)`` gives rank r a contiguous block of ``n // size`` units plus one of the
first ``n % size`` leftovers, so a model with 9 heads / 3 KV heads (SmolLM2) still runs at TP=2 (KV heads
are the unit; query heads follow their KV head).

Expert parallelism (``expert_parallel=True``): MoE layers give each rank whole experts (a balanced
``partition`` of the routed experts, full intermediate dim) instead of a slice of every expert; attention,
dense MLPs, shared experts and the vocabulary stay tensor-parallel. The EP group is the TP group (as SGLang
with ``ep_size == tp_size``), so the MoE output is combined by the same all-reduce.

Decode context parallelism (``dcp_size`` N > 1, ``--decode-context-parallel-size``; N divides the TP size):
the TP ranks form ``tp_size / N`` DCP groups of N consecutive ranks (global ranks ``g*N .. g*N + N - 1``;
the DCP rank is ``rank % N``). Each rank of a group stores 1/N of every sequence's MLA latent KV; MLA
attention all-gathers the group's queries (``dcp_all_gather``), attends over the local shard and merges the
partials by their log-sum-exp (``dcp_reduce_scatter`` returns each rank its own heads;
ddtree_serve/model_executor/layers/dcp_attention.py). With N = tp_size the DCP group is the device group itself.
"""

from __future__ import annotations

import datetime
import logging
import pickle
import socket
import time
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

DEFAULT_COLLECTIVE_TIMEOUT_S = 120.0
DEFAULT_CONTROL_TIMEOUT_S = 7 * 24 * 3600.0
DEFAULT_STARTUP_TIMEOUT_S = 1800.0


class CollectiveError(RuntimeError):
    """A collective of a ``TPGroup`` failed (a rank died, the network failed, or a rank was late past the
    timeout). Distinguishes a broken TP world, which nothing can recover, from an error in a step's own
    computation (ddtree_serve/server/scheduling/step_recovery.py): gloo and NCCL raise plain RuntimeErrors."""


def _collective(what: str, fn, *args, **kw) -> None:  # noqa: ANN001
    try:
        fn(*args, **kw)
    except RuntimeError as e:
        raise CollectiveError(f"{what} failed: {e}") from e


class ParallelLike(Protocol):
    """The fields of ``ddtree_serve.server.config.ParallelArgs`` that ``init_tp`` reads."""

    tp_size: int
    nnodes: int
    node_rank: int
    dist_init_addr: str | None
    expert_parallel: bool
    startup_timeout_s: float  # collectives until ``end_startup`` (default ``DEFAULT_STARTUP_TIMEOUT_S``)
    decode_context_parallel_size: int  # DCP group size N (1: off; divides tp_size)
    vocab_parallel_logits: bool  # logits stay sharded by vocabulary under TP (False: all-gathered)


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    group: Any = None  # torch.distributed ProcessGroup (device collectives), None = default world group
    cpu_group: Any = None  # gloo ProcessGroup for control messages; None = ``group`` (CPU runs)
    expert_parallel: bool = False  # MoE: whole experts per rank instead of a slice of every expert
    timeouts_s: tuple[float, float] = (DEFAULT_COLLECTIVE_TIMEOUT_S, DEFAULT_CONTROL_TIMEOUT_S)  # steady state
    started_at: float = 0.0  # time.monotonic() at init_tp (start-up length in the log)
    dcp_size: int = 1  # decode context parallelism: ranks sharing one sequence's KV (module docstring)
    dcp_group: Any = None  # this rank's DCP device group; None = ``group`` (dcp_size == size, or 1)
    vocab_parallel: bool = True  # logits stay sharded by vocabulary (``ParallelArgs.vocab_parallel_logits``)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            _collective("all_reduce", dist.all_reduce, x, group=self.group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] on every rank -> [..., size * n] in rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        _collective("all_gather", dist.all_gather, parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def gather_stacked(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` of every rank (same shape on each) stacked in rank order: ``[size, *x.shape]``."""
        if self.size == 1:
            return x[None]
        parts = [torch.empty_like(x) for _ in range(self.size)]
        _collective("all_gather", dist.all_gather, parts, x.contiguous(), group=self.group)
        return torch.stack(parts)

    def shard(self, n: int, what: str = "dimension") -> int:
        if n % self.size:
            raise ValueError(f"{what} {n} is not divisible by tp_size {self.size}")
        return n // self.size

    def partition(self, n: int, what: str = "dimension") -> tuple[int, int]:
        """(start, count) of this rank's contiguous block of ``n`` units (balanced, leftovers to low ranks)."""
        if n < self.size:
            raise ValueError(f"{what} {n} is smaller than tp_size {self.size}: every rank needs at least one")
        base, extra = divmod(n, self.size)
        return self.rank * base + min(self.rank, extra), base + (1 if self.rank < extra else 0)

    # ------------------------------------------------------------ decode context parallelism
    @property
    def dcp_rank(self) -> int:
        """This rank's place in its DCP group (0 when DCP is off)."""
        return self.rank % self.dcp_size

    def _dcp_device_group(self) -> Any:
        return self.dcp_group if self.dcp_group is not None else self.group

    def dcp_all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """``x`` of every rank of the DCP group concatenated along ``dim``, in DCP-rank order."""
        if self.dcp_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.dcp_size)]
        _collective("dcp all_gather", dist.all_gather, parts, x.contiguous(), group=self._dcp_device_group())
        return torch.cat(parts, dim=dim)

    def dcp_reduce_scatter(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Sum ``x`` over the DCP group and return this rank's block of ``dim`` (``dim``'s size divisible
        by ``dcp_size``; block ``dcp_rank``). NCCL reduce-scatters; gloo (CPU) has no reduce-scatter, so
        it all-reduces and slices."""
        if self.dcp_size == 1:
            return x
        group = self._dcp_device_group()
        n = x.shape[dim] // self.dcp_size
        if dist.get_backend(group) == "nccl":
            xt = x.movedim(dim, 0).contiguous()  # [N * n, ...]
            out = torch.empty((n, *xt.shape[1:]), dtype=x.dtype, device=x.device)  # [n, ...]
            _collective("dcp reduce_scatter", dist.reduce_scatter_tensor, out, xt, group=group)
            return out.movedim(0, dim)
        x = x.contiguous()
        _collective("dcp all_reduce", dist.all_reduce, x, group=group)
        return x.narrow(dim, self.dcp_rank * n, n)

    # ------------------------------------------------------------ control plane (gloo, CPU)
    @property
    def control_group(self) -> Any:
        return self.cpu_group if self.cpu_group is not None else self.group

    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0's ``obj`` on every rank (pickled over the gloo control group)."""
        if self.size == 1:
            return obj
        box = [obj if self.rank == 0 else None]
        _collective("broadcast", dist.broadcast_object_list, box, src=_global_rank(self, 0), group=self.control_group)
        return box[0]

    def all_gather_int(self, x: int) -> list[int]:
        """Every rank's int64 value, in rank order (control group)."""
        if self.size == 1:
            return [x]
        t = torch.tensor([x], dtype=torch.int64)
        parts = [torch.empty_like(t) for _ in range(self.size)]
        _collective("all_gather_int", dist.all_gather, parts, t, group=self.control_group)
        return [int(p.item()) for p in parts]

    def min_int(self, x: int) -> int:
        return min(self.all_gather_int(x))


def _global_rank(tp: TPGroup, group_rank: int) -> int:
    return group_rank if tp.control_group is None else dist.get_global_rank(tp.control_group, group_rank)


def free_local_addr() -> str:
    """A free TCP port on localhost as ``host:port`` (single-node runs without --dist-init-addr)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def ranks_per_node(parallel: ParallelLike) -> int:
    if parallel.tp_size % parallel.nnodes:
        raise ValueError(f"tp_size {parallel.tp_size} must divide evenly over nnodes {parallel.nnodes}")
    return parallel.tp_size // parallel.nnodes


def init_tp(parallel: ParallelLike, rank: int, device: str | torch.device, init_addr: str | None = None,
            collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S,
            control_timeout_s: float | None = None) -> TPGroup:
    """Join the TP world as global ``rank`` and return its ``TPGroup``.

    Backend: NCCL when ``device`` is CUDA (the device is set to ``rank % ranks_per_node`` first), gloo on
    CPU. Rendezvous at ``init_addr`` or ``parallel.dist_init_addr`` (``host:port`` of rank 0); a single-node
    launcher picks ``free_local_addr()`` and passes it to every rank.

    Control-group timeout (each process sets its own): rank 0 never waits long for a follower, so it uses
    ``collective_timeout_s``; followers wait for rank 0's next step, idle time included, so they default to
    ``DEFAULT_CONTROL_TIMEOUT_S``.
    """
    if control_timeout_s is None:
        control_timeout_s = collective_timeout_s if rank == 0 else DEFAULT_CONTROL_TIMEOUT_S
    startup_s = float(parallel.startup_timeout_s)
    size = parallel.tp_size
    dcp = check_dcp_size(size, int(getattr(parallel, "decode_context_parallel_size", 1)))
    if size == 1:  # the flag still reaches a simulated device's cost model (ddtree_serve/sim/machines.py)
        return TPGroup(vocab_parallel=bool(getattr(parallel, "vocab_parallel_logits", True)))
    addr = init_addr or parallel.dist_init_addr
    if not addr:
        raise ValueError("tensor parallelism needs dist_init_addr (host:port of rank 0)")
    host, port = addr.rsplit(":", 1)
    dev = torch.device(device)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    if dev.type == "cuda":
        torch.cuda.set_device(rank % ranks_per_node(parallel))
    started = time.monotonic()
    logger.info("TP rank %d/%d: start-up collectives wait up to %.0f s for a late rank (steady state: %.0f s)",
                rank, size, startup_s, collective_timeout_s)
    dist.init_process_group(backend, init_method=f"tcp://{host}:{port}", rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=max(startup_s, collective_timeout_s)))
    cpu_group = dist.new_group(list(range(size)), backend="gloo",
                               timeout=datetime.timedelta(seconds=max(startup_s, control_timeout_s)))
    dcp_group = None
    if 1 < dcp < size:  # every rank creates every DCP group (new_group is collective), keeps its own
        for g in range(size // dcp):
            members = list(range(g * dcp, (g + 1) * dcp))
            made = dist.new_group(members, backend=backend,
                                  timeout=datetime.timedelta(seconds=max(startup_s, collective_timeout_s)))
            if rank in members:
                dcp_group = made
    return TPGroup(rank, size, None, cpu_group, bool(parallel.expert_parallel),
                   (collective_timeout_s, control_timeout_s), started, dcp, dcp_group,
                   bool(getattr(parallel, "vocab_parallel_logits", True)))


def check_dcp_size(tp_size: int, dcp_size: int) -> int:
    """``dcp_size`` when it is a valid decode-context-parallel size for ``tp_size`` ranks, else ValueError."""
    if dcp_size < 1 or tp_size % dcp_size:
        raise ValueError(f"decode_context_parallel_size {dcp_size} must divide tp_size {tp_size} "
                         "(each DCP group is that many of the TP ranks)")
    return dcp_size


def end_startup(tp: TPGroup) -> None:
    """Switch ``tp``'s groups from the start-up timeout to the steady-state ones (module docstring) and log
    how long start-up took. Call once, after the scheduler is built and warmed up; no-op for one process."""
    if tp.size == 1:
        return
    from torch.distributed.distributed_c10d import _set_pg_timeout

    device_s, control_s = tp.timeouts_s
    _set_pg_timeout(datetime.timedelta(seconds=device_s), None)  # the default (device) group
    _set_pg_timeout(datetime.timedelta(seconds=control_s), tp.control_group)
    if tp.dcp_group is not None:
        _set_pg_timeout(datetime.timedelta(seconds=device_s), tp.dcp_group)
    logger.info("TP rank %d: start-up took %.1f s; collective timeout now %.0f s (control group %.0f s)",
                tp.rank, time.monotonic() - tp.started_at, device_s, control_s)


def destroy_tp(tp: TPGroup) -> None:
    """Leave the TP world (no-op for a single process)."""
    if tp.size > 1 and dist.is_initialized():
        dist.destroy_process_group()


def stable_hash(obj: Any) -> int:
    """A 63-bit hash of a picklable value that is equal on every rank for equal values."""
    import hashlib

    return int.from_bytes(hashlib.blake2b(pickle.dumps(obj, protocol=4), digest_size=8).digest(), "little") >> 1
