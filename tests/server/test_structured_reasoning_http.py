"""Structured output after the reasoning, over HTTP, on a thinking model: a tiny random Kimi checkpoint with
the stand-in Kimi tokenizer (tests/server/kimi_tokenizer_files.py; ``</think>`` is one token), served with
``--reasoning-parser kimi_k2 --tool-call-parser kimi_k2`` and DDTree speculation (suffix drafts).

The random model would think for ever; its lm_head row of ``</think>`` is set to a scaled copy of the row of
a token it writes a few tokens into its free greedy reply, so that it ends its reasoning there by itself,
deterministically. Then: the reasoning (``reasoning_content``) is exactly the model's unconstrained greedy
text, the answer (``content``) is JSON valid for the schema, streaming and non-streaming agree, and the
served (speculative) reply is the plain engine's greedy reply token for token. With thinking off, or for a
server without a reasoning parser (server/http/serving_structured.py ``reasoning_gate``), the grammar holds
from the first token."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from server.engine import Engine, SamplingParams
from server.http.serving_structured import Constraint, reasoning_gate
from tests.model_executor.test_grammar_engine import check_json
from tests.server.conftest import running_server
from tests.server.kimi_tokenizer_files import special_token_ids, write_tiny_kimi

VOCAB = 512
MESSAGES = [{"role": "user", "content": "Is it sunny in Paris? Answer in JSON."}]
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
END_LIKE_AT = 4  # </think> takes the lm_head row of the token the free reply has here (scaled up)
SCALE = 1.1
MAX_TOKENS = 48


def _prompt(tok, thinking: bool = True) -> list[int]:
    text = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False, thinking=thinking)
    return list(tok.encode(text, add_special_tokens=False))


def _greedy(path: Path, ids: list[int], params: SamplingParams) -> list[int]:
    e = Engine(str(path), device="cpu", dtype="float32", max_total_tokens=1024)
    try:
        return e.generate(input_ids=[ids], sampling_params=params)[0].token_ids
    finally:
        e.shutdown()


def _end_row_like(path: Path, end: int, like: int) -> None:
    """In place: lm_head row ``end`` := SCALE x row ``like`` (where ``like`` is the argmax with a positive
    logit, ``end`` now wins)."""
    from safetensors.torch import load_file, save_file

    f = path / "model.safetensors"
    tensors = load_file(str(f))
    w = tensors["language_model.lm_head.weight"]  # [V, H]
    w[end] = (w[like].float() * SCALE).to(w.dtype)
    save_file(tensors, str(f), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def thinker(tmp_path_factory):
    """(checkpoint, tokenizer, free greedy reply, plain greedy reply with the gated grammar, </think> id)."""
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("thinker") / "tiny-kimi"
    write_tiny_kimi(path, VOCAB)
    tok = AutoTokenizer.from_pretrained(str(path), trust_remote_code=True)
    end = special_token_ids(VOCAB)["</think>"]
    ids = _prompt(tok)
    before = _greedy(path, ids, SamplingParams(temperature=0, max_tokens=END_LIKE_AT + 1, ignore_eos=True))
    _end_row_like(path, end, before[END_LIKE_AT])
    free = _greedy(path, ids, SamplingParams(temperature=0, max_tokens=END_LIKE_AT + 4, ignore_eos=True))
    assert end in free and free.index(end) >= 2, f"the model must reason a little, then end: {free}"
    gated = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, json_schema=json.dumps(SCHEMA),
                           reasoning_end_ids=(end,))
    ref = _greedy(path, ids, gated)
    return path, tok, free[:free.index(end) + 1], ref, end


@pytest.fixture(scope="module")
def base(thinker, tmp_path_factory):
    path = thinker[0]
    args = ["--model-path", str(path), "--device", "cpu", "--dtype", "float32", "--tool-call-parser", "kimi_k2",
            "--reasoning-parser", "kimi_k2", "--max-total-tokens", "2048", "--log-level", "warning",
            "--speculative-algorithm", "ddtree"]
    with running_server(args, tmp_path_factory.mktemp("thinker-server")) as srv:
        yield srv.base


def _body(constrained: bool = True, **extra) -> dict:
    body = {"model": "m", "messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0, **extra}
    if constrained:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    return body


def _post(base: str, body: dict) -> dict:
    r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def _stream(base: str, body: dict) -> tuple[str, str, str | None]:
    reasoning, content, finish = "", "", None
    with httpx.stream("POST", f"{base}/v1/chat/completions", json={**body, "stream": True}, timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            for c in json.loads(line[6:])["choices"]:
                reasoning += c["delta"].get("reasoning_content") or ""
                content += c["delta"].get("content") or ""
                finish = c.get("finish_reason") or finish
    return reasoning, content, finish


def test_json_after_reasoning(base, thinker) -> None:
    _, tok, thought, ref, end = thinker
    free_text = tok.decode(thought[:-1])  # the model's own unconstrained text, up to </think>
    resp = _post(base, _body())
    choice = resp["choices"][0]
    msg = choice["message"]
    assert choice["finish_reason"] == "stop", resp
    assert msg["reasoning_content"] == free_text.removeprefix("<think>") and msg["reasoning_content"]
    check_json(msg["content"], SCHEMA)
    assert ref[:len(thought)] == thought and tok.decode(ref[len(thought):], skip_special_tokens=True) == msg["content"]
    assert resp["usage"]["completion_tokens"] == len(ref)
    assert _stream(base, _body()) == (msg["reasoning_content"], msg["content"], "stop")
    # unconstrained, the reasoning is the same text: the grammar is dormant until </think>
    free = _post(base, _body(constrained=False, max_tokens=len(thought)))["choices"][0]["message"]
    assert free["reasoning_content"] == msg["reasoning_content"]


def test_thinking_off_constrains_from_the_first_token(base) -> None:
    resp = _post(base, _body(chat_template_kwargs={"thinking": False}))
    msg = resp["choices"][0]["message"]
    assert msg.get("reasoning_content") in (None, "")
    check_json(msg["content"], SCHEMA)


def test_gate_needs_a_reasoning_parser_thinking_and_a_single_end_token(thinker, default_model_path) -> None:
    from transformers import AutoTokenizer

    tok, end = thinker[1], thinker[4]
    handoff = special_token_ids(VOCAB)["<|tool_calls_section_begin|>"]
    c = Constraint(json_schema=json.dumps(SCHEMA))
    gated = reasoning_gate(c, tok, "kimi_k2", thinking=True)
    assert gated.after_reasoning and gated.reasoning_end_ids == (end,) and gated.reasoning_handoff_ids == (handoff,)
    assert gated.fields()["reasoning_end_ids"] == (end,)
    r1 = reasoning_gate(c, tok, "deepseek-r1", thinking=True)
    assert r1.reasoning_end_ids == (end,) and r1.reasoning_handoff_ids == ()  # no tool section in that format
    assert reasoning_gate(c, tok, None, thinking=True) == c  # no reasoning parser: today's behaviour
    assert reasoning_gate(c, tok, "kimi_k2", thinking=False) == c
    assert reasoning_gate(Constraint(), tok, "kimi_k2", thinking=True) == Constraint()
    smol = AutoTokenizer.from_pretrained(default_model_path)  # "</think>" is several tokens there
    assert reasoning_gate(c, smol, "deepseek-r1", thinking=True) == c
