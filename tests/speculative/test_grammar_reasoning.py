"""A grammar behind a reasoning gate under speculation (default model): greedy DDTree output equals plain
greedy output token for token when accepted draft paths cross the end of the reasoning, with scripted drafts
(tests/speculative/scripted_drafts.py) whose accepted paths run through the end token at depth 2 and on
into the grammar. The reasoning (before the end token) is the model's free greedy text; the answer after it
is valid JSON for the schema.

The end-of-reasoning token here is a token the model itself writes early in its free greedy text (the
default model has no ``</think>`` token): the gate only knows a token id, so the state machine under test
is the one a thinking model's ``</think>`` drives."""

from __future__ import annotations

import json

import pytest

from server.engine import Engine, SamplingParams
from tests.model_executor.test_grammar_engine import SCHEMAS, check_json
from tests.speculative.scripted_drafts import install

PROMPT = "The weather report in JSON:"
SCHEMA = SCHEMAS[1]  # {"city": enum, "sunny": boolean}: a bounded answer
END_AT = 6  # output position of the end token
DEPTH = 4  # scripted chain depth


@pytest.fixture(scope="module")
def engines(default_model_path):
    plain = Engine(default_model_path, dtype="float32", max_total_tokens=4096)
    spec = Engine(default_model_path, dtype="float32", max_total_tokens=4096, speculative_algorithm="ddtree",
                  draft_sources="suffix", ddtree_budget=8)
    yield plain, spec
    plain.shutdown()
    spec.shutdown()


def crossing_script(ref: list[int], end_at: int, vocab: int):
    """Drafts around ``ref`` (the plain output): before the end token, a correct chain that makes a step
    start at ``end_at - 1``; from there a correct chain of ``DEPTH`` (the end token at depth 2, grammar tokens
    below it); every tree also holds a wrong sibling at depth 1 and one below the chain's first node."""

    def script(prompt: list[int], output: list[int], max_depth: int) -> list[tuple[int, int]]:
        k = len(output)
        if output != ref[:k] or k >= len(ref):
            return []
        n = DEPTH if k >= end_at - 1 else end_at - 2 - k  # accepted n, then the bonus: the next step at end_at - 1
        chain = ref[k:k + n]
        if not chain:
            return []
        nodes = [(i, t) for i, t in enumerate(chain)]  # node i + 1 under node i (0: root)
        nodes.append((0, (chain[0] + 1) % vocab))
        if len(chain) > 1:
            nodes.append((1, (chain[1] + 1) % vocab))
        return nodes

    return script


def test_greedy_ddtree_equals_plain_across_the_end_of_reasoning(engines):
    plain, spec = engines
    vocab = plain.tokenizer.vocab_size
    free = plain.generate(PROMPT, SamplingParams(temperature=0, max_tokens=END_AT + 1))[0].token_ids
    end = free[END_AT]
    assert end not in free[:END_AT], "pick a position whose token is new in the free text"
    sp = SamplingParams(temperature=0, max_tokens=64, json_schema=json.dumps(SCHEMA), reasoning_end_ids=(end,))
    ref = plain.generate(PROMPT, sp)[0]
    assert ref.finish_reason == "stop"
    assert ref.token_ids[:END_AT + 1] == free, "the reasoning is the free greedy text"
    answer = plain.tokenizer.decode(ref.token_ids[END_AT + 1:], skip_special_tokens=True)
    check_json(answer, SCHEMA)

    log = install(spec, crossing_script(ref.token_ids, END_AT, vocab))
    starts: list[tuple[int, int]] = []  # (output length before the step, accepted nodes)
    worker = getattr(spec.scheduler, "scheduler", spec.scheduler).spec  # as ``install`` finds it
    inner = worker.decode

    def decode(reqs, eos_ids):
        before = [len(q.output_ids) for q in reqs]
        out = inner(reqs, eos_ids)
        starts.extend(zip(before, (r.accepted for r in out), strict=True))
        return out

    worker.decode = decode
    got = spec.generate(PROMPT, sp)[0]
    assert got.token_ids == ref.token_ids and got.finish_reason == "stop"
    log.assert_accepted(min_depth=2)
    # a step whose accepted path holds the end token and grammar tokens after it
    assert any(k <= END_AT and k + a - 1 >= END_AT + 1 for k, a in starts), starts
    st = spec.stats()
    assert st.kv_used_tokens == 0 and st.running == 0
