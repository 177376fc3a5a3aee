"""The offline engine: the public Python API over the same scheduler core the HTTP server runs.

    engine = Engine(model_path="default", dtype="auto")
    outs = engine.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))
    outs[0].text, outs[0].token_ids, outs[0].finish_reason
    for delta in engine.generate_stream(["Hello"], params): ...
    scored = engine.generate(["The sky is blue"], SamplingParams(max_tokens=0, prompt_logprobs=1))
    scored[0].prompt_logprobs  # [(token_id, logprob | None, [(alt_id, logprob)] | None) per prompt token]
    engine.shutdown()

A scheduler step that raises (not fatally: ddtree_serve/server/scheduling/step_recovery.py) fails only that step's requests, on one
process and under TP: ``generate`` / ``generate_stream`` raise ``RuntimeError`` for a call whose request
failed (its other requests are aborted, their KV freed) and the engine serves the next call. A fatal error
(a dead TP rank, diverged ranks, a sticky device error) propagates; call ``shutdown``.

``SamplingParams(max_tokens=None)`` generates until the request limit (the context length, or what the KV
pool can hold for one request if that is smaller) and ends with ``length`` there.

Keyword arguments mirror the CLI flags (``ServerConfig.from_flat`` names); a ``speculative_`` field may
also go by its bare name (``draft_model_path``, ``ddtree_budget``: an int, or "auto", the default,
``ddtree_max_budget``, ``block_size``, ...).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field

from ddtree_serve.model_executor.sampling_params import SamplingParams
from ddtree_serve.server.config import ServerConfig
from ddtree_serve.server.detokenizer import IncrementalDetokenizer
from ddtree_serve.server.io_struct import DetokenizeReq, GenerateReq, TokenOut
from ddtree_serve.server.scheduling.scheduler_factory import SchedulerLike, make_scheduler
from ddtree_serve.server.startup import resolve_config

__all__ = ["Engine", "SamplingParams", "RequestOutput", "StreamDelta"]

logger = logging.getLogger(__name__)

@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    spec_verify_steps: int = 0  # decode steps that verified a draft tree
    spec_plain_steps: int = 0  # decode steps without a draft tree (plain decode)
    spec_accepted_tokens: int = 0
    spec_accepted_suffix: int = 0  # of spec_accepted_tokens, proposed by the suffix draft source
    spec_budget_sum: int = 0
    logprobs: list | None = None
    prompt_logprobs: list | None = None  # with SamplingParams.prompt_logprobs: [(token_id, logprob, top)]
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache

    @property
    def acceptance_length(self) -> float:
        """Mean tokens emitted per verify step, tau = (accepted drafts + bonus tokens) / verify steps (the same
        definition as the API's ``spec_stats.acceptance_length``; plain decode steps do not count); 0 when no
        step verified a draft tree."""
        steps = self.spec_verify_steps
        return (self.spec_accepted_tokens + steps) / steps if steps else 0.0

    @property
    def mean_budget(self) -> float:
        """Draft tree nodes offered per verify step (``spec_stats.mean_budget``); 0 when no step verified a tree."""
        return self.spec_budget_sum / self.spec_verify_steps if self.spec_verify_steps else 0.0


@dataclass
class StreamDelta:
    index: int  # position of the request in the generate call
    token_ids: list[int]
    text: str  # newly decoded text
    finished: bool
    finish_reason: str | None


class Engine:
    def __init__(self, model_path: str = "default", **kwargs):
        # paths and device resolved once, before any weights load (ddtree_serve/server/startup.py)
        self.config = resolve_config(ServerConfig.from_flat({**kwargs, "model_path": model_path}, short_names=True))
        self.scheduler: SchedulerLike = make_scheduler(self.config)  # TP rank 0 + spawned followers if tp_size > 1
        self.tokenizer = _load_tokenizer(self.config.model.model_path, self.config.model.trust_remote_code)
        self._ids = itertools.count()
        self._inbox: dict[str, list[TokenOut]] = {}  # outputs awaiting their consumer

    def _submit(self, prompts, input_ids, sampling_params) -> list[GenerateReq]:
        if (prompts is None) == (input_ids is None):
            raise ValueError("pass exactly one of prompts or input_ids")
        if prompts is not None:
            if self.tokenizer is None:
                raise ValueError("this model directory has no tokenizer: pass input_ids instead of prompts")
            if isinstance(prompts, str):
                prompts = [prompts]
            for p in prompts:
                if not isinstance(p, str) or not p:
                    raise ValueError("prompt must be a non-empty string")
            input_ids = [self.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        params = sampling_params if sampling_params is not None else SamplingParams()
        plist = params if isinstance(params, list) else [params] * len(input_ids)
        if len(plist) != len(input_ids):
            raise ValueError("sampling_params list must match the number of prompts")
        reqs = [GenerateReq(f"engine-{next(self._ids)}", list(ids), p) for ids, p in zip(input_ids, plist, strict=True)]
        accepted = []
        try:
            for r in reqs:
                self.scheduler.add_request(r)
                accepted.append(r)
        except ValueError:
            if accepted:
                self._abort({r.rid for r in accepted})
            raise
        return reqs

    def generate(self, prompts: list[str] | str | None = None, sampling_params: SamplingParams | list | None = None,
                 input_ids: list[list[int]] | None = None) -> list[RequestOutput]:
        outs = {}
        reqs = self._submit(prompts, input_ids, sampling_params)
        for r in reqs:
            outs[r.rid] = RequestOutput(r.rid, r.input_ids)
        pending = set(outs)
        try:
            while pending:
                for d in self._outputs(pending):
                    if d.finished:
                        pending.discard(d.rid)
                    _apply(outs[d.rid], d)
        finally:
            if pending:  # a request of this call failed: end the others too
                self._abort(pending)
        for o in outs.values():
            o.text = self._decode(o.token_ids)
        return [outs[r.rid] for r in reqs]

    def generate_stream(self, prompts: list[str] | str | None = None,
                        sampling_params: SamplingParams | list | None = None,
                        input_ids: list[list[int]] | None = None) -> Iterator[StreamDelta]:
        """Yield per-request deltas as the scheduler produces them. Text comes from the server's incremental
        detokenizer (a sliding window over the output; multi-byte characters are never split), so the
        deltas concatenate to ``generate``'s text at the cost of a few tokens per delta."""
        reqs = self._submit(prompts, input_ids, sampling_params)
        index = {r.rid: i for i, r in enumerate(reqs)}
        detok = IncrementalDetokenizer(self.tokenizer) if self.tokenizer is not None else None
        for r in reqs if detok is not None else ():
            detok.add(DetokenizeReq(r.rid))
        pending = set(index)
        try:
            while pending:
                for d in self._outputs(pending):
                    if d.finished:
                        pending.discard(d.rid)
                    if d.error:
                        raise RuntimeError(d.error)
                    text_out = detok.process(d) if detok is not None else None
                    new = text_out.text if text_out is not None else ""
                    yield StreamDelta(index[d.rid], d.token_ids, new, d.finished, d.finish_reason)
        finally:
            if pending:  # the consumer stopped early, or a request failed: abort and free KV
                self._abort(pending)

    def _abort(self, rids: set[str]) -> None:
        """Abort ``rids`` and drop their outputs (outputs of other consumers' requests are kept). Nothing to
        do in a broken TP world (the error that broke it was raised already; every later call raises)."""
        from ddtree_serve.server.tp.errors import TPRankError

        for rid in rids:
            self.scheduler.abort_request(rid)
            self._inbox.pop(rid, None)
        try:
            outs = self._step()
        except TPRankError:
            return
        for d in outs:
            if d.rid not in rids:
                self._inbox.setdefault(d.rid, []).append(d)

    def _outputs(self, rids: set[str]) -> list[TokenOut]:
        """This consumer's outputs: buffered ones first, else one scheduler step. Outputs of requests that
        belong to another consumer (an open stream while ``generate`` runs) are kept for it."""
        mine = [d for rid in rids for d in self._inbox.pop(rid, [])]
        if mine:
            return mine
        if not self.scheduler.has_work():
            raise RuntimeError(f"requests {sorted(rids)} are unknown to the scheduler")
        for d in self._step(rids):
            if d.rid in rids:
                mine.append(d)
            else:
                self._inbox.setdefault(d.rid, []).append(d)
        return mine

    def _step(self, inflight: set[str] = frozenset()) -> list[TokenOut]:
        """One scheduler step. A step that raises (not fatally) fails its requests: each gets a finished
        output with ``error``, as a server's client gets an HTTP 500 (ddtree_serve/server/scheduling/step_recovery.py)."""
        from ddtree_serve.server.scheduling.step_recovery import is_fatal, orphaned_rids

        try:
            return self.scheduler.step()
        except Exception as e:
            if is_fatal(e):
                raise
            logger.exception("scheduler step failed")
            failed = self.scheduler.fail_step()
            failed += [rid for rid in orphaned_rids(self.scheduler, set(inflight)) if rid not in failed]
            message = f"internal error: the scheduler step running this request failed ({type(e).__name__}: {e})"
            return [TokenOut(rid, [], finished=True, finish_reason="error", error=message) for rid in failed]

    def _decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def abort(self, request_id: str) -> None:
        self.scheduler.abort_request(request_id)

    def stats(self):
        return self.scheduler.stats()

    def shutdown(self) -> None:
        """Abort what is left and release the scheduler (TP: stop the followers); after a TP failure (the
        world broken, already raised and logged) only the release."""
        try:
            self._abort({r.rid for r in list(self.scheduler.running) + list(self.scheduler.waiting)})
        finally:
            self.scheduler.close()  # TP: stops the follower ranks


def _load_tokenizer(path: str, trust_remote_code: bool):
    """The model's tokenizer, or None for a directory without tokenizer files (token-id use only)."""
    from pathlib import Path

    from ddtree_serve.server.process_utils import load_tokenizer

    if not any((Path(path) / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    return load_tokenizer(path, trust_remote_code)


def _apply(out: RequestOutput, d: TokenOut) -> None:
    out.token_ids.extend(d.token_ids)
    out.spec_verify_steps, out.spec_accepted_tokens = d.spec_verify_steps, d.spec_accepted_tokens
    out.spec_budget_sum, out.spec_accepted_suffix = d.spec_budget_sum, d.spec_accepted_suffix
    out.spec_plain_steps = d.spec_plain_steps
    out.cached_tokens = d.cached_tokens
    if d.logprobs is not None:
        out.logprobs = (out.logprobs or []) + d.logprobs
    if d.prompt_logprobs is not None:
        out.prompt_logprobs = d.prompt_logprobs
    if d.finished:
        out.finish_reason = d.finish_reason
        if d.error:
            raise RuntimeError(d.error)
