"""Structured outputs end to end on the default model without speculation (the Engine over the real
scheduler): outputs parse and validate against their JSON schema (greedy and sampled), regex and EBNF
outputs match, free requests in the same batch are unaffected, retraction and abort keep the matcher
consistent, and a grammar that cannot compile is a ValueError at admission."""

from __future__ import annotations

import json
import re

import jsonschema_rs
import pytest

from ddtree_serve.server.engine import Engine, SamplingParams
from ddtree_serve.server.io_struct import GenerateReq

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Tokyo"]},
                                      "sunny": {"type": "boolean"}}, "required": ["city", "sunny"]},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1, "maxItems": 4},
    {"type": "object", "properties": {"ok": {"type": "boolean"},
                                      "tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
                                               "maxItems": 2}}, "required": ["ok", "tags"]},
]
PROMPTS = ["Describe a person as JSON:", "The weather report in JSON:", "List some digits:",
           "Answer with a JSON object:"]
MAX_TOKENS = 64


@pytest.fixture(scope="module")
def engine(default_model_path):
    e = Engine(default_model_path, dtype="float32", max_total_tokens=8192)
    yield e
    e.shutdown()


def check_json(text: str, schema: dict) -> None:
    jsonschema_rs.validate(schema, json.loads(text))


def _assert_idle(e: Engine) -> None:
    st = e.stats()
    assert st.kv_used_tokens == 0 and st.running == 0 and st.waiting == 0 and len(e.scheduler.grammars) == 0


@pytest.mark.parametrize("temperature", [0.0, pytest.param(1.0, marks=pytest.mark.slow)])
def test_json_schema_outputs_validate(engine, temperature):
    params = [SamplingParams(temperature=temperature, seed=7 + i, max_tokens=MAX_TOKENS, json_schema=json.dumps(s))
              for i, s in enumerate(SCHEMAS)]
    outs = engine.generate(PROMPTS, params)
    for o, s in zip(outs, SCHEMAS, strict=True):
        assert o.finish_reason == "stop", o.text
        check_json(o.text, s)
    _assert_idle(engine)


def test_json_object_regex_and_ebnf(engine):
    date = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]"
    ebnf = 'root ::= answer "."\nanswer ::= "yes" | "no" | "maybe"'
    outs = engine.generate(["Today's date is", "Is the sky blue? Answer:", "A JSON object:"], [
        SamplingParams(temperature=0, max_tokens=24, regex=date),
        SamplingParams(temperature=0.8, seed=1, max_tokens=8, ebnf=ebnf),
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, json_schema='{"type": "object"}'),
    ])
    assert re.fullmatch(date, outs[0].text) and outs[0].finish_reason == "stop"
    assert outs[1].text in ("yes.", "no.", "maybe.")
    assert isinstance(json.loads(outs[2].text), dict)


def test_free_requests_share_the_batch_unchanged(engine):
    free = SamplingParams(temperature=0, max_tokens=8)
    alone = engine.generate(["The capital of France is"], free)[0]
    mixed = engine.generate(["The capital of France is", PROMPTS[1]],
                            [free, SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                  json_schema=json.dumps(SCHEMAS[1]))])
    assert mixed[0].token_ids == alone.token_ids
    check_json(mixed[1].text, SCHEMAS[1])


@pytest.mark.slow  # a second engine; minutes on a loaded 2-core CPU
def test_retraction_keeps_the_matcher(engine, default_model_path, caplog):
    """A KV pool too small for the batch retracts requests mid-output (re-prefilled, output kept): the
    constrained outputs equal those of the roomy engine."""
    params = [SamplingParams(temperature=0, max_tokens=32, json_schema=json.dumps(SCHEMAS[i % 2])) for i in range(4)]
    prompts = PROMPTS[:2] * 2
    ref = engine.generate(prompts, params)
    small = Engine(default_model_path, dtype="float32", max_total_tokens=48)
    try:
        with caplog.at_level("INFO", logger="ddtree_serve.server.scheduling.scheduler"):
            got = small.generate(prompts, params)
        assert "retracted" in caplog.text, "the pool must force a retraction"
        assert [o.token_ids for o in got] == [o.token_ids for o in ref]
        _assert_idle(small)
    finally:
        small.shutdown()


def test_abort_in_grammar_queue_and_while_running(engine):
    sched = engine.scheduler
    params = SamplingParams(temperature=0, max_tokens=30, json_schema=json.dumps(SCHEMAS[0]))
    ids = engine.tokenizer.encode(PROMPTS[0])
    sched.add_request(GenerateReq("g-queued", ids, params))
    sched.abort_request("g-queued")  # still compiling or just compiled: never admitted
    outs = sched.step()
    assert [(o.rid, o.finish_reason) for o in outs if o.finished] == [("g-queued", "abort")]
    sched.add_request(GenerateReq("g-run", ids, params))
    while not sched.running:
        sched.step()
    sched.step()
    sched.abort_request("g-run")
    sched.step()
    _assert_idle(engine)


@pytest.mark.parametrize("kw", [{"json_schema": '{"type": "integer", "minimum": "x"}'}, {"regex": "([0-9]"},
                                {"ebnf": "root ::= nothing"}])
def test_uncompilable_grammar_rejected_at_admission(engine, kw):
    with pytest.raises(ValueError, match=f"^{next(iter(kw))} "):
        engine.generate(["hi"], SamplingParams(max_tokens=4, **kw))
    _assert_idle(engine)
