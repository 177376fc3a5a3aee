"""Structured output after the reasoning, over HTTP, on a thinking model: a tiny random Kimi checkpoint with
the stand-in Kimi tokenizer (tests/server/kimi_tokenizer_files.py; ``</think>`` is one token), served with
``--reasoning-parser kimi_k2 --tool-call-parser kimi_k2`` and ``--speculative-algorithm ddtree`` (suffix
drafts: on this random model's text they rarely find anything, so most steps are the worker's plain steps;
exactness of verification across ``</think>`` is tests/speculative/test_grammar_spec.py's).

The random model would think for ever; its lm_head row of ``</think>`` is set to a scaled copy of the row of
a token it writes a few tokens into its free greedy reply, so that it ends its reasoning there by itself,
deterministically. Then: the reasoning (``reasoning_content``) is exactly the model's unconstrained greedy
text, the answer (``content``, or the forced ``tool_calls``) is valid for the schema, streaming and
non-streaming agree, and the served reply is the plain engine's greedy reply token for token. With thinking
off the grammar holds from the first token; ``reasoning_gate`` (ddtree_serve/server/http/serving_structured.py) leaves
the constraint as it is without a reasoning parser, without thinking, or without a single ``</think>``
token. The server tests are slow-marked (three loads of the tiny model and a server)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from ddtree_serve.server.engine import Engine, SamplingParams
from ddtree_serve.server.http.serving_structured import Constraint, reasoning_gate
from tests.model_executor.test_grammar_engine import check_json
from tests.server.conftest import running_server
from tests.server.kimi_tokenizer_files import special_token_ids, write_kimi_tokenizer, write_tiny_kimi

VOCAB = 512
MESSAGES = [{"role": "user", "content": "Is it sunny in Paris? Answer in JSON."}]
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
END_LIKE_AT = 4  # </think> takes the lm_head row of the first new token from here in the free reply (scaled)
SCALE = 1.03
MAX_TOKENS = 48
TOOL_MAX_TOKENS = 200
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}]  # in every prompt


def _prompt(tok, thinking: bool = True) -> list[int]:
    text = tok.apply_chat_template(MESSAGES, tools=TOOLS, add_generation_prompt=True, tokenize=False,
                                   thinking=thinking)
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
    before = _greedy(path, ids, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    at = next(i for i in range(END_LIKE_AT, 12) if before[i] not in before[:i])  # a token new in the reply
    _end_row_like(path, end, before[at])
    free = _greedy(path, ids, SamplingParams(temperature=0, max_tokens=at + 2, ignore_eos=True))
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
            "--speculative-algorithm", "ddtree", "--served-model-name", "m"]
    with running_server(args, tmp_path_factory.mktemp("thinker-server")) as srv:
        yield srv.base


def _body(constrained: bool = True, **extra) -> dict:
    body = {"model": "m", "messages": MESSAGES, "tools": TOOLS, "max_tokens": MAX_TOKENS, "temperature": 0, **extra}
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


@pytest.mark.slow
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


@pytest.mark.slow
def test_thinking_off_constrains_from_the_first_token(base) -> None:
    resp = _post(base, _body(chat_template_kwargs={"thinking": False}))
    msg = resp["choices"][0]["message"]
    assert msg.get("reasoning_content") in (None, "")
    check_json(msg["content"], SCHEMA)


@pytest.fixture(scope="module")
def kimi_tok(tmp_path_factory):
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("kimi-tok")
    write_kimi_tokenizer(path, VOCAB)
    return AutoTokenizer.from_pretrained(str(path), trust_remote_code=True)


def test_gate_needs_a_reasoning_parser_thinking_and_a_single_end_token(kimi_tok, default_model_path) -> None:
    from transformers import AutoTokenizer

    tok, end = kimi_tok, special_token_ids(VOCAB)["</think>"]
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



@pytest.mark.slow
def test_forced_tool_call_after_reasoning(base, thinker) -> None:
    """A forced call (named, not streamed; "required" with one call, streamed) follows the same free
    reasoning. The random model would write call-index digits for ever (the kimi_k2 grammar allows
    ``[0-9]+``): a logit bias against digit tokens lets it close the index (its greedy reasoning has no digit,
    so it is unchanged). It spells the call markers out of byte tokens (the grammar allows their text), hence
    the longer budget."""
    _, tok, thought, _, _ = thinker
    reasoning = tok.decode(thought[:-1]).removeprefix("<think>")
    digits = {str(i): -100 for i in range(VOCAB - 14) if tok.decode([i]).isdigit()}
    named = {"type": "function", "function": {"name": "get_weather"}}
    choice = _post(base, _body(constrained=False, logit_bias=digits, tool_choice=named,
                               max_tokens=TOOL_MAX_TOKENS))["choices"][0]
    msg = choice["message"]
    assert choice["finish_reason"] == "tool_calls", choice
    assert msg["reasoning_content"] == reasoning and not msg["content"]
    [call] = msg["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    check_json(call["function"]["arguments"], SCHEMA)
    body = _body(constrained=False, logit_bias=digits, tool_choice="required", parallel_tool_calls=False,
                 max_tokens=TOOL_MAX_TOKENS, stream=True)
    got: dict = {"reasoning": "", "args": "", "names": [], "finish": None}
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=300) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    got["reasoning"] += c["delta"].get("reasoning_content") or ""
                    for tc in c["delta"].get("tool_calls") or []:
                        got["names"] += [tc["function"]["name"]] if tc["function"].get("name") else []
                        got["args"] += tc["function"].get("arguments") or ""
                    got["finish"] = c.get("finish_reason") or got["finish"]
    assert got["reasoning"] == reasoning and got["names"] == ["get_weather"] and got["finish"] == "tool_calls", got
    check_json(got["args"], SCHEMA)
