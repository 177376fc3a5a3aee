"""Requests as the agent clients send them, on a real server (default model, hermes tool parser, no reasoning
parser, a 256-token context, ``--allow-auto-truncate``), issue 61: Claude Code's Messages body (a
``system``-role message inside ``messages``, ``thinking`` with a budget, ``output_config.effort``,
``context_management``, ``max_tokens`` 32000 on a small context) is served, the fields the model cannot act
on are logged once; a ``max_tokens`` beyond the room the context leaves is lowered to the room on Messages
and Responses (stop reason ``max_tokens`` / status ``incomplete``) and, with the flag, on chat and
completions (``length``); chat's Moonshot ``thinking`` field is taken, and unknown body fields are logged once
per name."""

from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import running_server

CONTEXT = 256
CLAUDE_CODE = {
    "model": "default", "max_tokens": 32000, "stream": False, "metadata": {"user_id": "u"},
    "system": [{"type": "text", "text": "You are a coding agent.", "cache_control": {"type": "ephemeral"}}],
    "messages": [{"role": "user", "content": [{"type": "text", "text": "say hi"}]},
                 {"role": "system", "content": "Reminder: answer briefly."}],
    "thinking": {"type": "enabled", "budget_tokens": 31999}, "output_config": {"effort": "high"},
    "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}, "temperature": 0,
}


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    from ddtree_serve.model_executor.default_model import ensure_default_model

    ensure_default_model()
    args = ["--context-length", str(CONTEXT), "--tool-call-parser", "hermes", "--dtype", "float32",
            "--allow-auto-truncate"]
    with running_server(args, tmp_path_factory.mktemp("clients")) as s:
        yield s


def _post(base: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(base + path, json=body, timeout=120)


def test_claude_code_messages_body_is_served(srv) -> None:
    r = _post(srv.base, "/v1/messages", CLAUDE_CODE)
    assert r.status_code == 200, r.text
    m = r.json()
    assert [b["type"] for b in m["content"]] == ["text"] and m["content"][0]["text"]  # no thinking blocks
    assert m["stop_reason"] in ("end_turn", "max_tokens")
    used = m["usage"]["input_tokens"] + m["usage"]["cache_read_input_tokens"] + m["usage"]["output_tokens"]
    assert used <= CONTEXT
    # the system-role message is merged into the system prompt: the same prompt as chat's one system message
    counted = _post(srv.base, "/v1/messages/count_tokens", CLAUDE_CODE).json()["input_tokens"]
    chat = _post(srv.base, "/tokenize", {"messages": [
        {"role": "system", "content": [{"type": "text", "text": "You are a coding agent."},
                                       {"type": "text", "text": "Reminder: answer briefly."}]},
        {"role": "user", "content": [{"type": "text", "text": "say hi"}]}]}).json()
    assert counted == chat["count"] == m["usage"]["input_tokens"] + m["usage"]["cache_read_input_tokens"]
    with httpx.stream("POST", srv.base + "/v1/messages", json={**CLAUDE_CODE, "stream": True}, timeout=120) as s:
        assert s.status_code == 200
        lines = [ln for ln in s.iter_lines() if ln.startswith("event: ")]
    assert lines[0] == "event: message_start" and lines[-1] == "event: message_stop"
    log = srv.log.read_text()
    for words in ("thinking 'enabled' accepted without thinking blocks", "output_config.effort accepted with no effect",
                  "context_management accepted"):
        assert log.count(words) == 1, (words, log[-3000:])


def _long_prompt(base: str, room: int) -> str:
    """A user message whose chat prompt leaves exactly ``room`` tokens of the context."""
    words = 200
    for _ in range(5):
        text = "Repeat after me:" + " apple" * words
        n = _post(base, "/tokenize", {"messages": [{"role": "user", "content": text}]}).json()["count"]
        if n == CONTEXT - room:
            return text
        words += CONTEXT - room - n
    raise AssertionError("could not size the prompt")


def test_max_tokens_beyond_the_room_is_clamped(srv) -> None:
    room = 5
    text = _long_prompt(srv.base, room)
    msgs = [{"role": "user", "content": text}]
    m = _post(srv.base, "/v1/messages", {"messages": msgs, "max_tokens": 1000, "temperature": 0}).json()
    assert m["stop_reason"] == "max_tokens" and m["usage"]["output_tokens"] == room, m
    r = _post(srv.base, "/v1/responses", {"input": text, "max_output_tokens": 1000, "temperature": 0}).json()
    assert r["status"] == "incomplete" and r["incomplete_details"]["reason"] == "max_output_tokens", r
    assert r["usage"]["output_tokens"] == room
    c = _post(srv.base, "/v1/chat/completions", {"messages": msgs, "max_tokens": 1000, "temperature": 0}).json()
    assert c["choices"][0]["finish_reason"] == "length" and c["usage"]["completion_tokens"] == room, c
    p = _post(srv.base, "/v1/completions", {"prompt": "Once upon a time" * 60, "max_tokens": 1000,
                                            "temperature": 0}).json()
    assert p["choices"][0]["finish_reason"] == "length"
    assert p["usage"]["prompt_tokens"] + p["usage"]["completion_tokens"] == CONTEXT, p
    # a prompt that fills the context leaves no room: still a 400
    full = _post(srv.base, "/v1/messages", {"messages": [{"role": "user", "content": "apple " * 400}],
                                            "max_tokens": 10})
    assert full.status_code == 400 and full.json()["type"] == "error", full.text


def test_chat_thinking_field_and_unknown_fields_logged_once(srv) -> None:
    msgs = [{"role": "user", "content": "hi"}]
    for _ in range(2):
        r = _post(srv.base, "/v1/chat/completions", {"messages": msgs, "max_tokens": 2, "thinking": {"type": "disabled"},
                                                     "preserve_thinking": True, "x_client_flag": 1})
        assert r.status_code == 200, r.text
        assert _post(srv.base, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "x_client_flag": 1}).status_code == 200
    r = _post(srv.base, "/v1/chat/completions", {"messages": msgs, "max_tokens": 2, "thinking": {"type": "enabled"},
                                                 "chat_template_kwargs": {"thinking": False}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "thinking", r.text
    log = srv.log.read_text()
    for line in ("/v1/chat/completions: unknown field 'preserve_thinking' ignored",
                 "/v1/chat/completions: unknown field 'x_client_flag' ignored",
                 "/v1/completions: unknown field 'x_client_flag' ignored"):
        assert log.count(line) == 1, line
    assert "unknown field 'thinking'" not in log
