"""Test-only fault hook: make chosen scheduler steps raise, as a broken kernel or a bug would, on every rank.

Inert unless the environment variable ``TEST_FAULT_ENV`` is set (the tests in tests/server/test_step_failure.py
and tests/parallel/test_tp_faults.py set it; a server logs a warning when it is on). Its value is a
comma-separated list of ``site:token`` (a bare ``token`` means ``forward``). A step is *hot* for a token when a
request of its batch holds that token (prompt or output); during a hot step the site raises:

- ``forward``: the target model's forward (``ModelRunner.forward``), before any KV is written;
- ``drafter``: the DFlash drafter's forward (the draft block of a speculative step);
- ``commit``: the speculative commit, right after it moved the accepted path's KV slots and freed the rest
  (``KVSlots.keep_path``), before ``num_cached`` counts them.

The hook is installed by ``ddtree_serve.server.scheduling.scheduler_factory.make_scheduler`` and by every TP follower
(ddtree_serve/server/tp/spawn.py), so a fault fires at the same place on every rank. It wraps instance attributes of one
scheduler only; no module state changes.
"""

from __future__ import annotations

import logging
import os
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

TEST_FAULT_ENV = "DDTREE_TEST_FAIL_ON_TOKEN"
SITES = ("forward", "drafter", "commit")
T = TypeVar("T")


def parse_faults(text: str) -> dict[str, int]:
    """``"forward:12,commit:40"`` -> {"forward": 12, "commit": 40}; a bare token is a forward fault."""
    faults = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        site, _, token = item.rpartition(":")
        site = site or "forward"
        if site not in SITES:
            raise ValueError(f"{TEST_FAULT_ENV}: unknown fault site {site!r} (one of {', '.join(SITES)})")
        faults[site] = int(token)
    return faults


class _Hot:
    """Which fault tokens the running step's batch holds (set around ``Scheduler.run``)."""

    def __init__(self) -> None:
        self.tokens: set[int] = set()

    def check(self, site: str, token: int) -> None:
        if token in self.tokens:
            raise RuntimeError(f"injected step failure ({site}, token {token})")


def install_test_faults(scheduler: T) -> T:
    """Arm the faults ``TEST_FAULT_ENV`` names on ``scheduler`` (a ``Scheduler``, or a ``TPScheduler``: its
    rank-0 scheduler) and return it. No-op when the variable is unset."""
    text = os.environ.get(TEST_FAULT_ENV)
    if not text:
        return scheduler
    faults = parse_faults(text)
    s = getattr(scheduler, "scheduler", scheduler)
    logger.warning("%s=%s: steps over these tokens will fail (tests only)", TEST_FAULT_ENV, text)
    hot = _Hot()
    run = s.run

    def hot_run(batch):  # noqa: ANN001, ANN202 - Scheduler.run's signature
        hot.tokens = {t for t in faults.values() if any(t in q.all_ids for q in batch.reqs)}
        try:
            return run(batch)
        finally:
            hot.tokens = set()

    s.run = hot_run
    if "forward" in faults:
        _before(s.runner, "forward", lambda: hot.check("forward", faults["forward"]))
    if "drafter" in faults and s.spec is not None and s.spec.drafter is not None:
        _before(s.spec.drafter, "forward", lambda: hot.check("drafter", faults["drafter"]))
    if "commit" in faults:
        _after(s.runner.slots, "keep_path", lambda: hot.check("commit", faults["commit"]))
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
