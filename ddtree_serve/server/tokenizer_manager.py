"""Tokenizer manager (HTTP process): tokenization and chat templates, request state, per-request queues.

Requests go to the scheduler process over ZMQ; text comes back from the detokenizer and is routed to the
asyncio queue of its request group (the ``n`` choices of one HTTP request share a queue). A consumer that
stops listening (client disconnect, cancellation) aborts what is still running, which frees its KV.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.asyncio

from ddtree_serve.server.config import ServerConfig
from ddtree_serve.server.http.metrics import ServerMetrics
from ddtree_serve.server.http.tool_prompt import template_reads_tools
from ddtree_serve.server.io_struct import (
    AbortReq,
    BatchTextOut,
    DetokenizeReq,
    GenerateReq,
    IpcEndpoints,
    ProcessFailed,
    RequestError,
    SchedulerReady,
    SchedulerStats,
    TextOut,
    TokenizedGenerateReq,
)
from ddtree_serve.server.multimodal.frontend import ImageLimits, VisionFrontend
from ddtree_serve.server.multimodal.media_fetch import AllowList, FetchLimits, MediaFetcher
from ddtree_serve.server.multimodal.video import VideoLimits
from ddtree_serve.server.sampling_defaults import describe, sampling_defaults

logger = logging.getLogger(__name__)

CONTEXT_EXCEEDED = "context_length_exceeded"  # OpenAI's code of a prompt (+ max_tokens) over the limit


class InputError(ValueError):
    """A request the server cannot accept (HTTP 400); ``code``: OpenAI's error code where it has one
    (``context_length_exceeded``). The handler names the field (``param``) the input came from."""

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class ReqState:
    rid: str
    index: int
    queue: asyncio.Queue
    prompt_tokens: int
    created: float
    first_time: float | None = None
    last_time: float = 0.0


class TokenizerManager:
    def __init__(self, config: ServerConfig, endpoints: IpcEndpoints, tokenizer: Any,
                 metrics: ServerMetrics) -> None:
        self.config = config
        self.endpoints = endpoints
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.ready = False
        self.dead: str | None = None
        # a request's missing sampling fields (--sampling-defaults; ddtree_serve/server/sampling_defaults.py)
        self.sampling_defaults = sampling_defaults(config.server.sampling_defaults, config.model.model_path)
        logger.info("%s", describe(config.server.sampling_defaults, self.sampling_defaults))
        # a template that renders no tools gets them in the system turn (ddtree_serve/server/http/tool_prompt.py)
        parser = config.server.tool_call_parser
        self.tools_in_system = parser is not None and not template_reads_tools(getattr(tokenizer, "chat_template",
                                                                                        None))
        if self.tools_in_system:
            logger.info("the chat template renders no tools: a request's tools are written into the system turn "
                        "in the %s format", parser)
        self.draining = False  # shutting down (SIGTERM): new requests 503, in-flight ones run on (server/drain.py)
        self.max_context_len = config.model.context_length or 0
        self.vocab_size = 0  # the model's, from SchedulerReady (0: not known yet)
        self.eos_token_ids: tuple[int, ...] = ()
        self.last_stats = SchedulerStats()
        self.vision: VisionFrontend | None = None  # image inputs, for a model with a vision tower (at ready)
        self.states: dict[str, ReqState] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._sync_ctx: zmq.Context | None = None
        self._async_ctx: zmq.asyncio.Context | None = None
        self._send: zmq.Socket | None = None
        self._recv: zmq.asyncio.Socket | None = None

    # ---- lifecycle -----------------------------------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._sync_ctx = zmq.Context()
        self._send = self._sync_ctx.socket(zmq.PUSH)
        self._send.connect(self.endpoints.scheduler_input)
        self._async_ctx = zmq.asyncio.Context()
        self._recv = self._async_ctx.socket(zmq.PULL)
        self._recv.bind(self.endpoints.tokenizer_input)
        self._task = asyncio.create_task(self._recv_loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001
                pass
        for sock in (self._send, self._recv):
            if sock is not None:
                sock.close(0)
        for ctx in (self._sync_ctx, self._async_ctx):
            if ctx is not None:
                ctx.term()

    @property
    def serving(self) -> bool:
        """Loaded, every process alive, and not draining: new requests are admitted."""
        return self.ready and self.dead is None and not self.draining

    def mark_dead(self, message: str) -> None:
        """A child process died: fail everything in flight with 503 and refuse new work."""
        if self.dead is None:
            logger.error("server unhealthy: %s", message)
        self.dead = self.dead or message
        for st in list(self.states.values()):
            st.queue.put_nowait((st.index, TextOut(st.rid, "", [], finished=True, error=self.dead,
                                                    error_status=503)))
        self.states.clear()

    def mark_dead_threadsafe(self, message: str) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self.mark_dead, message)
        else:
            self.dead = self.dead or message

    # ---- tokenization --------------------------------------------------------------------------------
    def encode_chat(self, messages: list[dict], tools: list[dict] | None, template_kwargs: dict[str, Any] | None,
                    add_generation_prompt: bool = True, continue_final_message: bool = False,
                    splice: Callable[[str], str] | None = None) -> list[int]:
        """The prompt ids of a chat through the model's template (vLLM's two flags: the assistant header after
        the messages, or the reply continuing the last assistant message). ``splice``: applied to the rendered
        text before tokenization (a video placeholder replaced by its chunk prompts; InputError passes)."""
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise InputError("this model has no chat template; use /v1/completions")
        kwargs = dict(template_kwargs or {})
        try:
            text = self.tokenizer.apply_chat_template(messages, tools=tools or None,
                                                      add_generation_prompt=add_generation_prompt,
                                                      continue_final_message=continue_final_message,
                                                      tokenize=False, **kwargs)
        except Exception as e:  # noqa: BLE001 - template errors are input errors
            raise InputError(f"cannot apply the chat template: {e}") from e
        if splice is not None:
            text = splice(text)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def encode_text(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=True))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def check_length(self, prompt_len: int, max_tokens: int | None) -> None:
        """``max_tokens`` None: the prompt needs room for one token (the scheduler also checks the KV pool)."""
        ctx = self.max_context_len
        if prompt_len == 0:
            raise InputError("the prompt is empty")
        limit = self.config.server.max_prompt_tokens
        if limit is not None and prompt_len > limit:
            raise InputError(f"the prompt ({prompt_len} tokens) exceeds max_prompt_tokens ({limit} tokens)",
                             CONTEXT_EXCEEDED)
        if ctx and max_tokens is None and prompt_len >= ctx:
            raise InputError(f"the prompt ({prompt_len} tokens) leaves no room to generate within the context "
                             f"length ({ctx} tokens)", CONTEXT_EXCEEDED)
        if ctx and max_tokens is not None and prompt_len + max_tokens > ctx:
            raise InputError(f"the prompt ({prompt_len} tokens) plus max_tokens ({max_tokens}) exceeds the "
                             f"context length ({ctx} tokens)", CONTEXT_EXCEEDED)

    def queue_full(self, n: int) -> bool:
        """Would ``n`` more requests exceed max_running_requests + max_waiting_requests in flight?"""
        cap = self.config.scheduler.max_running_requests + self.config.server.max_waiting_requests
        return len(self.states) + n > cap

    def check_token_ids(self, ids: list[int]) -> None:
        vocab = len(self.tokenizer)
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise InputError(f"token ids out of range [0, {vocab}): {bad[:5]}")

    # ---- generation ----------------------------------------------------------------------------------
    async def generate(self, reqs: list[tuple[GenerateReq, DetokenizeReq]]) -> AsyncIterator[tuple[int, TextOut]]:
        """Submit a group of requests (the choices of one HTTP request); yield ``(choice index, TextOut)``
        until all have finished. Leaving early aborts the unfinished ones."""
        if not self.serving:
            raise RuntimeError(self.dead or "the server is not ready")
        queue: asyncio.Queue = asyncio.Queue()
        now = time.perf_counter()
        rids = []
        for i, (req, det) in enumerate(reqs):
            self.states[req.rid] = ReqState(req.rid, i, queue, len(req.input_ids), now)
            rids.append(req.rid)
            self._send.send_pyobj(TokenizedGenerateReq(req, det))
        self.metrics.set_inflight(len(self.states))
        remaining = set(rids)
        try:
            while remaining:
                idx, out = await queue.get()
                if out.finished:
                    remaining.discard(out.rid)
                yield idx, out
        finally:
            for rid in remaining:
                self.abort(rid)

    def abort(self, rid: str) -> None:
        """Stop a request: the scheduler frees it, and its consumer gets a final ``abort`` output."""
        st = self.states.pop(rid, None)
        if st is None:
            return
        st.queue.put_nowait((st.index, TextOut(rid, "", [], finished=True, finish_reason="abort",
                                               prompt_tokens=st.prompt_tokens)))
        self.metrics.observe_finished("abort", st.prompt_tokens, time.perf_counter() - st.created, 0, 0)
        self.metrics.set_inflight(len(self.states))
        if self._send is not None and self.dead is None:
            self._send.send_pyobj(AbortReq(rid))

    # ---- receiving -----------------------------------------------------------------------------------
    async def _recv_loop(self) -> None:
        while True:
            msg = await self._recv.recv_pyobj()
            try:
                self._handle(msg)
            except Exception:  # noqa: BLE001
                logger.exception("while handling %s", type(msg).__name__)

    def _handle(self, msg: object) -> None:
        if isinstance(msg, BatchTextOut):
            for out in msg.outputs:
                self._deliver(out)
        elif isinstance(msg, SchedulerStats):
            self.last_stats = msg
            self.metrics.update_scheduler(msg)
        elif isinstance(msg, RequestError):
            self._deliver(TextOut(msg.rid, "", [], finished=True, error=msg.message, error_status=msg.status))
        elif isinstance(msg, SchedulerReady):
            self.max_context_len = msg.max_context_len
            self.eos_token_ids = tuple(msg.eos_token_ids)
            self.vocab_size = msg.vocab_size
            self.vision = self._vision_of(msg.model_path)
            self.ready = True
            logger.info("scheduler ready: context %d tokens", msg.max_context_len)
        elif isinstance(msg, ProcessFailed):
            self.mark_dead(f"{msg.process} failed: {msg.message}")

    def _vision_of(self, model_dir: str) -> VisionFrontend | None:
        s = self.config.server
        limits = ImageLimits(s.max_images_per_request, s.max_image_bytes, s.max_image_pixels)
        if limits.max_images == 0:  # text only: the scheduler loaded no vision tower
            return None
        allow = AllowList.parse(s.allowed_media_domains)
        fetcher = None if allow.empty else MediaFetcher(allow, FetchLimits(s.media_fetch_timeout,
                                                                           s.max_media_redirects))
        video = VideoLimits(s.max_video_bytes, s.max_video_seconds, s.max_video_frames, s.max_image_pixels)
        try:
            vision = VisionFrontend.for_model(model_dir, self.tokenizer, limits, video, fetcher,
                                              s.max_videos_per_request)
        except Exception:  # noqa: BLE001 - the server serves text without it
            logger.exception("image inputs off: the vision frontend could not be set up")
            return None
        if vision is not None:
            logger.info("image inputs on: data: URLs%s, at most %d per request; video %s",
                        "" if fetcher is None else f" and http(s) URLs from {s.allowed_media_domains}",
                        limits.max_images, "off" if vision.video is None else
                        f"on, at most {vision.max_videos} per request")
        return vision

    def _deliver(self, out: TextOut) -> None:
        st = self.states.get(out.rid)
        if st is None:
            return
        now = time.perf_counter()
        n = len(out.token_ids)
        if n:
            self.metrics.observe_tokens(n, None if st.first_time is None else now - st.last_time)
            if st.first_time is None:
                st.first_time = now
                self.metrics.observe_first_token(now - st.created)
            st.last_time = now
        if not out.prompt_tokens:
            out.prompt_tokens = st.prompt_tokens
        if out.finished:
            del self.states[out.rid]
            self.metrics.set_inflight(len(self.states))
            self.metrics.observe_finished(out.finish_reason if out.error is None else "error", st.prompt_tokens,
                                          now - st.created, out.spec_verify_steps, out.spec_accepted_tokens,
                                          out.spec_accepted_suffix)
            if out.abort_scheduler and self._send is not None:
                self._send.send_pyobj(AbortReq(out.rid))
        st.queue.put_nowait((st.index, out))
