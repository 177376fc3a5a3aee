"""Test-only fault hook: make chosen scheduler steps raise, as a broken kernel, a bug or an out-of-memory would,
on every rank or on one TP rank.

Inert unless the environment variable ``TEST_FAULT_ENV`` is set (the tests in tests/server/test_step_failure.py
and tests/parallel/test_tp_faults.py set it; a server logs a warning when it is on). Its value is a
comma-separated list of ``site[@rank]:token`` (a bare ``token`` means ``forward``; without ``@rank`` the fault
fires on every rank, with it on that global TP rank only, e.g. ``forward@1:42``: rank 1's forward fails
while rank 0's runs, as a one-rank out-of-memory would; ddtree_serve/server/tp/step_agreement.py). A step is
*hot* for a fault when a request of its batch holds the fault's token (prompt or output); during a hot step
the site raises ``RuntimeError("injected step failure (site[@rank], token N)")``:

- ``forward``: the target model's forward (``ModelRunner.forward``), before any KV is written and before
  its collectives (and before the TP step agreement's gate there);
- ``drafter``: the DFlash drafter's forward (the draft block of a speculative step);
- ``commit``: the speculative commit, after its device half moved the accepted path's KV slots and right after
  its host half freed the rest (``KVSlots.drop_tree``), before ``num_cached`` counts them.

The hook is installed by ``ddtree_serve.server.scheduling.scheduler_factory.make_scheduler`` and by every TP
follower (ddtree_serve/server/tp/spawn.py), after the TP step agreement, so a fault without ``@rank`` fires at
the same place on every rank. It wraps instance attributes of one scheduler only; no module state changes.
"""

from __future__ import annotations

import logging
import os
from typing import Any, NamedTuple, TypeVar

logger = logging.getLogger(__name__)

TEST_FAULT_ENV = "DDTREE_TEST_FAIL_ON_TOKEN"
SITES = ("forward", "drafter", "commit")
T = TypeVar("T")


class Fault(NamedTuple):
    site: str
    token: int
    rank: int | None  # None: every rank

    def __str__(self) -> str:
        return self.site if self.rank is None else f"{self.site}@{self.rank}"


def parse_faults(text: str) -> list[Fault]:
    """``"forward:12,commit@1:40"`` -> [Fault("forward", 12, None), Fault("commit", 40, 1)]; a bare token is a
    forward fault on every rank."""
    faults = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        where, _, token = item.rpartition(":")
        site, _, rank = where.partition("@")
        site = site or "forward"
        if site not in SITES:
            raise ValueError(f"{TEST_FAULT_ENV}: unknown fault site {site!r} (one of {', '.join(SITES)})")
        faults.append(Fault(site, int(token), int(rank) if rank else None))
    return faults


class _Hot:
    """The faults whose token the running step's batch holds (set around ``Scheduler.run``)."""

    def __init__(self) -> None:
        self.faults: list[Fault] = []

    def check(self, site: str) -> None:
        for f in self.faults:
            if f.site == site:
                raise RuntimeError(f"injected step failure ({f}, token {f.token})")


def install_test_faults(scheduler: T) -> T:
    """Arm the faults ``TEST_FAULT_ENV`` names on ``scheduler`` (a ``Scheduler``, or a ``TPScheduler``: its
    rank-0 scheduler) and return it. No-op when the variable is unset."""
    text = os.environ.get(TEST_FAULT_ENV)
    if not text:
        return scheduler
    s = getattr(scheduler, "scheduler", scheduler)
    rank = s.runner.tp.rank
    faults = [f for f in parse_faults(text) if f.rank in (None, rank)]  # this rank's
    logger.warning("%s=%s: steps over these tokens will fail (tests only)", TEST_FAULT_ENV, text)
    hot = _Hot()
    run = s.run

    def hot_run(batch):  # noqa: ANN001, ANN202 - Scheduler.run's signature
        hot.faults = [f for f in faults if any(f.token in q.all_ids for q in batch.reqs)]
        try:
            return run(batch)
        finally:
            hot.faults = []

    s.run = hot_run
    sites = {f.site for f in faults}
    if "forward" in sites:
        _before(s.runner, "forward", lambda: hot.check("forward"))
    if "drafter" in sites and s.spec is not None and s.spec.drafter is not None:
        _before(s.spec.drafter, "forward", lambda: hot.check("drafter"))
    if "commit" in sites:
        _after(s.runner.slots, "drop_tree", lambda: hot.check("commit"))
    return scheduler


def _before(obj: Any, name: str, check) -> None:  # noqa: ANN001
    inner = getattr(obj, name)

    def call(*args, **kw):  # noqa: ANN002, ANN003, ANN202
        check()
        return inner(*args, **kw)

    setattr(obj, name, call)


def _after(obj: Any, name: str, check) -> None:  # noqa: ANN001
    inner = getattr(obj, name)

    def call(*args, **kw):  # noqa: ANN002, ANN003, ANN202
        out = inner(*args, **kw)
        check()
        return out

    setattr(obj, name, call)
