"""POST /v1/responses (OpenAI Responses, stateless), translated to and from an internal chat-completions
request (ddtree_serve/server/http/chat_bridge.py): same template, prompt tokens, parsers, grammar path and sampling as
/v1/chat/completions.

Request mapping: ``instructions`` -> a system message first; a string ``input`` -> one user message; message
items -> messages of their role; consecutive ``function_call`` items -> one assistant message's ``tool_calls``
(joined to the assistant message just before them); ``function_call_output`` -> a ``tool`` message;
``reasoning`` items -> the next assistant message's ``reasoning_content``; ``max_output_tokens`` ->
``max_tokens``; ``text.format`` -> ``response_format`` (json_schema through the grammar path). Output: a
``reasoning`` item (when the reasoning parser split some off), a ``message`` item with ``output_text``, and
one ``function_call`` item per call; finish ``length`` (or ``abort``: a reply cut by the server's drain at
shutdown) -> status ``incomplete`` (``max_output_tokens``).
Nothing is stored: ``store: true`` and ``previous_response_id`` are refused.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ddtree_serve.server.config import ServerConfig
from ddtree_serve.server.http.chat_bridge import ChatRun, chat_request, check_refused, run_chat
from ddtree_serve.server.http.errors import APIError
from ddtree_serve.server.http.log_once import LogOnce
from ddtree_serve.server.http.protocol import ChatCompletionRequest
from ddtree_serve.server.http.protocol_responses import MessageItem, ResponsesRequest
from ddtree_serve.server.http.reasoning_seal import ENV_KEY, ReasoningSeal, SealError
from ddtree_serve.server.http.responses_tools import ToolMap, flat_name, map_tools
from ddtree_serve.server.tokenizer_manager import TokenizerManager

logger = logging.getLogger(__name__)

REFUSED = {
    "previous_response_id": "this server stores no responses; send the whole conversation as input",
    "conversation": "this server stores no conversations; send the whole conversation as input",
    "background": "responses run in the foreground only",
    "top_logprobs": "not served on /v1/responses; use /v1/chat/completions",
    "max_tool_calls": "not enforced by this server",
    "prompt": "no stored prompt templates",
    "service_tier": "one tier is served",
    "stream_options": "not supported on /v1/responses",
}
_PARAMS = {"max_tokens": "max_output_tokens", "response_format": "text", "messages": "input", "tools": "tools",
           "tool_choice": "tool_choice", "reasoning_effort": "reasoning"}


def _check(body: ResponsesRequest) -> None:
    check_refused(body, REFUSED)
    if body.store:
        raise APIError(400, "store: true is not supported: this server keeps no state between requests (send "
                            "store: false, or omit it)", param="store", code="unsupported_parameter")
    if body.truncation == "auto":
        raise APIError(400, "truncation 'auto' is not supported: an input over the context length is a 400",
                       param="truncation", code="unsupported_value")
    if body.text is not None and body.text.verbosity is not None:
        raise APIError(400, "text.verbosity is not supported", param="text", code="unsupported_parameter")


def _reasoning_text(item: Any, seal: ReasoningSeal | None) -> str:
    """A reasoning item's text: its sealed ``encrypted_content`` opened (a 400 naming ``input`` where it does
    not open), else its content / summary text."""
    if item.encrypted_content is None:
        return item.text()
    try:
        if seal is None:
            raise SealError("no seal key here")
        return seal.open(item.encrypted_content)
    except SealError as e:
        raise APIError(400, f"input: a reasoning item's encrypted_content does not open: {e}", param="input",
                       code="invalid_encrypted_content") from None


def _messages(body: ResponsesRequest, seal: ReasoningSeal | None = None) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if body.instructions is not None:
        messages.append({"role": "system", "content": body.instructions})
    items = [MessageItem(role="user", content=body.input)] if isinstance(body.input, str) else body.input
    reasoning = ""
    for it in items:
        if it.type == "reasoning":
            reasoning += _reasoning_text(it, seal)
        elif it.type == "message":
            messages.append({"role": it.role, "content": it.chat_content()})
            if it.role == "assistant" and reasoning:
                messages[-1]["reasoning_content"], reasoning = reasoning, ""
        elif it.type == "function_call":
            if not messages or messages[-1]["role"] != "assistant":
                messages.append({"role": "assistant", "content": None})
                if reasoning:
                    messages[-1]["reasoning_content"], reasoning = reasoning, ""
            name = it.name if it.namespace is None else flat_name(it.namespace, it.name)  # as the tools are served
            messages[-1].setdefault("tool_calls", []).append(
                {"id": it.call_id, "type": "function", "function": {"name": name, "arguments": it.arguments}})
        else:
            messages.append({"role": "tool", "tool_call_id": it.call_id, "content": it.text()})
    return messages


def wants_summary(body: ResponsesRequest) -> bool:
    """``reasoning.summary`` (or ``generate_summary``) asked: the reasoning item's summary holds the reasoning."""
    return body.reasoning is not None and (body.reasoning.summary or body.reasoning.generate_summary) is not None


def to_chat(body: ResponsesRequest, notes: list[tuple[str, str]] | None = None,
            seal: ReasoningSeal | None = None) -> dict[str, Any]:
    """The internal chat request body of ``body`` (APIError 400 for what cannot be served); ``notes``
    receives ``(key, message)`` for the tool types not offered (the handler logs each once); ``seal`` opens
    the reasoning items' ``encrypted_content``."""
    _check(body)
    tools = map_tools(body.tools)
    for kind in tools.not_offered:
        (notes if notes is not None else []).append((f"tool:{kind}", f"/v1/responses: {kind!r} tools are not "
                                                     "offered to the model (the server cannot run them)"))
    chat: dict[str, Any] = {"messages": _messages(body, seal), "stream": body.stream,  # missing: the sampling default
                            **{k: getattr(body, k) for k in ("temperature", "top_p") if k in body.model_fields_set}}
    if body.stream:
        chat["stream_options"] = {"include_usage": True}
    if body.max_output_tokens is not None:
        chat["max_tokens"] = body.max_output_tokens
    if tools.chat_tools:
        chat["tools"] = tools.chat_tools
    if body.tool_choice is not None:
        chat["tool_choice"] = body.tool_choice if isinstance(body.tool_choice, str) else {
            "type": "function", "function": {"name": body.tool_choice.name}}
    if body.parallel_tool_calls is not None:
        chat["parallel_tool_calls"] = body.parallel_tool_calls
    if body.reasoning is not None and body.reasoning.effort is not None:
        chat["reasoning_effort"] = body.reasoning.effort  # through the thinking switch (ddtree_serve/server/http/thinking.py)
    fmt = body.text.format if body.text is not None else None
    if fmt is not None and fmt.type == "json_schema":
        chat["response_format"] = {"type": "json_schema", "json_schema": {
            k: v for k, v in {"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict,
                              "description": fmt.description}.items() if v is not None}}
    elif fmt is not None:
        chat["response_format"] = {"type": fmt.type}
    return chat


def chat_of(body: ResponsesRequest, notes: list[tuple[str, str]] | None = None,
            seal: ReasoningSeal | None = None) -> ChatCompletionRequest:
    """The validated internal chat request of ``body`` (``to_chat``'s arguments); a refusal is the 400 of
    this API's field."""
    return chat_request(to_chat(body, notes, seal), _PARAMS)


def _usage(chat_usage: dict[str, Any]) -> dict[str, Any]:
    """Responses' usage from the chat usage (reasoning tokens are counted once, by the chat handler)."""
    details = chat_usage.get("completion_tokens_details") or {}
    return {"input_tokens": chat_usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": chat_usage["prompt_tokens_details"]["cached_tokens"],
                                     "cache_write_tokens": 0},
            "output_tokens": chat_usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": details.get("reasoning_tokens", 0)},
            "total_tokens": chat_usage["total_tokens"]}


def _rid(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponsesHandler:
    """/v1/responses; the tool types not offered are logged once (``log_once``, this handler's own)."""

    def __init__(self, config: ServerConfig, tm: TokenizerManager, served_model: str) -> None:
        self.config, self.tm, self.served = config, tm, served_model
        self.log_once = LogOnce(logger)
        self.seal = ReasoningSeal.from_config(config.server.reasoning_seal_key)  # encrypted_content
        if self.seal.ephemeral:
            logger.info("reasoning.encrypted_content is sealed with a random key of this process (set "
                        "--reasoning-seal-key or %s to open it on every replica and after a restart)", ENV_KEY)

    def sealed(self, body: ResponsesRequest) -> ReasoningSeal | None:
        """The seal for a reply's reasoning items, where the request includes ``reasoning.encrypted_content``."""
        return self.seal if "reasoning.encrypted_content" in (body.include or []) else None

    async def handle(self, request: Request, body: ResponsesRequest) -> Response:
        notes: list[tuple[str, str]] = []
        req = chat_of(body, notes, self.seal)
        self.log_once.all(notes)
        if body.model is not None:
            req = req.model_copy(update={"model": body.model})
        run = await run_chat(self.config, self.tm, self.served, request, req, _PARAMS)
        rid, created = _rid("resp"), int(time.time())
        if body.stream:
            return StreamingResponse(self._stream(run, body, rid, created), media_type="text/event-stream")
        return JSONResponse(self._collect(run, body, rid, created))

    def response(self, body: ResponsesRequest, rid: str, created: int, status: str,
                 output: list[dict[str, Any]], usage: dict[str, Any] | None) -> dict[str, Any]:
        """The Response object (``status``: in_progress, completed or incomplete)."""
        fmt = body.text.format if body.text is not None and body.text.format is not None else None
        tc = body.tool_choice
        return {
            "id": rid, "object": "response", "created_at": created, "status": status,
            "completed_at": int(time.time()) if status == "completed" else None, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens, "model": self.served,
            "output": output, "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": None, "store": False, **self._sampling(body),
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
            "tool_choice": tc.model_dump() if tc is not None and not isinstance(tc, str) else (tc or "auto"),
            "tools": [t.model_dump(exclude_none=True) for t in body.tools or []], "truncation": "disabled",
            "usage": usage, "metadata": body.metadata or {}, "user": body.user,
        }

    def _sampling(self, body: ResponsesRequest) -> dict[str, float]:
        """``temperature`` and ``top_p`` in force: the request's, else the server's sampling defaults."""
        defaults = self.tm.sampling_defaults
        return {k: getattr(body, k) if k in body.model_fields_set else defaults.get(k, getattr(body, k))
                for k in ("temperature", "top_p")}

    def _collect(self, run: ChatRun, body: ResponsesRequest, rid: str, created: int) -> dict[str, Any]:
        chat = run.json
        choice = chat["choices"][0]
        msg = choice["message"]
        output: list[dict[str, Any]] = []
        tools = map_tools(body.tools)
        reasoning = msg.get("reasoning_content") or ""
        if reasoning:
            output.append(_reasoning_item(_rid("rs"), reasoning, _summary(reasoning, body), self.sealed(body)))
        calls = msg.get("tool_calls") or []
        if msg.get("content") or not calls:
            output.append(_message(_rid("msg"), msg.get("content") or "", "completed"))
        for tc in calls:
            output.append(_call(_rid("fc"), tc["id"], tools.call_names(tc["function"]["name"]),
                                tc["function"]["arguments"] or "",
                                "completed"))
        status = "incomplete" if choice["finish_reason"] in ("length", "abort") else "completed"
        usage = _usage(chat["usage"])
        return self.response(body, rid, created, status, output, usage)

    async def _stream(self, run: ChatRun, body: ResponsesRequest, rid: str, created: int) -> AsyncIterator[str]:
        ev = _Events(map_tools(body.tools), wants_summary(body), self.sealed(body))
        yield ev.emit("response.created", response=self.response(body, rid, created, "in_progress", [], None))
        yield ev.emit("response.in_progress", response=self.response(body, rid, created, "in_progress", [], None))
        finish, usage = None, None
        chunks = run.chunks()
        try:
            async for chunk in chunks:
                if "error" in chunk:
                    err = chunk["error"]
                    param = _PARAMS.get(err.get("param"), err.get("param"))
                    yield ev.emit("error", code=err.get("code"), message=err["message"], param=param)
                    return
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices", []):
                    delta = choice.get("delta", {})
                    for e in ev.feed(delta):
                        yield e
                    finish = choice.get("finish_reason") or finish
        finally:
            await chunks.aclose()
        if ev.kind is None and not ev.output:  # an empty reply is still one (empty) message
            for e in ev.feed({}) + ev.open_message():
                yield e
        for e in ev.close():
            yield e
        status = "incomplete" if finish in ("length", "abort") else "completed"  # abort: cut by a drain
        u = _usage(usage) if usage else None
        yield ev.emit(f"response.{status}", response=self.response(body, rid, created, status, ev.output, u))


def _message(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if text or
            status == "completed" else []}


def _call(item_id: str, call_id: str, names: dict[str, str], arguments: str, status: str) -> dict[str, Any]:
    """A function_call item; ``names``: its ``name`` (and ``namespace``: ``ToolMap.call_names``)."""
    return {"type": "function_call", "id": item_id, "call_id": call_id, **names, "arguments": arguments,
            "status": status}


def _reasoning_item(item_id: str, text: str, summary: list[dict[str, str]], seal: ReasoningSeal | None
                    ) -> dict[str, Any]:
    """A finished reasoning item; with ``seal``, its ``encrypted_content`` holds ``text`` sealed."""
    item = {"type": "reasoning", "id": item_id, "summary": summary, "status": "completed",
            "content": [{"type": "reasoning_text", "text": text}]}
    if seal is not None:
        item["encrypted_content"] = seal.seal(text)
    return item


def _summary(reasoning: str, body: ResponsesRequest) -> list[dict[str, str]]:
    """The reasoning item's ``summary``: the whole reasoning when a summary was asked (nothing is shortened)."""
    return [{"type": "summary_text", "text": reasoning}] if reasoning and wants_summary(body) else []


class _Events:
    """The Responses event stream of a chat stream: one output item open at a time (reasoning, message, or a
    function call), opened by the first delta of its kind and closed by the next item or the end."""

    def __init__(self, tools: ToolMap, summary: bool, seal: ReasoningSeal | None) -> None:
        # a call's names; whether the reasoning is also the summary; the seal of encrypted_content
        self.tools, self.summary, self.seal = tools, summary, seal
        self.seq = 0
        self.output: list[dict[str, Any]] = []  # finished items, in order
        self.kind: str | None = None
        self.item: dict[str, Any] = {}
        self.buf = ""

    def emit(self, kind: str, **data: Any) -> str:
        body = {"type": kind, "sequence_number": self.seq, **data}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"

    @property
    def index(self) -> int:
        return len(self.output)

    def _open(self, kind: str, item: dict[str, Any]) -> list[str]:
        out = self.close()
        self.kind, self.item, self.buf = kind, item, ""
        out.append(self.emit("response.output_item.added", output_index=self.index, item=item))
        if item["type"] == "message":
            out.append(self.emit("response.content_part.added", item_id=item["id"], output_index=self.index,
                                 content_index=0, part={"type": "output_text", "text": "", "annotations": [],
                                                        "logprobs": []}))
        return out

    def open_message(self) -> list[str]:
        return self._open("message", _message(_rid("msg"), "", "in_progress"))

    def feed(self, delta: dict[str, Any]) -> list[str]:
        out: list[str] = []
        if delta.get("reasoning_content"):
            if self.kind != "reasoning":
                out += self._open("reasoning", {"type": "reasoning", "id": _rid("rs"), "summary": [],
                                                "content": [], "status": "in_progress"})
            self.buf += delta["reasoning_content"]
            out.append(self.emit("response.reasoning_text.delta", item_id=self.item["id"], output_index=self.index,
                                 content_index=0, delta=delta["reasoning_content"]))
        if delta.get("content"):
            if self.kind != "message":
                out += self.open_message()
            self.buf += delta["content"]
            out.append(self.emit("response.output_text.delta", item_id=self.item["id"], output_index=self.index,
                                 content_index=0, delta=delta["content"], logprobs=[]))
        for tc in delta.get("tool_calls") or []:
            fn = tc.get("function") or {}
            if self.kind != f"call:{tc.get('index')}":
                out += self._open(f"call:{tc.get('index')}", _call(_rid("fc"), tc.get("id") or "",
                                                                   self.tools.call_names(fn.get("name") or ""), "",
                                                                   "in_progress"))
            if fn.get("arguments"):
                self.buf += fn["arguments"]
                out.append(self.emit("response.function_call_arguments.delta", item_id=self.item["id"],
                                     output_index=self.index, delta=fn["arguments"]))
        return out

    def close(self) -> list[str]:
        """Close the open item (its ``done`` events); it joins ``output``."""
        if self.kind is None:
            return []
        item, text, i, out = self.item, self.buf, self.index, []
        if item["type"] == "reasoning":
            out.append(self.emit("response.reasoning_text.done", item_id=item["id"], output_index=i,
                                 content_index=0, text=text))
            summary = [{"type": "summary_text", "text": text}] if self.summary and text else []
            for part in summary:  # the summary is the reasoning, sent whole once it is complete
                ids = {"item_id": item["id"], "output_index": i, "summary_index": 0}
                out += [self.emit("response.reasoning_summary_part.added", **ids,
                                  part={"type": "summary_text", "text": ""}),
                        self.emit("response.reasoning_summary_text.delta", **ids, delta=part["text"]),
                        self.emit("response.reasoning_summary_text.done", **ids, text=part["text"]),
                        self.emit("response.reasoning_summary_part.done", **ids, part=part)]
            done = _reasoning_item(item["id"], text, summary, self.seal)
        elif item["type"] == "message":
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            out.append(self.emit("response.output_text.done", item_id=item["id"], output_index=i, content_index=0,
                                 text=text, logprobs=[]))
            out.append(self.emit("response.content_part.done", item_id=item["id"], output_index=i,
                                 content_index=0, part=part))
            done = _message(item["id"], text, "completed")
        else:
            out.append(self.emit("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                                 name=item["name"], arguments=text))
            done = {**item, "arguments": text, "status": "completed"}
        out.append(self.emit("response.output_item.done", output_index=i, item=done))
        self.output.append(done)
        self.kind, self.item, self.buf = None, {}, ""
        return out
