"""Kimi K2.6's tokenizer path with a tiktoken remote-code tokenizer in a tiny Kimi checkpoint.

The tokenizer is our stand-in (``tests/server/tokenization_kimi_standin.py``) in the interface of Kimi's
``tokenization_kimi.py``: ``auto_map`` + ``trust_remote_code``, ``tiktoken.model``, Kimi's special tokens
and turn format, thinking on by default and off with chat_template_kwargs ``{"thinking": false}``.
Moonshot's own tokenizer file is not exercised here.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from ddtree_serve.server.config import ServerConfig
from ddtree_serve.server.detokenizer import IncrementalDetokenizer
from ddtree_serve.server.http.metrics import ServerMetrics
from ddtree_serve.server.io_struct import DetokenizeReq, IpcEndpoints, TokenOut
from ddtree_serve.server.process_utils import load_tokenizer
from ddtree_serve.server.tokenizer_manager import TokenizerManager
from tests.server.conftest import REPO, free_port, running_server
from tests.server.kimi_tokenizer_files import special_token_ids, write_tiny_kimi
from tests.server.tokenization_kimi_standin import SPECIAL_TOKENS

VOCAB = 512
ASCII = "Hello! What is the weather like today in Paris? def add(a, b):\n    return a + b\n"
MULTIBYTE = "Héllo wörld — 日本語のテキスト 🎉🙂 done."
MESSAGES = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is the capital of France?"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("kimi") / "tiny-kimi"
    write_tiny_kimi(path, VOCAB)
    return path


@pytest.fixture(scope="module")
def tok(kimi_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(kimi_dir), trust_remote_code=True)


def _manager(tokenizer) -> TokenizerManager:
    return TokenizerManager(ServerConfig(), IpcEndpoints.in_dir("/nonexistent"), tokenizer, ServerMetrics("kimi"))


def test_remote_code_tokenizer_loads(kimi_dir, tok) -> None:
    assert type(tok).__name__ == "TikTokenTokenizer"
    assert type(tok).__module__.startswith("transformers_modules.")  # loaded as the checkpoint's own code
    assert len(tok) == VOCAB and tok.vocab_size == VOCAB - len(SPECIAL_TOKENS)
    cfg = json.loads((kimi_dir / "config.json").read_text())
    gen = json.loads((kimi_dir / "generation_config.json").read_text())
    im_end = special_token_ids(VOCAB)["<|im_end|>"]
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == im_end
    assert cfg["eos_token_id"] == gen["eos_token_id"] == cfg["text_config"]["eos_token_id"] == im_end
    assert cfg["text_config"]["vocab_size"] >= len(tok)
    # the server's loader gives the same class
    assert type(load_tokenizer(str(kimi_dir), True)).__name__ == "TikTokenTokenizer"


@pytest.mark.parametrize("text", [ASCII, MULTIBYTE, "", " ", "a\n\n\tb  c"])
def test_encode_matches_tiktoken_and_round_trips(tok, text: str) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == tok.encoding.encode(text, allowed_special="all")
    assert tok.decode(ids) == text
    assert tok.convert_tokens_to_string(tok.tokenize(text)) == text


def test_common_words_are_short(tok) -> None:
    for word in (" the", " and", " you", " assistant", " answer"):
        assert 1 <= len(tok.encode(word, add_special_tokens=False)) <= 3, word
    ascii_ids = tok.encode(ASCII, add_special_tokens=False)
    assert len(ascii_ids) < 0.6 * len(ASCII.encode())  # merges were learned, not just bytes


def test_special_tokens_are_single_ids(tok) -> None:
    ids = special_token_ids(VOCAB)
    for text, i in ids.items():
        assert tok.encode(text, add_special_tokens=False) == [i]
        assert tok.convert_ids_to_tokens(i) == text
    wrapped = "<think>plan</think>ok<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0" \
              '<|tool_call_argument_begin|>{"a": 1}<|tool_call_end|><|tool_calls_section_end|><|im_end|>'
    enc = tok.encode(wrapped, add_special_tokens=False)
    assert enc[0] == ids["<think>"] and enc[-1] == ids["<|im_end|>"]
    assert tok.decode(enc, skip_special_tokens=False) == wrapped
    assert tok.decode(enc, skip_special_tokens=True) == 'planokfunctions.f:0{"a": 1}'


def test_streaming_detokenizer_splits_utf8(tok) -> None:
    """Token by token through the server's IncrementalDetokenizer: no U+FFFD shown, text exact."""
    ids = tok.encode(MULTIBYTE + "<|im_end|>", add_special_tokens=False)
    assert any("\ufffd" in tok.decode([i]) for i in ids)  # characters split over tokens
    detok = IncrementalDetokenizer(tok, eos_token_ids=(tok.eos_token_id,))
    detok.add(DetokenizeReq("r", skip_special_tokens=False))
    pieces = []
    for k, i in enumerate(ids):
        last = k == len(ids) - 1
        out = detok.process(TokenOut("r", [i], finished=last, finish_reason="stop" if last else None))
        assert "\ufffd" not in out.text
        pieces.append(out.text)
    assert "".join(pieces) == MULTIBYTE  # the eos is trimmed


def test_chat_template_thinking_on_and_off(tok) -> None:
    tm = _manager(tok)
    ids = special_token_ids(VOCAB)
    on = tm.encode_chat(MESSAGES, None, None)
    on_explicit = tm.encode_chat(MESSAGES, None, {"thinking": True})
    off = tm.encode_chat(MESSAGES, None, {"thinking": False})
    assert on == on_explicit
    assert on != off and off[:len(on)] == on
    assert off[len(on):] == [ids["<think>"], ids["</think>"]]
    head = [ids["<|im_assistant|>"], *tok.encode("assistant", add_special_tokens=False), ids["<|im_middle|>"]]
    assert on[-len(head):] == head
    text = tok.decode(on)
    assert text.startswith("<|im_system|>system<|im_middle|>You are a helpful assistant.<|im_end|>")
    assert "<|im_user|>user<|im_middle|>What is the capital of France?<|im_end|>" in text


def test_chat_template_tools_and_tool_turns(tok) -> None:
    tm = _manager(tok)
    history = [*MESSAGES,
               {"role": "assistant", "content": "",
                "tool_calls": [{"id": "functions.get_weather:0", "type": "function",
                                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "sunny"}]
    text = tok.decode(tm.encode_chat(history, TOOLS, {"thinking": False}))
    assert text.startswith("<|im_system|>tools<|im_middle|>[")
    assert json.loads(text.split("<|im_middle|>", 1)[1].split("<|im_end|>", 1)[0]) == TOOLS
    assert ("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
            '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>') in text
    assert "<|im_system|>tool<|im_middle|>sunny<|im_end|>" in text
    assert text.endswith("<|im_assistant|>assistant<|im_middle|><think></think>")


def test_engine_uses_remote_code_tokenizer(kimi_dir) -> None:
    from ddtree_serve.server.engine import Engine, SamplingParams

    engine = Engine(str(kimi_dir), device="cpu", dtype="float32")
    try:
        assert type(engine.tokenizer).__name__ == "TikTokenTokenizer"
        out = engine.generate([MULTIBYTE], SamplingParams(temperature=0, max_tokens=3))[0]
        assert out.prompt_token_ids == engine.tokenizer.encode(MULTIBYTE, add_special_tokens=False)
        assert 1 <= len(out.token_ids) <= 3 and isinstance(out.text, str)
    finally:
        engine.shutdown()


def test_untrusted_remote_code_fails_clearly(kimi_dir) -> None:
    from ddtree_serve.server.engine import Engine

    with pytest.raises(ValueError, match="trust_remote_code"):
        load_tokenizer(str(kimi_dir), trust_remote_code=False)
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match="trust_remote_code"):
        Engine(str(kimi_dir), device="cpu", trust_remote_code=False)
    assert time.perf_counter() - t0 < 5  # refused before the weights load
    res = subprocess.run([sys.executable, "-m", "ddtree_serve.server.cli.main", "serve", "--model-path", str(kimi_dir),
                          "--device", "cpu", "--no-trust-remote-code", "--port", str(free_port())],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr[-2000:]
    assert "trust_remote_code" in res.stderr and "Traceback" not in res.stderr


@pytest.fixture(scope="module")
def kimi_server(kimi_dir, tmp_path_factory):
    args = ["--model-path", str(kimi_dir), "--device", "cpu", "--dtype", "float32", "--tool-call-parser", "kimi_k2",
            "--reasoning-parser", "kimi_k2", "--max-total-tokens", "2048", "--log-level", "warning"]
    with running_server(args, tmp_path_factory.mktemp("kimi-server")) as srv:
        yield srv.base


def _chat(base: str, **extra) -> dict:
    body = {"model": httpx.get(f"{base}/v1/models", timeout=30).json()["data"][0]["id"], "messages": MESSAGES,
            "max_tokens": 6, "temperature": 0, **extra}
    r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _check_completion(resp: dict) -> None:
    assert resp["object"] == "chat.completion" and isinstance(resp["id"], str)
    choice = resp["choices"][0]
    assert choice["index"] == 0 and choice["finish_reason"] in ("stop", "length", "tool_calls")
    msg = choice["message"]
    assert msg["role"] == "assistant"
    assert isinstance(msg.get("content") or "", str)
    assert isinstance(msg.get("reasoning_content") or "", str)
    for call in msg.get("tool_calls") or []:
        assert call["type"] == "function" and isinstance(call["function"]["arguments"], str)
    usage = resp["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert 1 <= usage["completion_tokens"] <= 6


def test_http_chat_thinking_on_and_off(kimi_server, tok) -> None:
    on = _chat(kimi_server)
    off = _chat(kimi_server, chat_template_kwargs={"thinking": False})
    tooled = _chat(kimi_server, tools=TOOLS, chat_template_kwargs={"thinking": False})
    for resp in (on, off, tooled):
        _check_completion(resp)
    think = tok.encode("<think></think>", add_special_tokens=False)
    assert len(think) == 2
    assert off["usage"]["prompt_tokens"] - on["usage"]["prompt_tokens"] == len(think)
    assert on["usage"]["prompt_tokens"] == len(_manager(tok).encode_chat(MESSAGES, None, None))
    assert tooled["usage"]["prompt_tokens"] > off["usage"]["prompt_tokens"]
    assert off["choices"][0]["message"].get("reasoning_content") in (None, "")  # thinking off: all content
    # the content is exactly the model's greedy text for the same prompt ids (completions endpoint, no parsers)
    ids = _manager(tok).encode_chat(MESSAGES, None, {"thinking": False})
    plain = httpx.post(f"{kimi_server}/v1/completions", timeout=120,
                       json={"model": off["model"], "prompt": ids, "max_tokens": 6, "temperature": 0})
    assert plain.status_code == 200, plain.text
    assert plain.json()["usage"]["prompt_tokens"] == off["usage"]["prompt_tokens"]
    assert off["choices"][0]["message"]["content"] == plain.json()["choices"][0]["text"]


def test_http_chat_stream(kimi_server) -> None:
    body = {"model": "x", "messages": MESSAGES, "max_tokens": 4, "temperature": 0, "stream": True,
            "chat_template_kwargs": {"thinking": False}}
    body["model"] = httpx.get(f"{kimi_server}/v1/models", timeout=30).json()["data"][0]["id"]
    with httpx.stream("POST", f"{kimi_server}/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(ln[6:]) for ln in lines[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    reasons = [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch.get("finish_reason")]
    assert reasons and reasons[-1] in ("stop", "length")


def test_http_forced_call_cut_by_max_tokens_is_length(kimi_server) -> None:
    """A named forced call (kimi_k2 format) cut by a small max_tokens finishes ``length``, never ``tool_calls``,
    streamed and not, with the partial call's text kept (content or the cut arguments)."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    for max_tokens in (3, 8):
        resp = _chat(kimi_server, tools=TOOLS, tool_choice=named, max_tokens=max_tokens,
                     chat_template_kwargs={"thinking": False})
        choice = resp["choices"][0]
        assert choice["finish_reason"] == "length" and resp["usage"]["completion_tokens"] == max_tokens, resp
        msg = choice["message"]
        assert msg.get("content") or msg.get("tool_calls"), msg
        body = {"model": resp["model"], "messages": MESSAGES, "tools": TOOLS, "tool_choice": named, "temperature": 0,
                "max_tokens": max_tokens, "stream": True, "chat_template_kwargs": {"thinking": False}}
        with httpx.stream("POST", f"{kimi_server}/v1/chat/completions", json=body, timeout=120) as r:
            chunks = [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: {")]
        assert [c["finish_reason"] for ch in chunks for c in ch["choices"] if c.get("finish_reason")] == ["length"]
