"""Tensor parallelism for the scheduler: rank 0 leads, ranks 1..N-1 follow (docs/PARALLEL.md).

Every TP rank runs an identical ``Scheduler`` over its shard of the model. Rank 0 (``TPScheduler``, the
same API as ``Scheduler``) receives requests and aborts; before each step it broadcasts the step's inputs
(``StepInputs``: the adds and aborts since the last step, in order) over the gloo control group. Followers
(``follower_loop``) apply them and run the same ``scheduler.step()``.

Invariant ("every rank samples identically: shared seeds broadcast"): the logits are all-gathered, so
every rank computes the same logits; every request carries a concrete seed (rank 0 draws one for
unseeded requests before broadcasting), so every rank's per-request generator draws the same coins; the
scheduler is deterministic, so every rank makes the same scheduling decisions and emits the same tokens.
No token is broadcast. ``ConsistencyCheck`` verifies it cheaply: a running hash of each step's outputs is
all-gathered every ``CHECK_EVERY`` steps and a mismatch raises ``TPDivergence`` on every rank.

Failure: a rank that dies breaks the next collective (gloo reports the closed connection; otherwise the
collective timeout fires); rank 0 raises ``TPRankError`` naming the dead local rank(s). ``has_work()``
also polls the local followers, so an idle server notices a dead rank within one scheduler-loop tick.
Followers die with their parent (PR_SET_PDEATHSIG) and ``close()`` ends them: no orphan processes.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import multiprocessing as mp
import os
import random
import signal
import sys
from dataclasses import dataclass
from typing import Any

from model_executor.parallel_state import (
    TPGroup,
    destroy_tp,
    free_local_addr,
    init_tp,
    ranks_per_node,
    stable_hash,
)
from server.config import ServerConfig
from server.io_struct import GenerateReq, TokenOut

logger = logging.getLogger(__name__)

CHECK_EVERY = 16  # steps between cross-rank consistency checks
FOLLOWER_STOP_TIMEOUT = 10.0


class TPRankError(RuntimeError):
    """A TP rank died or a collective failed; the TP world is unusable."""


class TPDivergence(TPRankError):
    """Ranks produced different outputs: the identical-sampling invariant is broken."""


@dataclass(frozen=True)
class StepInputs:
    """What rank 0 broadcasts before a step: ops applied in order, then (if ``step``) one scheduler step."""

    ops: tuple[tuple[str, Any], ...] = ()  # ("add", GenerateReq with a concrete seed) | ("abort", rid)
    step: bool = True
    shutdown: bool = False


class ConsistencyCheck:
    """Running hash of the outputs; every ``every`` steps all ranks compare theirs (one small all-gather)."""

    def __init__(self, tp: TPGroup, every: int = CHECK_EVERY):
        self.tp, self.every = tp, every
        self.steps, self.acc = 0, 0

    def update(self, outs: list[TokenOut]) -> None:
        summary = [(o.rid, tuple(o.token_ids), o.finished, o.finish_reason) for o in outs]
        self.acc = stable_hash((self.acc, summary))
        self.steps += 1
        if self.steps % self.every == 0:
            self.compare()

    def compare(self) -> None:
        hashes = self.tp.all_gather_int(self.acc)
        if len(set(hashes)) != 1:
            bad = [r for r, h in enumerate(hashes) if h != hashes[0]]
            raise TPDivergence(f"TP ranks diverged after {self.steps} steps: ranks {bad} differ from rank 0 "
                               "(outputs must be identical on every rank)")


def _apply(scheduler: Any, ops: tuple[tuple[str, Any], ...]) -> None:
    for op, arg in ops:
        if op == "add":
            scheduler.add_request(arg)
        elif op == "abort":
            scheduler.abort_request(arg)
        else:
            raise ValueError(f"unknown TP op {op!r}")


class TPScheduler:
    """Rank 0's scheduler under TP: ``Scheduler``'s API; other attributes delegate to the local scheduler."""

    def __init__(self, scheduler: Any, tp: TPGroup, followers: list[mp.process.BaseProcess]):
        self.scheduler, self.tp, self.followers = scheduler, tp, followers
        self._ops: list[tuple[str, Any]] = []
        self._seed_rng = random.Random(0x5EED)  # same stream as a TP=1 scheduler's unseeded requests
        self._check = ConsistencyCheck(tp)
        self._broken: str | None = None
        self._reported = False
        self._closed = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.scheduler, name)

    def add_request(self, req: GenerateReq) -> None:
        self._ensure_ok()
        if req.params.seed is None:
            req = dataclasses.replace(req, params=dataclasses.replace(req.params, seed=self._seed_rng.getrandbits(63)))
        self.scheduler.add_request(req)  # validates: only accepted requests reach the followers
        self._ops.append(("add", req))

    def abort_request(self, rid: str) -> None:
        self.scheduler.abort_request(rid)
        self._ops.append(("abort", rid))

    def has_work(self) -> bool:
        self._ensure_ok()
        return self.scheduler.has_work()

    def step(self) -> list[TokenOut]:
        self._ensure_ok()
        ops, self._ops = tuple(self._ops), []
        try:
            self.tp.broadcast_object(StepInputs(ops))
            outs = self.scheduler.step()
            self._check.update(outs)
        except TPDivergence as e:
            self._broken = str(e)
            self._report()
            raise
        except RuntimeError as e:
            self._broken = f"a TP collective failed ({type(e).__name__}: {e}); {self.describe_followers()}"
            self._report()
            raise TPRankError(self._broken) from e
        return outs

    def describe_followers(self) -> str:
        dead = [f"rank {_rank_of(p)} (pid {p.pid}) exited with status {p.exitcode}" for p in self.followers
                if not p.is_alive()]
        return "; ".join(dead) if dead else "no local rank has exited (a remote rank or the network failed?)"

    def _ensure_ok(self) -> None:
        if self._broken is None:
            for p in self.followers:
                if not p.is_alive():
                    self._broken = f"TP {self.describe_followers()}"
                    break
        if self._broken is not None:
            self._report()
            raise TPRankError(self._broken)

    def _report(self) -> None:
        if not self._reported:
            self._reported = True
            logger.error("tensor parallelism failed: %s", self._broken)

    def close(self) -> None:
        """Tell the followers to stop (if the world still works), then reap them (kill stragglers)."""
        if self._closed:
            return
        self._closed = True
        if self._broken is None:
            try:
                self.tp.broadcast_object(StepInputs(step=False, shutdown=True))
                self._check.compare()  # a last consistency check over the steps since the previous one
            except TPDivergence:
                stop_followers(self.followers)
                destroy_tp(self.tp)
                raise
            except RuntimeError:
                logger.warning("could not broadcast shutdown to the TP followers")
        stop_followers(self.followers)
        destroy_tp(self.tp)


def stop_followers(procs: list[mp.process.BaseProcess], timeout: float = FOLLOWER_STOP_TIMEOUT) -> None:
    for p in procs:
        p.join(timeout)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(2.0)


def _rank_of(p: mp.process.BaseProcess) -> str:
    return p.name.removeprefix("tp-rank-")


def follower_loop(scheduler: Any, tp: TPGroup) -> None:
    """Apply rank 0's broadcast inputs and step, until shutdown. Outputs are only hashed (rank 0 reports)."""
    check = ConsistencyCheck(tp)
    while True:
        msg: StepInputs = tp.broadcast_object()
        if msg.shutdown:
            check.compare()
            return
        _apply(scheduler, msg.ops)
        if msg.step:
            check.update(scheduler.step())


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass


def run_follower(config: ServerConfig, rank: int, init_addr: str, parent_pid: int | None) -> None:
    """Entry point of a follower rank's process."""
    logging.basicConfig(level=config.server.log_level.upper(),
                        format=f"[%(asctime)s tp-rank-{rank}] %(levelname)s %(message)s")
    if parent_pid is not None:
        _die_with_parent()
        if os.getppid() != parent_pid:
            os._exit(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 orchestrates shutdown
    from server.scheduler import Scheduler, _resolve_device

    tp = init_tp(config.parallel, rank, _resolve_device(config.model.device), init_addr)
    try:
        follower_loop(Scheduler(config, tp=tp), tp)
    except Exception:
        logger.exception("TP rank %d failed", rank)
        os._exit(1)
    destroy_tp(tp)


def start_followers(config: ServerConfig, init_addr: str) -> list[mp.process.BaseProcess]:
    """Spawn this node's follower ranks (all local ranks except global rank 0)."""
    per_node = ranks_per_node(config.parallel)
    first = config.parallel.node_rank * per_node
    ctx = mp.get_context("spawn")
    procs = []
    for rank in range(max(first, 1), first + per_node):
        p = ctx.Process(target=run_follower, args=(config, rank, init_addr, os.getpid()), name=f"tp-rank-{rank}",
                        daemon=True)
        p.start()
        procs.append(p)
    return procs


def make_scheduler(config: ServerConfig, model_path: str | None = None) -> Any:
    """``Scheduler`` for tp_size 1; otherwise spawn the local followers, join the TP world as rank 0 and
    return a ``TPScheduler``. Call ``close_scheduler`` when done."""
    from server.scheduler import Scheduler, _resolve_device

    par = config.parallel
    if par.tp_size == 1:
        return Scheduler(config, model_path=model_path)
    if par.node_rank != 0:
        raise ValueError("only node_rank 0 runs the scheduler; other nodes run run_node_followers")
    from server.model_path import resolve_model_path

    resolved = model_path or resolve_model_path(config.model.model_path)  # once, before any rank starts
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, model_path=resolved))
    addr = par.dist_init_addr or free_local_addr()
    followers = start_followers(config, addr)
    try:
        tp = init_tp(par, 0, _resolve_device(config.model.device), addr)
        return TPScheduler(Scheduler(config, tp=tp, model_path=resolved), tp, followers)
    except BaseException as e:
        dead = [f"rank {_rank_of(p)} exited with status {p.exitcode}" for p in followers if not p.is_alive()]
        for p in followers:
            p.kill()
        stop_followers(followers, 2.0)
        if dead and isinstance(e, Exception):
            raise TPRankError(f"TP startup failed: {'; '.join(dead)} ({type(e).__name__}: {e})") from e
        raise


def close_scheduler(scheduler: Any) -> None:
    close = getattr(scheduler, "close", None)
    if close is not None:
        close()


def run_node_followers(config: ServerConfig) -> int:
    """Multi-node: on a node with node_rank > 0, run this node's ranks until rank 0 shuts them down."""
    if not config.parallel.dist_init_addr:
        raise ValueError("multi-node tensor parallelism needs --dist-init-addr host:port of node 0")
    procs = start_followers(config, config.parallel.dist_init_addr)
    for p in procs:
        p.join()
    return max((abs(p.exitcode or 0) for p in procs), default=0) and 1
