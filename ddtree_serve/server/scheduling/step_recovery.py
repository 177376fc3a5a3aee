"""Recovery from a scheduler step that raised: fail only the requests of that step's batch.

A step (``Scheduler.step``: schedule -> run -> process) can raise part-way: after KV slots were allocated
for the batch (a prefill chunk's slots written to the request table but not yet counted in
``num_cached``, a decode step's new slot, a speculative step's temporary tree slots), after some requests
of the batch already finished, or after a fully prefilled request left the waiting queue but before it
joined the running list. ``Scheduler.step`` records the step's batch (``step_batch``, None until
``schedule`` returns one) so that ``fail_step`` can:

- take every unfinished request of the batch out of the queues and release its KV (``Scheduler._release``):
  the prefix cache keeps only the tokens it already held (``tree_len``); the request's other counted slots
  (``num_cached`` beyond them: a decode or speculative step's tokens) are freed, not cached, so that the
  result does not depend on how far into the step the failure came (under TP the ranks may stop at
  different points of the step, see below);
- free the step's orphans: allocated slots that no live request counts and the prefix cache does not hold
  (the only two owners of a slot between steps; the sweep is O(pool), paid only after a failure);
- drop the batch's pending outputs (their clients get an error instead).

Requests outside the batch are untouched and keep being served. A failure in ``schedule`` itself (no batch
recorded: it, or the grammar queue's poll before it, raised) fails every request the scheduler holds.

Under tensor parallelism the ranks agree on each step's success before it commits
(ddtree_serve/server/tp/step_agreement.py): a vote after ``Scheduler.run`` (before ``process`` commits
tokens) and a gate before each target forward. A step that failed on any rank, before a gate or after the
step's last collective, raises ``TPStepFailed`` on every rank and every rank runs this same ``fail_step``
(after a one-rank failure also dropping the prefix cache's unlocked entries: ``fail_agreed_step``), which
leaves the same state everywhere: the ranks stopped at the same gate, or all ran the step's collectives
(the same ``tree_len``s and queues), and what they did past that point is undone alike (the rollback to
``tree_len`` above, the orphan sweep, the queues rebuilt from the batch). A fault on some ranks between
collectives (inside a forward) cannot be agreed: the failed rank's vote is not matched within seconds and
it ends the TP world (``TPRankError``). A failure after the vote (in ``process``) is caught as before:
``failure_fingerprint`` names where a step failed; rank 0 sends its fingerprint of the previous step with
the next step's inputs and a follower whose own outcome differs stops with a clear log
(ddtree_serve/server/tp/protocol.py), which ends the server. Fatal (``is_fatal``): a broken collective (a
dead or late rank, ``CollectiveError``/``TPRankError``) and a sticky device error.
"""

from __future__ import annotations

import traceback
from typing import Any

import torch

from ddtree_serve.model_executor.parallel_state import CollectiveError

# Errors after which the process cannot go on: a sticky device error (CUDA's illegal address, a device-side
# assert) fails every later kernel; a failed collective leaves the TP world unusable.
FATAL_STEP_ERRORS: tuple[type[BaseException], ...] = (torch.AcceleratorError, CollectiveError)


def is_fatal(error: BaseException) -> bool:
    """Whether a step failure ends the process (and the server) instead of failing the step's requests."""
    from ddtree_serve.server.tp.errors import TPRankError

    return isinstance(error, (*FATAL_STEP_ERRORS, TPRankError)) or not isinstance(error, Exception)


def failure_fingerprint(error: BaseException) -> str:
    """Where a step failed, equal on every rank for the same fault: the exception type, the innermost frame
    and a digest of the frames below the catching one (not the message: it may name rank-local sizes)."""
    from ddtree_serve.model_executor.parallel_state import stable_hash

    frames = traceback.extract_tb(error.__traceback__)[1:]  # [0]: the frame that caught it (differs per rank)
    where = f"{frames[-1].filename.rsplit('/', 1)[-1]}:{frames[-1].lineno}" if frames else "?"
    digest = stable_hash([(f.name, f.lineno) for f in frames]) & 0xFFFFFFFF
    return f"{type(error).__name__} at {where} [{digest:08x}]"


def fail_step(scheduler: Any) -> list[str]:
    """Fail the requests of the step that just raised; return their ids. Leaves the scheduler consistent:
    every KV slot is either free, held by a live request, or held by the prefix cache."""
    batch = scheduler.step_batch
    if batch is not None:
        victims = list(batch.reqs)
    else:
        victims = list(scheduler.waiting) + list(scheduler.running)
    failed = list({id(q): q for q in victims if q.finish_reason is None}.values())  # finished: released
    ids = {id(q) for q in failed}
    keep = [q for q in scheduler.waiting if id(q) not in ids]  # by identity, in place
    scheduler.waiting.clear()
    scheduler.waiting.extend(keep)
    scheduler.running[:] = [q for q in scheduler.running if id(q) not in ids]
    for req in failed:  # cache only what the tree holds already: the same on every TP rank
        req.num_cached = req.tree_len
    if scheduler.spec is not None:  # forwards and drafts launched ahead: their slots freed now, not as orphans
        scheduler.spec.drop_ahead()
    if scheduler.decode_ahead is not None:
        scheduler.decode_ahead.release(scheduler.runner.slots)
        scheduler.decode_ahead = None
    held = _held_slots(scheduler, failed)
    for req in failed:
        req.finish_reason = "error"
        scheduler._release(req)
    slots = scheduler.runner.slots
    orphans = slots.allocated()  # [n] after the releases above: what nobody owns is the step's
    if held.numel():
        orphans = orphans[~torch.isin(orphans, held.to(orphans.device))]
    slots.free(orphans)
    rids = {req.rid for req in failed}
    scheduler.outbox[:] = [o for o in scheduler.outbox if o.rid not in rids]
    scheduler.step_batch = None
    return [req.rid for req in failed]


def _held_slots(scheduler: Any, failed: list) -> torch.Tensor:
    """Slots that live requests count in ``num_cached`` (the failed ones included: ``_release`` frees
    theirs itself, or hands them to the prefix cache) and slots the prefix cache holds (a request that
    finished during the step inserted its tokens), so the orphan sweep leaves them to their owners. [n]"""
    table = scheduler.runner.slots.table
    live = list(scheduler.waiting) + list(scheduler.running) + failed
    rows = [table[q.req_pool_idx, :q.num_cached] for q in live if q.req_pool_idx is not None and q.num_cached]
    tree = scheduler.kv.tree
    if tree is not None:
        rows.append(tree.held_slots().to(table.device))
    return torch.cat(rows) if rows else torch.empty(0, dtype=torch.int64, device=table.device)


def orphaned_rids(scheduler: Any, inflight: set[str]) -> list[str]:
    """Requests the loop believes in flight that the scheduler no longer holds and will never report
    (no finished output pending): after ``fail_step`` this is empty unless ``schedule`` itself failed."""
    known = {q.rid for q in scheduler.waiting} | {q.rid for q in scheduler.running}
    reported = {o.rid for o in scheduler.outbox if o.finished}
    return [rid for rid in inflight if rid not in known and rid not in reported]
