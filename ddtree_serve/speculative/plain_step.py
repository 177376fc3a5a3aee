"""A speculative step whose trees are all the root alone (docs/DESIGN.md 4.4, 4.14): the scheduler's plain decode
step, its forward also capturing the target layers the drafter's context needs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ddtree_serve.model_executor.sampler import sample_requests
from ddtree_serve.speculative.types import DecodeResult, SpecRequest


def plain_step(worker: Any, reqs: Sequence[SpecRequest], rows: list[int], root_pos: list[int], root_ids: list[int],
               sampled: np.ndarray, draft_s: float | None) -> list[DecodeResult]:
    """``worker``'s (a ``SpecWorker``) step whose trees are all the root alone, at the cost of the scheduler's plain decode step: one causal
    decode forward over the roots (their KV kept) that also captures the target layers the drafter's context
    needs, so speculation can resume at any later step; then the plain sampler (``sampler.sample``) and
    logprobs: greedy tokens are plain decoding's, sampled ones drawn exactly as plain decoding draws them."""
    r, bs = worker.runner, len(reqs)
    start = worker.timer.now()
    fb = r.prepare_decode(rows, root_pos, root_ids, worker.capture_layer_ids, [q.params for q in reqs])  # roots
    assert fb is not None, "decode() checked free slots for the whole step"
    out = r.forward(fb)
    worker._window("plain")
    if worker.deferred is not None:  # written before the drafter next reads its cache (deferred_context.py)
        worker.deferred.add(out.captured, fb.positions, fb.out_cache_loc)
    else:
        worker._write_context(out.captured, fb.positions, fb.out_cache_loc)
    tokens, lps = sample_requests(reqs, *r.step_logits(out.hidden))  # [bs], as the scheduler's plain decode
    results = []
    for q, tok, lp in zip(reqs, tokens.tolist(), lps, strict=True):
        q.num_cached += 1  # a running request has a token left: ``tok`` is always kept
        results.append(DecodeResult([tok], 0, lp))
    worker.timer.lap("plain")
    worker.timer.steps += 1
    if worker.controller is not None:
        zeros = np.zeros(bs, dtype=np.int64)
        worker.controller.record(zeros, None, zeros, sampled, bs, bs, draft_s, worker.timer.now() - start)
    return results
