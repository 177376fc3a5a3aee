"""Tensor parallelism for the scheduler, the protocol: rank 0 leads, ranks 1..N-1 follow (docs/PARALLEL.md).

Every TP rank runs an identical ``Scheduler`` over its shard of the model. Rank 0 (``TPScheduler``, a
``SchedulerLike`` like ``Scheduler``) receives requests and aborts; before each step it broadcasts the step's
inputs (``StepInputs``: the adds and aborts since the last step, in order) over the gloo control group.
Followers (``follower_loop``) apply them and run the same ``scheduler.step()``. Their processes are
started by ddtree_serve/server/tp/spawn.py; ddtree_serve/server/scheduling/scheduler_factory.py builds either kind of scheduler.

Invariant ("every rank samples identically: shared seeds broadcast"): the logits are all-gathered, so
every rank computes the same logits; every request carries a concrete seed (rank 0 draws one for
unseeded requests before broadcasting), so every rank's per-request generator draws the same coins; the
scheduler is deterministic, so every rank makes the same scheduling decisions and emits the same tokens.
No token is broadcast. ``ConsistencyCheck`` verifies it cheaply: a running hash of each step's outputs and
of the state that scheduling reads (free and cached KV slots, queue lengths) is all-gathered every
``CHECK_EVERY`` steps and a mismatch raises ``TPDivergence`` on every rank.

A failed step (ddtree_serve/server/scheduling/step_recovery.py): the ranks agree on every step's success
before it commits (``StepAgreement``, ddtree_serve/server/tp/step_agreement.py: a vote after the step's
computation, gates before its target forwards). A fault on every rank, or on some ranks before a gate or
after the step's last collective, raises ``TPStepFailed`` on every rank; each fails that step's requests
(``fail_agreed_step``) and serving goes on. A fault on some ranks between collectives ends the server
within seconds (the failed rank's vote is never matched: ``TPRankError``). A failure after the vote (in
``process``) is caught as before: rank 0 sends the fingerprint of its previous step's failure (None: it
succeeded; agreed failures are fingerprinted alike on every rank) with the next ``StepInputs``; a follower
whose own outcome differs raises ``TPDivergence`` and exits, which ends the server with both outcomes in
the log.

Failure: a rank that dies breaks the next collective (gloo reports the closed connection; otherwise the
collective timeout fires); rank 0 raises ``TPRankError`` naming the dead local rank(s). ``has_work()``
also polls the local followers, so an idle server notices a dead rank within one scheduler-loop tick.
Followers die with their parent (PR_SET_PDEATHSIG) and ``close()`` ends them: no orphan processes.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from ddtree_serve.model_executor.parallel_state import CollectiveError, TPGroup, destroy_tp, stable_hash
from ddtree_serve.server.io_struct import GenerateReq, SchedulerStats, TokenOut
from ddtree_serve.server.tp.errors import TPDivergence, TPRankError, TPStepFailed
from ddtree_serve.server.tp.processes import rank_of, stop_followers
from ddtree_serve.server.tp.step_agreement import StepAgreement, fail_agreed_step

if TYPE_CHECKING:
    from ddtree_serve.server.scheduling.request import Req
    from ddtree_serve.server.scheduling.scheduler import Scheduler

logger = logging.getLogger(__name__)

Op = tuple[str, GenerateReq | str]  # ("add", GenerateReq with a concrete seed) | ("abort", rid)

CHECK_EVERY = 16  # steps between cross-rank consistency checks


@dataclass(frozen=True)
class StepInputs:
    """What rank 0 broadcasts before a step: ops applied in order, then (if ``step``) one scheduler step."""

    ops: tuple[Op, ...] = ()
    step: bool = True
    shutdown: bool = False
    prev_failure: str | None = None  # rank 0's previous step: None (ran) or its failure fingerprint


class ConsistencyCheck:
    """Running hash of the outputs; every ``every`` steps all ranks compare theirs (one small all-gather)."""

    def __init__(self, tp: TPGroup, every: int = CHECK_EVERY):
        self.tp, self.every = tp, every
        self.steps, self.acc = 0, 0

    def update(self, outs: list[TokenOut], scheduler: Scheduler) -> None:
        summary = [(o.rid, tuple(o.token_ids), o.finished, o.finish_reason) for o in outs]
        kv = scheduler.kv  # what the next steps' scheduling reads: equal on every rank, or shapes would differ
        state = (kv.num_free, kv.cached_tokens, len(scheduler.waiting), len(scheduler.running))
        self.acc = stable_hash((self.acc, summary, state))
        self.steps += 1
        if self.steps % self.every == 0:
            self.compare()

    def compare(self) -> None:
        hashes = self.tp.all_gather_int(self.acc)
        if len(set(hashes)) != 1:
            bad = [r for r, h in enumerate(hashes) if h != hashes[0]]
            raise TPDivergence(f"TP ranks diverged after {self.steps} steps: ranks {bad} differ from rank 0 "
                               "(outputs must be identical on every rank)")


def agreed_fingerprint(error: TPStepFailed) -> str:
    """An agreed failure's fingerprint: its message, built from every rank's vote, is equal on every rank."""
    return f"agreed: {error}"


def check_outcome(rank: int, rank0: str | None, mine: str | None) -> None:
    """A follower's check that its previous step ended as rank 0's did (both ran, or both failed alike)."""
    if rank0 != mine:
        raise TPDivergence(f"TP rank {rank} and rank 0 disagree on the last step's outcome (rank 0: "
                           f"{rank0 or 'ran'}; rank {rank}: {mine or 'ran'}): their states differ, this rank stops")


def _apply(scheduler: Scheduler, ops: tuple[Op, ...]) -> None:
    for op, arg in ops:
        if op == "add":
            scheduler.add_request(arg)
        elif op == "abort":
            scheduler.abort_request(arg)
        else:
            raise ValueError(f"unknown TP op {op!r}")


class TPScheduler:
    """Rank 0's scheduler under TP, a ``SchedulerLike`` (ddtree_serve/server/scheduling/scheduler_factory.py): requests and aborts go
    to the local ``scheduler`` (rank 0's shard) and, at the next step, to every follower."""

    def __init__(self, scheduler: Scheduler, tp: TPGroup, followers: list[mp.process.BaseProcess]):
        self.scheduler, self.tp, self.followers = scheduler, tp, followers
        self._ops: list[Op] = []
        self._seed_rng = random.Random(0x5EED)  # same stream as a TP=1 scheduler's unseeded requests
        self._check = ConsistencyCheck(tp)
        self._broken: str | None = None
        self._failure: str | None = None  # the last step's failure fingerprint, sent with the next step
        self._agreed: TPStepFailed | None = None  # the last step's agreed failure, for fail_step
        self._agreement: StepAgreement | None = None  # start_agreement
        self._reported = False
        self._closed = False

    @property
    def max_context_len(self) -> int:
        return self.scheduler.max_context_len

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.scheduler.eos_token_ids

    @property
    def vocab_size(self) -> int:
        return self.scheduler.vocab_size

    @property
    def running(self) -> list[Req]:
        return self.scheduler.running

    @property
    def waiting(self) -> deque[Req]:
        return self.scheduler.waiting

    @property
    def outbox(self) -> list[TokenOut]:
        return self.scheduler.outbox

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    def add_request(self, req: GenerateReq) -> None:
        self._ensure_ok()
        if req.params.seed is None:
            req = dataclasses.replace(req, params=dataclasses.replace(req.params, seed=self._seed_rng.getrandbits(63)))
        self.scheduler.add_request(req)  # validates: only accepted requests reach the followers
        self._ops.append(("add", req))

    def abort_request(self, rid: str) -> None:
        self.scheduler.abort_request(rid)
        self._ops.append(("abort", rid))

    takes_requests_mid_step: ClassVar[bool] = False  # requests join between steps (followers mirror them)

    def set_host_window(self, work: Callable[[], None] | None) -> None:
        """Rank 0's overlap window (``Scheduler.set_host_window``); the followers run none."""
        self.scheduler.set_host_window(work)

    def has_work(self) -> bool:
        self._ensure_ok()
        return self.scheduler.has_work()

    def start_agreement(self) -> StepAgreement:
        """Create the step agreement and install it on rank 0's scheduler: after the warm-up (which restores
        the runner's methods) and before the test-only fault hook, where every follower does
        (ddtree_serve/server/tp/spawn.py). ``make_scheduler`` calls it; the first step otherwise."""
        if self._agreement is None:
            self._agreement = StepAgreement.create(self.tp, self.scheduler.config.parallel.startup_timeout_s)
            self._agreement.install(self.scheduler)
        return self._agreement

    def step(self) -> list[TokenOut]:
        """One step on every rank. Raises ``TPRankError`` when the TP world broke; ``TPStepFailed`` when the
        step failed on some rank(s) and every rank agreed; any other error is a failure after the agreement.
        After the latter two the caller calls ``fail_step``."""
        from ddtree_serve.server.scheduling.step_recovery import failure_fingerprint

        self._ensure_ok()
        ops, self._ops = tuple(self._ops), []
        failure, self._failure, self._agreed = self._failure, None, None
        agreement = self.start_agreement()
        try:
            self.tp.broadcast_object(StepInputs(ops, prev_failure=failure))
            outs = agreement.run_step(self.scheduler.step)
            self._check.update(outs, self.scheduler)
        except TPStepFailed as e:
            self._agreed, self._failure = e, agreed_fingerprint(e)
            raise
        except TPRankError as e:  # diverged ranks, or a rank that failed between collectives
            self._broken = str(e)
            self._report()
            raise
        except CollectiveError as e:
            self._broken = f"a TP collective failed ({type(e).__name__}: {e}); {self.describe_followers()}"
            self._report()
            raise TPRankError(self._broken) from e
        except Exception as e:
            self._failure = failure_fingerprint(e)
            raise
        return outs

    def fail_step(self) -> list[str]:
        """Fail the last step's requests on rank 0; every follower does the same (the same agreed failure,
        or, after a failure past the agreement, its own: compared at the next step's inputs)."""
        agreed, self._agreed = self._agreed, None
        return fail_agreed_step(self.scheduler, agreed)

    def describe_followers(self) -> str:
        dead = [f"rank {rank_of(p)} (pid {p.pid}) exited with status {p.exitcode}" for p in self.followers
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
        """Tell the followers to stop (if the world still works), then reap them (kill stragglers). In a
        broken world this rank's connections close first: a follower waiting in a collective for rank 0
        then fails at once instead of at its timeout."""
        if self._closed:
            return
        self._closed = True
        if self._broken is not None:
            destroy_tp(self.tp)
            stop_followers(self.followers)
            return
        try:
            self.tp.broadcast_object(StepInputs(step=False, shutdown=True, prev_failure=self._failure))
            self._check.compare()  # a last consistency check over the steps since the previous one
        except TPDivergence:
            stop_followers(self.followers)
            destroy_tp(self.tp)
            raise
        except RuntimeError:
            logger.warning("could not broadcast shutdown to the TP followers")
        stop_followers(self.followers)
        destroy_tp(self.tp)


def follower_loop(scheduler: Scheduler, tp: TPGroup, agreement: StepAgreement) -> None:
    """Apply rank 0's broadcast inputs and step, until shutdown. Outputs are only hashed (rank 0 reports).
    Every step runs under ``agreement`` (installed on ``scheduler``); a step that failed here fails its
    requests as on rank 0 (``fail_agreed_step``); after a failure past the agreement the next inputs tell
    whether rank 0's step failed alike (``check_outcome``)."""
    from ddtree_serve.server.scheduling.step_recovery import failure_fingerprint, is_fatal

    check = ConsistencyCheck(tp)
    failure: str | None = None
    while True:
        msg: StepInputs = tp.broadcast_object()
        check_outcome(tp.rank, msg.prev_failure, failure)
        if msg.shutdown:
            check.compare()
            return
        _apply(scheduler, msg.ops)
        if msg.step:
            failure = None
            try:
                outs = agreement.run_step(scheduler.step)
            except TPStepFailed as e:
                failure = agreed_fingerprint(e)
                logger.error("TP rank %d: %s; failing its requests", tp.rank, e)
                fail_agreed_step(scheduler, e)
                continue
            except Exception as e:
                if is_fatal(e):
                    raise
                failure = failure_fingerprint(e)
                logger.error("TP rank %d: scheduler step failed (%s); failing its requests", tp.rank, failure)
                fail_agreed_step(scheduler, None)
                continue
            check.update(outs, scheduler)
