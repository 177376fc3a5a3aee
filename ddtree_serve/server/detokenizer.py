"""Incremental detokenization (streaming-safe) and stop strings; the detokenizer process.

Text is decoded over a sliding window: ``ids[surr:read]`` was already shown, ``ids[surr:]`` is decoded
again and the difference is the new text, so a token whose spelling depends on its neighbour (a leading
space, a merge) comes out right. While the new text ends in U+FFFD (an incomplete UTF-8 sequence split over
tokens) nothing is shown until the next token completes it. Text that could be the start of a stop string
is held back until it either matches (the request ends there, the stop string itself is not shown) or
cannot match any more.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

from ddtree_serve.server.io_struct import (
    BatchTextOut,
    BatchTokenOut,
    DetokenizeReq,
    IpcEndpoints,
    ProcessFailed,
    RequestError,
    SchedulerReady,
    TextOut,
    TokenOut,
)
from ddtree_serve.server.parsers._text import partial_suffix_len

logger = logging.getLogger(__name__)


@dataclass
class DecodeState:
    spec: DetokenizeReq
    ids: list[int] = field(default_factory=list)
    surr: int = 0  # start of the context window
    read: int = 0  # tokens before this are shown
    held: str = ""  # decoded text not shown yet (possible stop-string prefix)
    completion_tokens: int = 0


class IncrementalDetokenizer:
    """Per-request decode state over one tokenizer. Not thread-safe; one per detokenizer process."""

    def __init__(self, tokenizer: Any, eos_token_ids: tuple[int, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = tuple(eos_token_ids)
        self.states: dict[str, DecodeState] = {}

    def add(self, spec: DetokenizeReq) -> None:
        self.states[spec.rid] = DecodeState(spec)

    def drop(self, rid: str) -> None:
        self.states.pop(rid, None)

    def _decode(self, ids: list[int], skip: bool) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)

    def process(self, out: TokenOut) -> TextOut | None:
        """Turn one TokenOut into a TextOut; None when the request is unknown (already finished here)."""
        st = self.states.get(out.rid)
        if st is None:
            return None
        if out.error is not None:
            self.drop(out.rid)
            return TextOut(out.rid, "", [], finished=True, finish_reason=None, error=out.error, error_status=400,
                           prompt_tokens=out.prompt_tokens, error_param=out.error_param)
        spec = st.spec
        new_ids = list(out.token_ids)
        matched: str | int | None = None
        visible = new_ids
        trim = set(self.eos_token_ids) | set(spec.stop_token_ids)
        if out.finished and out.finish_reason == "stop" and visible and visible[-1] in trim:
            matched = visible[-1]
            visible = visible[:-1]
        st.ids.extend(visible)
        st.completion_tokens = out.completion_tokens or (st.completion_tokens + len(new_ids))
        surr_text = self._decode(st.ids[st.surr:st.read], spec.skip_special_tokens)
        full_text = self._decode(st.ids[st.surr:], spec.skip_special_tokens)
        new_text = full_text[len(surr_text):]
        if new_text.endswith("\ufffd") and not out.finished:
            new_text = ""  # wait for the rest of the character
        else:
            st.surr, st.read = st.read, len(st.ids)
        text = st.held + new_text
        st.held = ""
        finished, reason, abort = out.finished, out.finish_reason, False
        if spec.stop:
            cut, which = _find_stop(text, spec.stop)
            if which is not None:
                text = text[:cut]
                matched, reason, abort = which, "stop", not out.finished
                finished = True
            elif not finished:
                hold = partial_suffix_len(text, spec.stop)
                if hold:
                    text, st.held = text[:-hold], text[-hold:]
        logprobs = self._logprobs(out) if spec.logprobs and out.logprobs else None
        if finished:
            self.drop(out.rid)
        return TextOut(
            rid=out.rid, text=text, token_ids=new_ids, finished=finished, finish_reason=reason,
            matched_stop=matched, prompt_tokens=out.prompt_tokens, completion_tokens=st.completion_tokens,
            cached_tokens=out.cached_tokens,
            spec_verify_steps=out.spec_verify_steps, spec_plain_steps=out.spec_plain_steps,
            spec_accepted_tokens=out.spec_accepted_tokens,
            spec_accepted_suffix=out.spec_accepted_suffix,
            spec_budget_sum=out.spec_budget_sum,
            logprobs=logprobs, abort_scheduler=abort,
            prompt_logprobs=self._prompt_logprobs(out.prompt_logprobs) if out.prompt_logprobs else None,
        )

    def _logprobs(self, out: TokenOut) -> list[tuple[str, float, list[tuple[str, float]]]]:
        res = []
        for tok, (lp, top) in zip(out.token_ids, out.logprobs or [], strict=False):
            res.append((self._decode([tok], False), float(lp),
                        [(self._decode([t], False), float(v)) for t, v in top]))
        return res


    def _prompt_logprobs(self, entries: list) -> list[tuple[str, float | None, list[tuple[str, float]] | None]]:
        """Prompt token ids -> their text, each token decoded alone (as the generated tokens' logprobs)."""
        res = []
        for tok, lp, top in entries:
            alts = None if top is None else [(self._decode([t], False), float(v)) for t, v in top]
            res.append((self._decode([tok], False), None if lp is None else float(lp), alts))
        return res


def _find_stop(text: str, stops: tuple[str, ...]) -> tuple[int, str | None]:
    best, which = -1, None
    for s in stops:
        i = text.find(s)
        if i != -1 and (best == -1 or i < best):
            best, which = i, s
    return best, which


def run_detokenizer_process(model_path: str, trust_remote_code: bool, endpoints: IpcEndpoints,
                            parent_pid: int) -> None:
    """Entry point of the detokenizer process: scheduler outputs in, text out to the tokenizer manager."""
    import zmq

    from ddtree_serve.server.process_utils import ChildGuard, load_tokenizer

    guard = ChildGuard("detokenizer", parent_pid)
    ctx = zmq.Context()
    recv = ctx.socket(zmq.PULL)
    recv.bind(endpoints.detokenizer_input)
    send = ctx.socket(zmq.PUSH)
    send.connect(endpoints.tokenizer_input)
    try:
        detok = IncrementalDetokenizer(load_tokenizer(model_path, trust_remote_code))
    except Exception as e:  # noqa: BLE001
        send.send_pyobj(ProcessFailed("detokenizer", f"cannot load the tokenizer: {e}"))
        os._exit(1)
    while not guard.should_stop():
        if not recv.poll(200):
            continue
        msg = recv.recv_pyobj()
        if isinstance(msg, BatchTokenOut):
            outs = []
            for o in msg.outputs:
                try:
                    t = detok.process(o)
                except Exception as e:  # noqa: BLE001 - one bad request never stops the process
                    logger.exception("detokenizing %s failed", o.rid)
                    detok.drop(o.rid)
                    t = TextOut(o.rid, "", [], finished=True, error=f"detokenization failed: {e}", error_status=500,
                                abort_scheduler=not o.finished)
                if t is not None:
                    outs.append(t)
            if outs:
                send.send_pyobj(BatchTextOut(outs))
        elif isinstance(msg, DetokenizeReq):
            detok.add(msg)
        elif isinstance(msg, RequestError):
            detok.drop(msg.rid)
            send.send_pyobj(msg)
        else:
            if isinstance(msg, SchedulerReady):
                detok.eos_token_ids = tuple(msg.eos_token_ids)
            send.send_pyobj(msg)  # stats, ready, failures: for the tokenizer manager
    recv.close(0)
    send.close(0)
    ctx.term()
