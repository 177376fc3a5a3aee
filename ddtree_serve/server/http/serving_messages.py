"""POST /v1/messages (Anthropic Messages), translated to and from an internal chat-completions request
(ddtree_serve/server/http/chat_bridge.py): same template, prompt tokens, parsers and sampling as /v1/chat/completions.

Request mapping: ``system``, then the text of every ``system``-role message of ``messages`` -> one system
message (text blocks as text parts; Claude Code sends system messages inside ``messages``); a user message's
``tool_result`` blocks -> ``tool`` messages (in order, before the message's text); an assistant message's
``tool_use`` blocks -> ``tool_calls`` (``input`` as JSON arguments), ``thinking`` blocks -> its
``reasoning_content``; ``stop_sequences`` -> ``stop``; ``tool_choice`` auto/any/tool/none -> auto/required/
the named function/none, ``disable_parallel_tool_use`` -> ``parallel_tool_calls: false`` (the first call is
kept); ``thinking`` disabled -> the template's ``thinking: false``, enabled or adaptive -> thinking on (the
default of a thinking model; ``budget_tokens`` does not bound the reasoning) where a reasoning parser exists,
else accepted without thinking blocks (logged once); ``output_config.effort`` -> chat's ``reasoning_effort``
where the template has a thinking switch (else logged once); ``context_management`` accepted (no edits,
logged once); ``max_tokens`` beyond the room the context leaves is lowered to it. Response mapping: reasoning -> a ``thinking`` block, text -> a
``text`` block, tool calls -> ``tool_use`` blocks; finish ``stop`` -> ``end_turn`` (``stop_sequence`` when
one of ``stop_sequences`` ended it), ``length`` -> ``max_tokens``, ``tool_calls`` -> ``tool_use``; usage
``input_tokens`` counts the prompt tokens not read from the prefix cache, ``cache_read_input_tokens`` those read.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ddtree_serve.server.config import ServerConfig
from ddtree_serve.server.http.chat_bridge import ChatRun, ChatTap, chat_request, check_refused, run_chat
from ddtree_serve.server.http.errors import APIError
from ddtree_serve.server.http.log_once import LogOnce
from ddtree_serve.server.http.protocol import ChatCompletionRequest
from ddtree_serve.server.http.protocol_messages import InputMessage, MessagesRequest, anthropic_error
from ddtree_serve.server.http.serving_chat import ChatHandler
from ddtree_serve.server.http.serving_common import check_admission
from ddtree_serve.server.http.thinking import apply_reasoning_effort, template_switches
from ddtree_serve.server.tokenizer_manager import TokenizerManager

logger = logging.getLogger(__name__)

REFUSED = {
    "service_tier": "one tier is served",
    "container": "no code-execution containers",
    "mcp_servers": "no MCP connector; run MCP tools on the client and send them as tools",
    "output_format": "use output_config.format",
    "inference_geo": "served where this server runs",
    "speed": "one speed is served",
    "diagnostics": "no diagnostics are produced",
    "user_profile_id": "no user profiles",
    "workspace_id": "no workspaces",
}
_STOP_REASON = {"length": "max_tokens", "abort": "max_tokens", "tool_calls": "tool_use"}  # abort: cut by a drain
_PARAMS = {"stop": "stop_sequences", "messages": "messages", "max_tokens": "max_tokens", "tools": "tools",
           "response_format": "output_config", "tool_choice": "tool_choice", "reasoning_effort": "output_config"}


def _user(m: InputMessage) -> list[dict[str, Any]]:
    if isinstance(m.content, str):
        return [{"role": "user", "content": m.content}]
    out: list[dict[str, Any]] = [{"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()}
                                 for b in m.content if b.type == "tool_result"]
    texts = [{"type": "text", "text": b.text} if b.type == "text" else {"type": "text", "text": b.text()}
             if b.type == "document" else {"type": "image_url", "image_url": {"url": b.url()}}
             for b in m.content if b.type in ("text", "document", "image")]  # images: models with a vision tower
    if texts or not out:
        out.append({"role": "user", "content": texts})
    return out


def _assistant(m: InputMessage) -> dict[str, Any]:
    if isinstance(m.content, str):
        return {"role": "assistant", "content": m.content}
    msg: dict[str, Any] = {"role": "assistant", "content": [{"type": "text", "text": b.text}
                                                            for b in m.content if b.type == "text"]}
    calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
             for b in m.content if b.type == "tool_use"]
    if calls:
        msg["tool_calls"] = calls
    reasoning = "".join(b.thinking for b in m.content if b.type == "thinking")
    if reasoning:
        msg["reasoning_content"] = reasoning
    if not msg["content"]:
        msg["content"] = None if calls else ""
    return msg


def _system(body: MessagesRequest) -> str | list[dict[str, Any]] | None:
    """The system prompt: ``system``, then the text of every ``system``-role message of ``messages`` in order
    (Claude Code sends some there), merged into one system message (every template takes one system turn
    first; many refuse one later). Blocks stay text parts; strings join the parts as they are."""
    parts: list[dict[str, Any]] = []
    for content in [body.system, *(m.content for m in body.messages if m.role == "system")]:
        if isinstance(content, str):
            parts.append({"type": "text", "text": content})
        elif content is not None:
            parts.extend({"type": "text", "text": b.text} for b in content)
    if not parts:
        return None
    if isinstance(body.system, str) and len(parts) == 1:
        return body.system
    return parts


EFFORT = {"low": "low", "medium": "medium", "high": "high", "max": "xhigh"}  # output_config.effort -> chat's


def _thinking(body: MessagesRequest, config: ServerConfig, chat_template: str | dict[str, str] | None,
              chat: dict[str, Any], notes: list[tuple[str, str]]) -> None:
    """``thinking`` and ``output_config.effort`` onto ``chat``: the model's thinking switch where a reasoning
    parser exists; where the model cannot think, accepted, served without thinking blocks, and noted."""
    thinking = body.thinking
    effort = body.output_config.effort if body.output_config is not None else None
    can_think = config.server.reasoning_parser is not None
    if thinking is not None and thinking.type == "disabled":
        chat["chat_template_kwargs"] = {"thinking": False, "enable_thinking": False}
    elif thinking is not None and thinking.type == "between_tools":
        raise APIError(400, "thinking type 'between_tools' is not supported; a thinking model thinks by default: "
                            "send type 'enabled' or 'adaptive', or omit thinking", param="thinking",
                       code="unsupported_value")
    elif thinking is not None and thinking.display == "omitted":
        raise APIError(400, "thinking display 'omitted' is not supported: the reasoning is returned",
                       param="thinking", code="unsupported_value")
    elif thinking is not None and not can_think:
        notes.append(("thinking", f"/v1/messages: thinking {thinking.type!r} accepted without thinking blocks: the "
                                  "server runs without a reasoning parser (--reasoning-parser), so the model "
                                  "does not think"))
    elif thinking is not None and thinking.budget_tokens is not None and thinking.budget_tokens < body.max_tokens:
        notes.append(("thinking.budget_tokens", "/v1/messages: thinking.budget_tokens is accepted but does not "
                                                "bound the reasoning; max_tokens bounds reasoning and answer"))
    if effort is None:
        return
    switches = template_switches(chat_template) if can_think else ()
    if switches and (thinking is None or thinking.type != "disabled"):
        chat["reasoning_effort"] = EFFORT[effort]  # thinking on through the switch (thinking.py)
    else:
        why = ("thinking is disabled" if thinking is not None and thinking.type == "disabled" else
               "the model has no thinking switch (a reasoning parser and a template reading 'thinking' or "
               "'enable_thinking')")
        notes.append((f"output_config.effort:{why}", f"/v1/messages: output_config.effort accepted with no "
                                                     f"effect: {why}"))


def to_chat(body: MessagesRequest, config: ServerConfig, chat_template: str | dict[str, str] | None = None,
            notes: list[tuple[str, str]] | None = None) -> dict[str, Any]:
    """The internal chat request body of ``body`` (raises APIError 400 for what cannot be served).
    ``chat_template``: the model's (whether it has a thinking switch); ``notes``: receives ``(key, message)``
    for what is accepted without effect (the handler logs each key once)."""
    notes = notes if notes is not None else []
    check_refused(body, REFUSED)
    turns = [m for m in body.messages if m.role != "system"]
    if not turns:
        raise APIError(400, "messages: at least one 'user' message is needed besides 'system' messages",
                       param="messages", code="invalid_value")
    if turns[-1].role == "assistant":
        raise APIError(400, "a final assistant message (prefill) is not supported: the reply always starts a "
                            "new assistant turn", param="messages", code="unsupported_value")
    messages: list[dict[str, Any]] = []
    system = _system(body)
    if system is not None:
        messages.append({"role": "system", "content": system})
    for m in turns:
        messages.extend(_user(m) if m.role == "user" else [_assistant(m)])
    chat: dict[str, Any] = {"messages": messages, "max_tokens": body.max_tokens, "stream": body.stream,
                            # sent ones only: a missing one takes the server's sampling default
                            **{k: getattr(body, k) for k in ("temperature", "top_p") if k in body.model_fields_set}}
    if body.stream:
        chat["stream_options"] = {"include_usage": True}
    if body.top_k is not None:
        chat["top_k"] = body.top_k
    if body.stop_sequences:
        chat["stop"] = body.stop_sequences
    if body.tools:
        chat["tools"] = [{"type": "function", "function": {"name": t.name, "parameters": t.input_schema,
                                                            **({"description": t.description} if t.description else {})}}
                         for t in body.tools]
    tc = body.tool_choice
    if tc is not None:
        chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(
            tc.type, {"type": "function", "function": {"name": tc.name}})
        if tc.disable_parallel_tool_use:
            chat["parallel_tool_calls"] = False
    oc = body.output_config
    if oc is not None and oc.format is not None:
        chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": oc.format.schema_}}
    _thinking(body, config, chat_template, chat, notes)
    if body.context_management is not None:
        notes.append(("context_management", "/v1/messages: context_management accepted; the server makes no "
                                            "context edits (the client sends the whole conversation)"))
    return chat


def chat_of(body: MessagesRequest, config: ServerConfig, chat_template: str | dict[str, str] | None = None,
            notes: list[tuple[str, str]] | None = None) -> ChatCompletionRequest:
    """The validated internal chat request of ``body`` (``to_chat``'s arguments); a refusal is the 400 of
    this API's field."""
    return chat_request(to_chat(body, config, chat_template, notes), _PARAMS)


def _usage(prompt: int, cached: int, output: int) -> dict[str, int]:
    return {"input_tokens": prompt - cached, "output_tokens": output, "cache_read_input_tokens": cached,
            "cache_creation_input_tokens": 0}


def _stop(finish: str | None, tap: ChatTap, body: MessagesRequest) -> tuple[str, str | None]:
    matched = tap.matched_stop()
    if finish == "stop" and isinstance(matched, str) and matched in (body.stop_sequences or []):
        return "stop_sequence", matched
    return _STOP_REASON.get(finish or "stop", "end_turn"), None


def _tool_input(arguments: str | None) -> dict[str, Any] | None:
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def message_of(run: ChatRun, body: MessagesRequest, served: str) -> dict[str, Any]:
    """The Anthropic message object of a finished (non-streaming) chat run."""
    chat = run.json
    choice = chat["choices"][0]
    msg = choice["message"]
    content: list[dict[str, Any]] = []
    if msg.get("reasoning_content"):
        content.append({"type": "thinking", "thinking": msg["reasoning_content"], "signature": ""})
    text = msg.get("content") or ""
    for tc in msg.get("tool_calls") or []:
        fn = tc["function"]
        args = _tool_input(fn.get("arguments"))
        if args is None:  # not a JSON object: the call is returned as the text it was
            text += f"{fn.get('name')}({fn.get('arguments')})"
        else:
            content.append({"type": "tool_use", "id": tc["id"], "name": fn["name"], "input": args})
    if text:
        content.insert(1 if content and content[0]["type"] == "thinking" else 0, {"type": "text", "text": text})
    finish = choice["finish_reason"]
    if any(b["type"] == "tool_use" for b in content):
        finish = "tool_calls"
    elif finish == "tool_calls":  # every call was returned as text
        finish = "stop"
    stop_reason, stop_seq = _stop(finish, run.tap, body)
    usage = chat["usage"]
    return {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "model": served,
            "content": content, "stop_reason": stop_reason, "stop_sequence": stop_seq,
            "usage": _usage(usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"],
                            usage["completion_tokens"])}


def _event(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps({'type': name, **data}, ensure_ascii=False)}\n\n"


async def stream_of(run: ChatRun, body: MessagesRequest, served: str) -> AsyncIterator[str]:
    """Anthropic's event stream of a streaming chat run."""
    tap = run.tap
    yield _event("message_start", {"message": {
        "id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "model": served, "content": [],
        "stop_reason": None, "stop_sequence": None, "usage": _usage(tap.prompt_tokens, tap.cached_tokens, 0)}})
    yield _event("ping", {})
    index, kind = -1, None  # the open content block: its index and kind ("text", "thinking", "tool:<i>")
    finish, usage = None, None

    def open_block(new_kind: str, block: dict[str, Any]) -> list[str]:
        nonlocal index, kind
        out = [_event("content_block_stop", {"index": index})] if kind is not None else []
        index, kind = index + 1, new_kind
        return [*out, _event("content_block_start", {"index": index, "content_block": block})]

    chunks = run.chunks()
    try:
        async for chunk in chunks:
            if "error" in chunk:
                yield _event("error", {"error": anthropic_error(400, chunk["error"]["message"])["error"]})
                return
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                delta = choice.get("delta", {})
                if delta.get("reasoning_content"):
                    if kind != "thinking":
                        for e in open_block("thinking", {"type": "thinking", "thinking": "", "signature": ""}):
                            yield e
                    yield _event("content_block_delta", {"index": index, "delta": {
                        "type": "thinking_delta", "thinking": delta["reasoning_content"]}})
                if delta.get("content"):
                    if kind != "text":
                        for e in open_block("text", {"type": "text", "text": ""}):
                            yield e
                    yield _event("content_block_delta", {"index": index, "delta": {
                        "type": "text_delta", "text": delta["content"]}})
                for tc in delta.get("tool_calls") or []:
                    fn = tc.get("function") or {}
                    if kind != f"tool:{tc.get('index')}":
                        for e in open_block(f"tool:{tc.get('index')}", {"type": "tool_use", "id": tc.get("id"),
                                                                         "name": fn.get("name"), "input": {}}):
                            yield e
                    if fn.get("arguments"):
                        yield _event("content_block_delta", {"index": index, "delta": {
                            "type": "input_json_delta", "partial_json": fn["arguments"]}})
                if choice.get("finish_reason"):
                    finish = choice["finish_reason"]
    finally:
        await chunks.aclose()
    if kind is not None:
        yield _event("content_block_stop", {"index": index})
    stop_reason, stop_seq = _stop(finish, tap, body)
    u = usage or {"prompt_tokens": tap.prompt_tokens, "completion_tokens": 0,
                  "prompt_tokens_details": {"cached_tokens": tap.cached_tokens}}
    yield _event("message_delta", {"delta": {"stop_reason": stop_reason, "stop_sequence": stop_seq},
                                   "usage": _usage(u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"],
                                                   u["completion_tokens"])})
    yield _event("message_stop", {})


class MessagesHandler:
    """/v1/messages and its count_tokens; notes on what is accepted without effect are logged once
    (``log_once``, this handler's own)."""

    def __init__(self, config: ServerConfig, tm: TokenizerManager, served_model: str) -> None:
        self.config, self.tm, self.served = config, tm, served_model
        self.log_once = LogOnce(logger)

    def _chat(self, body: MessagesRequest) -> ChatCompletionRequest:
        notes: list[tuple[str, str]] = []
        req = chat_of(body, self.config, getattr(self.tm.tokenizer, "chat_template", None), notes)
        self.log_once.all(notes)
        return req

    async def handle(self, request: Request, body: MessagesRequest) -> Response:
        req = self._chat(body)
        if body.model is not None:
            req = req.model_copy(update={"model": body.model})
        run = await run_chat(self.config, self.tm, self.served, request, req, _PARAMS, clamp=True)
        if body.stream:
            return StreamingResponse(stream_of(run, body, self.served), media_type="text/event-stream")
        return JSONResponse(message_of(run, body, self.served))


    async def count_tokens(self, body: MessagesRequest) -> JSONResponse:
        """Anthropic's ``{"input_tokens": N}``: the prompt /v1/messages would send (system, tools, images)."""
        req = self._chat(body)
        check_admission(self.tm, body.model, self.served, 1)
        chat = ChatHandler(self.config, self.tm, self.served)
        ids, _ = await chat.prompt(apply_reasoning_effort(req, self.config.server.reasoning_parser,
                                                          getattr(self.tm.tokenizer, "chat_template", None)))
        return JSONResponse({"input_tokens": len(ids)})


def messages_error(status: int, message: str) -> JSONResponse:
    return JSONResponse(anthropic_error(status, message), status_code=status)
