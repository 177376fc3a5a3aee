"""The tool calls of a conversation's history, as the served model's template expects them.

Kimi K2.x is trained on tool-call ids of the form ``functions.NAME:IDX`` (IDX: a counter over every call of
the conversation, from 0), and its chat template renders the ids verbatim: in the assistant's
``<|tool_call_begin|>ID<|tool_call_argument_begin|>`` and in each tool answer's ``## Return of ID``. Other
ids in the history (``call_abc...`` from an OpenAI client, ``toolu_...`` from an Anthropic one, ids a proxy
minted) put the prompt off the model's distribution: it abandons turns or writes malformed calls
(MoonshotAI/K2-Vendor-Verifier; vLLM #50782). So with the ``kimi_k2`` tool-call parser every id of the
history is rewritten before the template is applied, whatever the client sent:

- the assistant messages' ``tool_calls[k].id`` become ``functions.NAME:IDX`` with IDX running over the
  conversation's calls in order (0, 1, 2, ... across turns); an id already in that form for the call's own
  function and not used earlier in the conversation (the id the model wrote, sent back by the client) is kept
  unchanged, and the count continues after its IDX, so Kimi's ids round-trip exactly as they were emitted;
- each ``tool`` message's ``tool_call_id`` becomes the new id of the call it answers: a call of the
  assistant message just before it (the tool messages after an assistant message answer its calls). Two
  turns may reuse the same client id; one message may not (its answers could not tell the calls apart).

A tool message whose id matches no call of that assistant message, or an id repeated within one message,
is a 400 naming ``messages``. The reply's own calls keep the ids the model wrote (``functions.NAME:IDX``).
"""

from __future__ import annotations

from typing import Any

from ddtree_serve.server.http.errors import APIError


def _bad(message: str) -> APIError:
    return APIError(400, message, param="messages", code="invalid_value")


def _kimi_index(call_id: str, name: str) -> int | None:
    """IDX of ``call_id`` when it is ``functions.NAME:IDX`` for this call's own ``name``, else None."""
    prefix = f"functions.{name}:"
    tail = call_id[len(prefix):] if isinstance(call_id, str) and call_id.startswith(prefix) else ""
    return int(tail) if tail.isdigit() else None


def kimi_tool_ids(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A copy of the template messages (dicts, as ddtree_serve/server/http/serving_chat.py builds them) with Kimi's
    tool-call ids; raises APIError 400 (``messages``) for an answer to no call or a repeated id."""
    out: list[dict[str, Any]] = []
    count = 0  # the next IDX for a rewritten id: after every IDX of the conversation so far
    used: set[str] = set()  # ids of the conversation's calls so far (a kept id must be new)
    turn: dict[str, str] = {}  # client id -> new id, for the calls of the last assistant message
    for i, message in enumerate(messages):
        m = dict(message)
        role = m.get("role")
        if role == "assistant" and m.get("tool_calls"):
            turn = {}
            calls = []
            for k, call in enumerate(m["tool_calls"]):
                if call["id"] in turn:
                    raise _bad(f"messages[{i}].tool_calls[{k}].id {call['id']!r} repeats the id of another call "
                               "of the same message: the tool messages answering them could not tell them apart")
                kept = _kimi_index(call["id"], call["function"]["name"])
                if kept is not None and call["id"] not in used:  # the model's own id: unchanged
                    turn[call["id"]], count = call["id"], max(count, kept + 1)
                else:
                    turn[call["id"]] = f"functions.{call['function']['name']}:{count}"
                    count += 1
                used.add(turn[call["id"]])
                calls.append({**call, "id": turn[call["id"]]})
            m["tool_calls"] = calls
        elif role == "tool":
            answered = m.get("tool_call_id")
            if answered not in turn:
                known = ", ".join(repr(c) for c in turn) or "none"
                raise _bad(f"messages[{i}].tool_call_id {answered!r} matches no tool call of the assistant message "
                           f"before it (its call ids: {known})")
            m["tool_call_id"] = turn[answered]
        else:
            turn = {}
        out.append(m)
    return out


def template_messages(messages: list[dict[str, Any]], tool_call_parser: str | None) -> list[dict[str, Any]]:
    """``messages`` as the served model's template takes them: Kimi's ids with the ``kimi_k2`` parser,
    unchanged otherwise."""
    return kimi_tool_ids(messages) if tool_call_parser == "kimi_k2" else messages
