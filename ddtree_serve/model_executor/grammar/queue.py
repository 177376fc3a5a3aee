"""The scheduler's grammar queue: constrained requests wait here while their grammar compiles.

A request with ``SamplingParams.grammar`` enters through ``submit`` (its compilation starts on the
backend's worker thread) and leaves through ``poll`` once the future is done: with a fresh
``GrammarState`` behind the request's reasoning gate (``SamplingParams.reasoning_end_ids`` /
``reasoning_handoff_ids``; then it joins the scheduler's waiting queue) or with the compile error (then it
finishes with that error, an HTTP 400). The backend is created with the first constrained request.

Under tensor parallelism every rank must make the same scheduling decision in the same step, and compile
times differ per rank, so ``blocking`` polls wait for every pending compilation (milliseconds; ranks then
agree). Single-rank schedulers never wait, except briefly when nothing else can run.
"""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Callable
from typing import Any

from ddtree_serve.model_executor.grammar.backend import GrammarBackend
from ddtree_serve.model_executor.grammar.state import GrammarState, ReasoningGate

IDLE_WAIT_S = 0.02  # poll timeout when the scheduler has nothing else to run


class GrammarQueue:
    def __init__(self, make_backend: Callable[[], GrammarBackend], blocking: bool = False) -> None:
        self._make_backend = make_backend
        self.backend: GrammarBackend | None = None
        self.blocking = blocking
        self.pending: list[Any] = []  # ddtree_serve.server.scheduling.request.Req with grammar_future set

    def __len__(self) -> int:
        return len(self.pending)

    def submit(self, req: Any) -> None:
        if self.backend is None:
            self.backend = self._make_backend()
        kind, text = req.params.grammar
        req.grammar_future = self.backend.submit(kind, text)
        self.pending.append(req)

    def remove(self, rid: str) -> list[Any]:
        """Take the pending requests with id ``rid`` out (an abort)."""
        out = [r for r in self.pending if r.rid == rid]
        self.pending = [r for r in self.pending if r.rid != rid]
        return out

    def poll(self, idle: bool) -> list[tuple[Any, str | None]]:
        """Requests whose compilation finished, in arrival order, each with None (ready: ``req.grammar`` is
        set) or the error message. ``idle``: the scheduler has nothing else to run (waits a little)."""
        if not self.pending:
            return []
        futs = [r.grammar_future for r in self.pending]
        if self.blocking:
            cf.wait(futs)
        elif idle:
            cf.wait(futs, timeout=IDLE_WAIT_S, return_when=cf.FIRST_COMPLETED)
        done, still = [], []
        for r in self.pending:
            (done if r.grammar_future.done() else still).append(r)
        self.pending = still
        out = []
        for r in done:
            fut, r.grammar_future = r.grammar_future, None
            err = fut.exception()
            if err is None:
                b = self.backend
                p = r.params
                gate = ReasoningGate(tuple(p.reasoning_end_ids), tuple(p.reasoning_handoff_ids))
                r.grammar = GrammarState(fut.result(), b.stop_token_ids, b.vocab_size, gate)
                out.append((r, None))
            else:
                out.append((r, str(err) if isinstance(err, ValueError) else f"grammar compilation failed: {err!r}"))
        return out

    def shutdown(self) -> None:
        if self.backend is not None:
            self.backend.shutdown()
