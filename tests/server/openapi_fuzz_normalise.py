"""The documented normalisation of schema-valid request bodies for the schemathesis fuzz
(tests/server/test_openapi_fuzz.py; docs/API.md, "What the spec cannot say").

The published spec (/openapi.json) carries every rule validation enforces except those that depend on the
server's settings or tokenizer, or that tie one field's value to another's; a body valid by the spec, after
this normalisation, must be accepted. Each step names the rule it stands for:

- ``model``: must name the served model (a setting): removed.
- images and videos (chat ``image_url`` / ``video_url`` parts, Messages ``image`` blocks): need a model with a
  vision tower (the default model has none): replaced by text.
- token ids (``logit_bias`` keys, a completions ``prompt`` of ids, /detokenize ``tokens``): must be in the
  model's vocabulary (the tokenizer): taken modulo its size.
- a named forced tool (chat ``tool_choice.function.name``, Messages ``tool_choice.name``, Responses
  ``tool_choice.name``): must be one of the request's ``tools`` (a reference between fields): the first tool's.
- a chat ``tool`` message (and a Messages ``tool_result`` block, a Responses ``function_call_output`` item)
  answers a preceding assistant turn with tool calls (an order between list items, which JSON Schema cannot
  state): an unanswered one becomes a user message / text.
- a Messages conversation ends with a user turn (a final assistant message, a prefill, is refused: the last
  item of a list, which JSON Schema cannot single out; ``system`` messages do not count, they join the system
  prompt): a user message is appended after a final assistant one, or to a conversation of system messages.
- a Responses reasoning item's ``encrypted_content`` must be a token this server sealed (its key): removed.
- a Responses ``namespace`` tool's functions are served as ``NS__NAME``, which must be at most 64 characters
  and no other tool's name (a comparison between fields): such a function (or a function tool of that name)
  is removed.
- ``reasoning_effort`` (Responses ``reasoning.effort``): needs a chat template with a thinking switch (the
  model; the default model's has none): removed.
- a Messages ``thinking.budget_tokens``: at least ``max_tokens`` (a comparison between fields): removed when
  below.
- ``min_tokens``: at most the output limit (a comparison between fields): capped at it.
- chat ``stream_options`` needs ``stream: true`` (published for completions; left out of the chat schema, whose
  if/then rules would then be more than schemathesis canonicalises): removed without ``stream: true``.
- chat ``continue_final_message``: the last message must be an assistant's (the last item of a list): set
  false when it is not (with ``add_generation_prompt`` true again if it was left out).
- grammars (``regex``, ``ebnf``, a ``response_format`` / ``output_config.format`` / ``text.format`` JSON
  schema): must compile (a regular expression's or a grammar's syntax): replaced by ones that do.

Not normalised but allowed: a prompt longer than the served context (it depends on the tokenizer and the
``--context-length`` setting; generated tool definitions and long item lists can reach it) gets the 400 that
carries the code ``context_length_exceeded``, which the fuzz counts as an answer, not a refusal.

Run time only (the server accepts the spec's full ranges): generated output is capped at ``MAX_NEW`` tokens
(set where absent, which would mean "until the context length") and ``n`` at ``MAX_N``.
"""

from __future__ import annotations

from typing import Any

VOCAB = 49152  # the default model's (SmolLM2) vocabulary
MAX_NEW = 4
MAX_N = 2
_OUTPUT_LIMIT = {"POST /v1/chat/completions": "max_tokens", "POST /v1/completions": "max_tokens",
                 "POST /v1/messages": "max_tokens", "POST /v1/responses": "max_output_tokens"}
GOOD_REGEX = "[a-z]+"
GOOD_EBNF = 'root ::= "yes" | "no"'
GOOD_SCHEMA = {"type": "object"}


def normalise(label: str, body: Any) -> Any:
    """``body`` (a generated, schema-valid body of operation ``label``, e.g. "POST /v1/completions"),
    normalised in place as the module docstring says; returned."""
    if not isinstance(body, dict):
        return body
    if label == "POST /v1/messages/count_tokens":  # the same body as /v1/messages (max_tokens unused)
        label = "POST /v1/messages"
    body.pop("model", None)
    if isinstance(body.get("logit_bias"), dict):
        body["logit_bias"] = {str(int(k) % VOCAB): v for k, v in body["logit_bias"].items()}
    if label == "POST /detokenize" and isinstance(body.get("tokens"), list):
        body["tokens"] = _ids_in_vocab(body["tokens"])
    if label == "POST /v1/completions":
        body["prompt"] = _ids_in_vocab(body.get("prompt"))
    limit = _OUTPUT_LIMIT.get(label)
    if limit is not None:
        if label == "POST /v1/chat/completions" and isinstance(body.get("max_completion_tokens"), int):
            body["max_completion_tokens"] = min(body["max_completion_tokens"], MAX_NEW)
        elif not isinstance(body.get(limit), int) or body[limit] > MAX_NEW:
            body[limit] = MAX_NEW if body.get(limit) != 0 else 0
    if isinstance(body.get("n"), int):
        body["n"] = min(body["n"], MAX_N)
    if isinstance(body.get("min_tokens"), (int, float)) and limit is not None:  # integral floats are integers
        cap = body.get("max_completion_tokens") if isinstance(body.get("max_completion_tokens"), (int, float)) \
            else body.get(limit)
        body["min_tokens"] = min(int(body["min_tokens"]), int(cap) if isinstance(cap, (int, float)) else MAX_NEW)
    if label == "POST /v1/chat/completions" and body.get("stream") is not True:
        body.pop("stream_options", None)
    msgs = body.get("messages")
    if label == "POST /v1/chat/completions" and body.get("continue_final_message") is True and isinstance(msgs, list) \
            and msgs and isinstance(msgs[-1], dict) and msgs[-1].get("role") != "assistant":
        body["continue_final_message"] = False
    _grammars(label, body)
    _without_images(label, body)
    body.pop("reasoning_effort", None)
    if isinstance(body.get("reasoning"), dict):
        body["reasoning"].pop("effort", None)
    thinking = body.get("thinking") if label == "POST /v1/messages" else None
    if isinstance(thinking, dict) and isinstance(thinking.get("budget_tokens"), int) \
            and isinstance(body.get("max_tokens"), int) and thinking["budget_tokens"] < body["max_tokens"]:
        thinking.pop("budget_tokens")
    if label in ("POST /v1/chat/completions", "POST /tokenize"):
        _answered_tool_messages(body.get("messages"))
    if label == "POST /v1/chat/completions":
        _named_tool(body.get("tool_choice"), body.get("tools"), lambda c, t: c["function"].update(
            name=t["function"]["name"]) if isinstance(c.get("function"), dict) else None)
    elif label == "POST /v1/messages":
        _named_tool(body.get("tool_choice"), body.get("tools"),
                    lambda c, t: c.update(name=t["name"]) if c.get("type") == "tool" else None)
        _answered_tool_results(body.get("messages"))
        messages = body.get("messages")
        turns = [m for m in messages if not (isinstance(m, dict) and m.get("role") == "system")] \
            if isinstance(messages, list) else []
        if isinstance(messages, list) and (not turns or (isinstance(turns[-1], dict)
                                                         and turns[-1].get("role") == "assistant")):
            messages.append({"role": "user", "content": "Go on."})
    elif label == "POST /v1/responses":
        _named_tool(body.get("tool_choice"), body.get("tools"), lambda c, t: c.update(name=t["name"]))
        _answered_call_outputs(body.get("input"))
        for item in body.get("input") if isinstance(body.get("input"), list) else []:
            if isinstance(item, dict) and item.get("type") == "reasoning":
                item.pop("encrypted_content", None)
        _served_tool_names(body.get("tools"))
    return body


def _served_tool_names(tools: Any) -> None:
    """Remove the Responses functions whose served name (``NS__NAME`` in a namespace) is over 64 characters
    or another tool's."""
    seen: set[str] = set()
    for tool in list(tools) if isinstance(tools, list) else []:
        if not isinstance(tool, dict):
            continue
        if tool.get("type") == "namespace" and isinstance(tool.get("tools"), list):
            for sub in list(tool["tools"]):
                name = f"{tool.get('name')}__{sub.get('name') if isinstance(sub, dict) else ''}"
                if len(name) > 64 or name in seen:
                    tool["tools"].remove(sub)
                seen.add(name)
        elif tool.get("type") == "function":
            if tool.get("name") in seen:
                tools.remove(tool)
            seen.add(tool.get("name"))


def _ids_in_vocab(prompt: Any) -> Any:
    """Token ids (ints, or whole floats: JSON's integers) taken modulo the vocabulary."""
    def num(x: Any) -> bool:
        return isinstance(x, int | float) and not isinstance(x, bool)

    if isinstance(prompt, list) and prompt and all(num(x) for x in prompt):
        return [int(x) % VOCAB for x in prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(x, list) for x in prompt):
        return [[int(t) % VOCAB if num(t) else t for t in p] for p in prompt]
    return prompt


def _without_images(label: str, body: dict) -> None:
    """The default model has no vision tower: image parts (chat, /tokenize), image blocks (Messages) and
    ``input_image`` parts (Responses) become text."""
    key = {"POST /v1/chat/completions": "image_url", "POST /tokenize": "image_url", "POST /v1/messages": "image",
           "POST /v1/responses": "input_image"}
    kind = key.get(label)
    field = "input" if label == "POST /v1/responses" else "messages"
    texts = "input_text" if label == "POST /v1/responses" else "text"
    for m in body.get(field) or [] if kind and isinstance(body.get(field), list) else []:
        content = m.get("content") if isinstance(m, dict) else None
        for k, part in enumerate(content if isinstance(content, list) else []):
            if isinstance(part, dict) and (part.get("type") == kind or part.get("type") == "video_url"):
                content[k] = {"type": texts, "text": "An image."}


def _named_tool(choice: Any, tools: Any, rename: Any) -> None:
    if isinstance(choice, dict) and isinstance(tools, list) and tools:
        rename(choice, tools[0])


def _grammars(label: str, body: dict) -> None:
    if isinstance(body.get("regex"), str):
        body["regex"] = GOOD_REGEX
    if isinstance(body.get("ebnf"), str):
        body["ebnf"] = GOOD_EBNF
    rf = body.get("response_format")
    if isinstance(rf, dict) and isinstance(rf.get("json_schema"), dict) and "schema" in rf["json_schema"]:
        rf["json_schema"]["schema"] = GOOD_SCHEMA
    fmt = (body.get("output_config") or {}).get("format") if label == "POST /v1/messages" else None
    if isinstance(fmt, dict) and "schema" in fmt:
        fmt["schema"] = GOOD_SCHEMA
    text = body.get("text") if label == "POST /v1/responses" else None
    fmt = text.get("format") if isinstance(text, dict) else None
    if isinstance(fmt, dict) and isinstance(fmt.get("schema"), dict):
        fmt["schema"] = GOOD_SCHEMA


def _answered_tool_messages(messages: Any) -> None:
    """Chat: a 'tool' message that does not answer an assistant turn with tool calls becomes a user message."""
    answering = False
    for m in messages if isinstance(messages, list) else []:
        if not isinstance(m, dict):
            continue
        if m.get("role") == "tool" and not answering:
            m["role"] = "user"
            m.pop("tool_call_id", None)
        elif m.get("role") != "tool":
            answering = m.get("role") == "assistant" and bool(m.get("tool_calls"))


def _answered_tool_results(messages: Any) -> None:
    """Messages: a user message's tool_result blocks answer the assistant message just before it, when that one
    has tool_use blocks; others become text blocks."""
    previous_uses = False
    for m in messages if isinstance(messages, list) else []:
        content = m.get("content") if isinstance(m, dict) else None
        blocks = content if isinstance(content, list) else []
        if m.get("role") == "user" and not previous_uses:
            for i, b in enumerate(blocks):
                if isinstance(b, dict) and b.get("type") == "tool_result":
                    blocks[i] = {"type": "text", "text": "result"}
        previous_uses = m.get("role") == "assistant" and any(
            isinstance(b, dict) and b.get("type") == "tool_use" for b in blocks)


def _answered_call_outputs(items: Any) -> None:
    """Responses: a function_call_output item that does not follow function calls (or other outputs answering
    them) becomes a user message."""
    answering = False
    for i, it in enumerate(items if isinstance(items, list) else []):
        kind = it.get("type") if isinstance(it, dict) else None
        if kind == "function_call_output" and not answering:
            items[i] = {"type": "message", "role": "user", "content": "result"}
        elif kind not in ("function_call_output", "reasoning"):  # reasoning items add no message
            answering = kind == "function_call"
