"""Start-up warm-up: run every forward path serving will use before the server reports ready.

Kernels that compile at first use (Triton MLA/MoE, flashinfer's JIT modules, the sampling filters) and CUDA
graphs captured at first use would otherwise make the first requests pay for them, on every rank. The
auto budget's start-up probe runs its paths already (speculative/cost_probe.py), but a fixed budget or no
speculation did not. ``warm_up`` runs two short requests (one greedy, one sampled, fixed seeds) through the
real scheduler: a prefill, then decode steps, which are speculative steps (drafter forward, tree build,
verify forward, greedy and sampled verification, commit) whenever speculation is on, at the full budget
(the auto controller is set aside meanwhile, so its measurements and decisions are untouched). Then it
removes every trace: the requests are aborted (their output never joins the suffix index), the prefix
cache they filled is evicted and the statistics are reset. Every TP rank runs it identically (the same
collectives in the same order), before ``end_startup``. The paths that ran and the time are logged.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from model_executor.sampling_params import SamplingParams
from server.io_struct import GenerateReq

logger = logging.getLogger(__name__)

WARMUP_STEPS = 4  # scheduler steps: the prefill of both requests, then decode (or speculative) steps
WARMUP_MAX_TOKENS = 64  # never reached in WARMUP_STEPS: the requests never finish on their own


@dataclass(frozen=True)
class WarmupReport:
    paths: tuple[str, ...]  # forward modes and sub-steps that ran, in first-seen order
    seconds: float


def warm_up(scheduler) -> WarmupReport:  # noqa: ANN001 - a server.scheduling.scheduler.Scheduler
    """Run the warm-up requests through ``scheduler`` (module docstring) and return what ran."""
    t0 = time.perf_counter()
    seen: list[str] = []
    runner, spec = scheduler.runner, scheduler.spec
    undo = [_record(runner, "forward", lambda fb: f"target:{fb.mode.value}", seen)]
    if spec is not None and spec.drafter is not None:
        undo.append(_record(spec.drafter, "forward", lambda fb: "drafter", seen))
    controller = spec.controller if spec is not None else None
    if spec is not None:
        spec.controller = None  # the full budget, and nothing recorded into the auto controller
    vocab, room = scheduler.model_config.vocab_size, scheduler.max_request_tokens
    prompt = [(7 * i + 1) % vocab for i in range(max(1, min(8, room // 4)))]
    n = min(WARMUP_MAX_TOKENS, room - len(prompt))
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, seed=1),
              SamplingParams(temperature=1.0, top_p=0.9, max_tokens=n, ignore_eos=True, seed=2)]
    rids = [f"warmup-{i}" for i in range(len(params))]
    try:
        for rid, p in zip(rids, params, strict=True):
            try:
                scheduler.add_request(GenerateReq(rid, prompt, p))
            except ValueError as e:  # a KV pool or context too small for it: what fits still warms up
                logger.warning("warm-up request %s skipped: %s", rid, e)
        for _ in range(WARMUP_STEPS):
            if scheduler.has_work():
                scheduler.step()
        for rid in rids:  # aborted, not finished: the output never reaches the suffix index
            scheduler.abort_request(rid)
        scheduler.step()
    finally:
        for f in undo:
            f()
        if spec is not None:
            spec.controller = controller
    _forget(scheduler)
    report = WarmupReport(tuple(dict.fromkeys(seen)), time.perf_counter() - t0)
    logger.info("warm-up ran %s in %.1f s", ", ".join(report.paths), report.seconds)
    return report


def _record(obj, name: str, label, seen: list[str]):  # noqa: ANN001, ANN202
    inner = getattr(obj, name)

    def call(fb, *args, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        seen.append(label(fb))
        return inner(fb, *args, **kw)

    setattr(obj, name, call)
    return lambda: delattr(obj, name)  # back to the class's method


def _forget(scheduler) -> None:  # noqa: ANN001
    """Evict what the warm-up cached and reset the statistics it moved."""
    kv = scheduler.kv
    if kv.tree is not None:
        kv.tree.evict(kv.tree.evictable_size)
    kv.hit_tokens = kv.query_tokens = 0
    scheduler.total_verify_steps = scheduler.total_spec_tokens = 0
    if scheduler.spec is not None:  # the per-phase step timings (benchmarks, tests) start empty
        scheduler.spec.timer.totals.clear()
        scheduler.spec.timer.steps = 0
    scheduler.outbox.clear()
