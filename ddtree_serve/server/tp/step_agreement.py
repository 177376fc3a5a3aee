"""Tensor parallelism: the ranks agree on each step's success before it commits (issue 48 item 5).

A step can fail on one rank only (an out-of-memory there, a rank-local bug). Without an agreement the other
ranks would commit the step's tokens while that rank fails its requests: their states split, and a rank
left waiting in a collective the failed one never enters waits for the 120 s collective timeout. So every
rank votes on each step over its own small gloo group (``StepAgreement.group``: used by nothing else, so a
vote never meets another kind of collective):

- **vote**: once per step, after ``Scheduler.run`` (the step's computation) returns or raises and before
  ``Scheduler.process`` commits its tokens; a step without a batch votes at its end. One int per rank (the
  byte length of its failure text, 0: it ran), all-gathered; when one is non-zero the texts follow.
- **gates**: before each target forward (``ModelRunner.forward``) of a step every rank passes a gate, the
  same all-gather. A rank whose step raised before that forward votes "failed" into its peers' gate (gate
  and vote are the same collective), so they learn it before entering the forward's collectives, which the
  failed rank would never join: every rank then stops at the same point.

An agreed failure raises ``TPStepFailed`` on every rank, naming the failed rank(s) and the first one's error;
each rank then runs the same ``fail_step`` (ddtree_serve/server/scheduling/step_recovery.py), after a
one-rank failure also dropping the prefix cache's unlocked entries (``fail_agreed_step``), so the states
stay identical, and the server serves on.

Cases (docs/DESIGN.md 4.6):

- recovered: a fault on any subset of ranks before a gate (before a target forward: scheduling, input
  preparation, the fault hook's ``forward`` site) or after the step's last collective (sampling, the
  speculative commit, when no collective follows it);
- ends the server within ``grace_s`` (default 10 s) plus reaping: a fault on some ranks *between* collectives
  (inside a forward, or before a drafter forward's or a control broadcast's collective in a speculative
  step): the peers wait in a collective the failed rank never joins, its vote is not matched within
  ``grace_s``, and it raises ``TPRankError`` (fatal): rank 0 ends the server, a follower exits with status 1
  (its peers' collectives fail at once on gloo; on NCCL after the collective timeout, as for a dead rank);
- ends the server as before: a rank that dies or hangs (``CollectiveError`` / ``TPRankError``: dead-rank
  detection in ddtree_serve/server/tp/protocol.py), and a failure in ``process`` after the vote (rank 0's
  failure fingerprint with the next step's inputs, ``check_outcome``).

Invariants: gates and votes are deterministic in the step's code path (the same forwards on every rank),
so every rank makes the same sequence of agreement collectives; each step votes exactly once per rank (a
gate that reports a failure is that step's vote); every wait is bounded (``grace_s`` for a rank that
failed, the collective timeout otherwise). Outside a TP step (warm-up) gates and votes do nothing.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ddtree_serve.model_executor.parallel_state import CollectiveError, TPGroup
from ddtree_serve.server.io_struct import TokenOut
from ddtree_serve.server.tp.errors import TPRankError, TPStepFailed

VOTE_GRACE_S = 10.0  # how long a rank whose step failed waits for its peers' gate or vote
MAX_TEXT_BYTES = 2000  # of a failure's text, in the vote


class StepAgreement:
    """One rank's side of the step agreement (module docstring). Build it with ``create`` on every rank at
    the same point (after the warm-up and ``end_startup``: the warm-up restores the runner's methods), then
    ``install`` it on that rank's scheduler (before the test-only fault hook, whose ``forward`` fault then
    fires before the gate) and drive every TP step through ``run_step``."""

    def __init__(self, tp: TPGroup, group: Any, grace_s: float = VOTE_GRACE_S):
        self.tp, self.group, self.grace_s = tp, group, grace_s
        self.timeout_s = tp.timeouts_s[0]  # a rank that ran waits as long as for any collective
        self._active = False  # inside run_step
        self._voted = False  # this step's vote is cast (by a vote, or by a gate that saw a failure)

    @classmethod
    def create(cls, tp: TPGroup, startup_timeout_s: float) -> StepAgreement:
        """Create the agreement's gloo group (a collective over every rank: same point on each)."""
        timeout = datetime.timedelta(seconds=max(startup_timeout_s, tp.timeouts_s[0]))  # ranks start unevenly
        return cls(tp, dist.new_group(list(range(tp.size)), backend="gloo", timeout=timeout))

    def install(self, scheduler: Any) -> None:
        """Wrap ``scheduler.run`` (the vote after it) and its runner's ``forward`` (the gate before it);
        instance attributes only."""
        run, forward = scheduler.run, scheduler.runner.forward

        def voting_run(batch):  # noqa: ANN001, ANN202 - Scheduler.run's signature
            if not self._active:
                return run(batch)
            try:
                results = run(batch)
            except TPStepFailed:
                raise  # agreed at a gate
            except Exception as e:
                if _fatal(e):
                    raise
                self.vote(e)  # raises TPStepFailed
            self.vote(None)
            return results

        def gated_forward(*args, **kw):  # noqa: ANN002, ANN003, ANN202 - ModelRunner.forward's signature
            self.gate()
            return forward(*args, **kw)

        scheduler.run, scheduler.runner.forward = voting_run, gated_forward

    def run_step(self, step: Callable[[], list[TokenOut]]) -> list[TokenOut]:
        """Run one scheduler ``step`` under the agreement. Raises ``TPStepFailed`` when any rank's step failed
        before or at its vote (every rank raises it alike), ``TPRankError`` when the world cannot agree, and
        re-raises an error after the vote (``process``) or a fatal one unchanged."""
        self._active, self._voted = True, False
        try:
            try:
                outs = step()
            except TPStepFailed:
                raise
            except Exception as e:
                if self._voted or _fatal(e):
                    raise
                self.vote(e)  # failed before its batch ran (scheduling): raises TPStepFailed
            if not self._voted:
                self.vote(None)  # a step without a batch
            return outs
        finally:
            self._active = False

    def gate(self) -> None:
        """Before a target forward: raise ``TPStepFailed`` if a peer's step already failed."""
        if not self._active or self._voted:
            return
        texts = self._exchange(None)
        if any(texts):
            self._voted = True
            raise _agreed(texts)

    def vote(self, error: BaseException | None) -> None:
        """Cast this step's vote (``error``: this rank's failure, None: it ran); raise ``TPStepFailed`` when
        any rank failed."""
        self._voted = True
        mine = None if error is None else f"{type(error).__name__}: {error}"
        texts = self._exchange(mine)
        if any(texts):
            raise _agreed(texts) from error

    def _exchange(self, mine: str | None) -> list[str | None]:
        """Every rank's failure text (None: ran), in rank order: lengths first, texts only after a failure."""
        data = (mine or "").encode()[:MAX_TEXT_BYTES]
        wait = self.grace_s if mine is not None else self.timeout_s
        lens = self._all_gather(torch.tensor([len(data)], dtype=torch.int64), wait, mine)  # [size]
        if not lens.any():
            return [None] * self.tp.size
        width = int(lens.max())
        buf = torch.zeros(width, dtype=torch.uint8)  # [width]
        buf[:len(data)] = torch.tensor(list(data), dtype=torch.uint8)
        rows = self._all_gather(buf, self.timeout_s, mine).view(self.tp.size, width)  # [size, width]
        return [bytes(rows[r, :n].tolist()).decode(errors="replace") if n else None
                for r, n in enumerate(lens.tolist())]

    def _all_gather(self, t: torch.Tensor, wait_s: float, mine: str | None) -> torch.Tensor:
        """``t`` of every rank concatenated (the agreement group), waiting at most ``wait_s``."""
        parts = [torch.empty_like(t) for _ in range(self.tp.size)]
        try:
            work = dist.all_gather(parts, t, group=self.group, async_op=True)
            if work.wait(timeout=datetime.timedelta(seconds=wait_s)) is False:
                raise RuntimeError("timed out")
        except RuntimeError as e:
            if mine is None:
                raise CollectiveError(f"step agreement failed: {e}") from e
            raise TPRankError(f"TP rank {self.tp.rank}: its step failed ({mine}) while the other ranks did not "
                              f"reach the step agreement within {wait_s:.0f} s: they wait in a collective this "
                              f"rank never joins, so the TP world cannot recover ({e})") from e
        return torch.cat(parts)


def _agreed(texts: list[str | None]) -> TPStepFailed:
    failed = [r for r, t in enumerate(texts) if t]
    first = f"rank {failed[0]}: {texts[failed[0]]}"
    if len(failed) == len(texts):
        return TPStepFailed(f"the step failed on every TP rank ({first})", tuple(failed), partial=False)
    names = ", ".join(map(str, failed))
    return TPStepFailed(f"the step failed on TP rank{'s' * (len(failed) > 1)} {names} of {len(texts)} ({first}); "
                        "every rank fails its requests", tuple(failed), partial=True)


def _fatal(error: BaseException) -> bool:
    from ddtree_serve.server.scheduling.step_recovery import is_fatal

    return is_fatal(error)


def fail_agreed_step(scheduler: Any, agreed: TPStepFailed | None) -> list[str]:
    """``fail_step`` after a failed TP step, the same on every rank. After a failure on some ranks only
    (``agreed.partial``) the ranks may have got different distances into the step before stopping at the
    same gate (a fault before ``ensure_free``'s evictions, say): the prefix cache's unlocked entries are
    dropped too, leaving on every rank exactly the entries the live requests lock."""
    from ddtree_serve.server.scheduling.step_recovery import fail_step

    failed = fail_step(scheduler)
    tree = scheduler.kv.tree
    if agreed is not None and agreed.partial and tree is not None and tree.evictable_size:
        tree.evict(tree.evictable_size)
    return failed
