"""Suffix drafts end to end (issue 32): lossless greedy output on copy-heavy and ordinary prompts, alone and
merged with DFlash, at batch 1 and in mixed batches; the sampled law with suffix nodes on accepted paths; a
ddtree server without a drafter; the shared index's cap and release on finish and abort."""

from __future__ import annotations

import pytest

from ddtree_serve.server.engine import Engine, SamplingParams
from ddtree_serve.server.io_struct import GenerateReq
from ddtree_serve.speculative.suffix_index import SEPARATOR
from tests.speculative.test_spec_engine import (
    VOCAB,
    _assert_pool_full,
    _exact_joint,
    assert_follows_law,
    tiny,
)

__all__ = ["tiny"]  # the fixture, shared with test_spec_engine

CODE = '''def fibonacci(n):
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a

def main():
    for i in range(10):
        print(i, fibonacci(i))
'''
COPY = ["Repeat this code exactly:\n```python\n" + CODE + "```",
        'Return this JSON unchanged: {"name": "ddtree", "version": 3, "tags": ["fast", "exact"], "ok": true}']
CHAT = ["What is the capital of France?", "Write a haiku about the sea."]
# their plain greedy outputs: the session fixture ``copy_chat_ref`` (tests/speculative/conftest.py), shared with
# test_suffix_gate.py


def _engine(model: str, **kw) -> Engine:
    return Engine(model, dtype="float32", max_total_tokens=16384, **kw)


def _chat_ids(engine: Engine, prompts: list[str]) -> list[list[int]]:
    from benchmarks.common import chat_ids

    return chat_ids(engine.tokenizer, prompts)


def _assert_released(e: Engine) -> None:
    spec = e.scheduler.spec
    assert not spec.suffix.own, "every request's suffix index is freed with the request"
    _assert_pool_full(e)


@pytest.mark.parametrize(("sources", "budget"), [
    ("suffix", 8), ("dflash,suffix", 8),
    pytest.param("dflash,suffix", "auto", marks=pytest.mark.slow),  # the default suite's auto + dflash,suffix
])  # path: test_adaptive_engine::test_auto_greedy_lossless_shipped_drafter, test_seeded_lossless (auto)
def test_greedy_lossless_copy_and_chat_default_model(default_model_path, copy_chat_ref, sources, budget):
    """Equal to plain decoding in a mixed batch (copy and chat prompts) and at batch 1. With a fixed budget every
    copy request accepts suffix nodes on paths of depth >= 2; the auto budget's choices depend on measured
    timings, so there only equality and some suffix acceptance on the copies are asserted. The auto case is
    marked slow: the default suite runs the auto budget with the shipped drafter and suffix drafts merged
    (``auto`` sources) in test_adaptive_engine::test_auto_greedy_lossless_shipped_drafter (greedy, equal to
    plain, depth-2 paths accepted) and test_seeded_lossless::test_auto_and_suffix_only_seeded_equal_plain[auto]
    (seeded and mixed batches, repeated requests copied through the suffix index)."""
    ids, ref = copy_chat_ref
    sp = SamplingParams(temperature=0, max_tokens=40)
    kw = {"draft_model_path": "default"} if "dflash" in sources else {}
    if budget == "auto":  # small trees (CPU time), as test_adaptive_engine's shipped-drafter case: the controller
        kw["ddtree_max_budget"] = 8  # still chooses each step among plain, suffix-only and drafted trees
    e = _engine(default_model_path, speculative_algorithm="ddtree", draft_sources=sources, ddtree_budget=budget,
                **kw)
    assert e.config.speculative.draft_sources == sources
    mixed = e.generate(input_ids=ids, sampling_params=sp)  # copy and chat prompts in one batch
    assert [o.token_ids for o in mixed] == ref
    e.scheduler.spec.suffix.shared.__init__(e.scheduler.spec.suffix.config)  # batch 1 without the outputs above
    single = [e.generate(input_ids=[i], sampling_params=sp)[0] for i in ids[:2]]  # batch 1
    assert [o.token_ids for o in single] == ref[:2]
    copies = mixed[:2] + single
    assert all(o.spec_accepted_suffix <= o.spec_accepted_tokens for o in mixed + single)
    if budget == "auto":
        assert sum(o.spec_accepted_suffix for o in copies) > 0
    else:
        assert all(o.spec_accepted_suffix > 0 for o in copies), [o.spec_accepted_suffix for o in copies]
        assert max(o.acceptance_length for o in copies) > 2.0  # paths of depth >= 2 accepted
    _assert_released(e)
    e.shutdown()


def test_ddtree_without_a_drafter_is_suffix_only(tiny):
    target, _ = tiny
    prompt = [3, 7, 1, 9, 4, 4, 2, 3, 7, 1, 9, 4, 4, 2, 3, 7, 1]
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    ref = _engine(target, speculative_algorithm="none").generate(input_ids=[prompt], sampling_params=sp)
    e = _engine(target, speculative_algorithm="ddtree", ddtree_budget=8)  # no drafter path
    spec = e.scheduler.spec
    assert e.config.speculative.draft_sources == "suffix" and spec.drafter is None and spec.draft_kv is None
    assert spec.capture_layer_ids == () and spec.draft_kv_bytes_per_token == 0
    got = e.generate(input_ids=[prompt], sampling_params=sp)
    assert got[0].token_ids == ref[0].token_ids
    assert got[0].spec_accepted_suffix == got[0].spec_accepted_tokens > 0
    _assert_released(e)


def test_sampled_law_with_suffix_nodes(tiny):
    """Joint law of tokens 2-3 (drafts of one speculative step) with trees merged from DFlash and suffix drafts, on a
    prompt whose earlier text holds the target's likely continuation (so suffix nodes are offered and accepted
    at depths 1 and 2). The same statistics as test_spec_engine's law tests (N = 3000, chi-square p > 1e-3,
    total variation within 0.05 of plain sampling's)."""
    target, drafter = tiny
    head = [3, 7, 1, 9]
    plain = _engine(target, speculative_algorithm="none", max_running_requests=512)
    cont = plain.generate(input_ids=[head], sampling_params=SamplingParams(temperature=0, max_tokens=8,
                                                                           ignore_eos=True))[0].token_ids
    prompt = head + cont + head
    temperature = 0.4
    exact = _exact_joint(target, prompt, temperature, -1, 1.0)  # [V, V]
    n = 3000
    # max_tokens 4: the first speculative step may accept a depth-2 path (t2, t3) and add t4 as its bonus
    params = [SamplingParams(temperature=temperature, seed=s, max_tokens=4, ignore_eos=True) for s in range(n)]
    e = _engine(target, speculative_algorithm="ddtree", draft_model_path=drafter, draft_sources="dflash,suffix",
                ddtree_budget=8, max_running_requests=512)
    outs = e.generate(input_ids=[prompt] * n, sampling_params=params)
    suffix_acc = sum(o.spec_accepted_suffix for o in outs)
    assert suffix_acc > n // 10, suffix_acc  # measured: 798
    assert sum(o.spec_accepted_tokens - o.spec_accepted_suffix for o in outs) > 0  # DFlash nodes accepted too
    depth2 = sum(o.spec_verify_steps == 1 and o.spec_plain_steps == 0 and o.spec_accepted_tokens == 2 for o in outs)
    assert depth2 > 10, depth2  # depth-2 paths accepted in the first step (measured: 17)
    ref = plain.generate(input_ids=[prompt] * n, sampling_params=params)
    assert exact.shape == (VOCAB, VOCAB)
    assert_follows_law(outs, ref, exact)
    _assert_released(e)


def test_shared_index_cap_and_release_on_finish_and_abort(tiny):
    target, _ = tiny
    e = _engine(target, speculative_algorithm="ddtree", ddtree_budget=4, suffix_cache_tokens=32)
    spec = e.scheduler.spec
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = e.generate(input_ids=[[1, 2, 3], [4, 5, 6, 7], [8, 9, 10], [2, 2, 2, 5]], sampling_params=sp)
    shared = spec.suffix.shared
    assert 0 < shared.num_tokens <= 32
    kept = [t for t in shared.index.tokens if t != SEPARATOR]
    assert kept and set(kept) <= {t for o in outs for t in o.token_ids}  # finished outputs only
    _assert_released(e)
    # an aborted request's index is freed and its output does not join the shared index
    before = list(shared.index.tokens)
    sch = e.scheduler
    sch.add_request(GenerateReq("x", [6, 6, 1, 6, 6], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)))
    for _ in range(4):
        sch.step()
    assert "x" in spec.suffix.own
    sch.abort_request("x")
    sch.step()
    assert shared.index.tokens == before
    _assert_released(e)


def test_a_repeated_request_drafts_as_deep_as_its_match(tiny):
    """Issue 47 item 5: the second time a request comes, the shared index holds its answer; the match grows past
    the n-gram tables' length (the proposer's run) and the drafts go as deep as it is long (up to the budget):
    more tokens per verify step than the old 12-level cap allowed, and the output still equals plain's."""
    target, _ = tiny
    prompt = [5, 9, 2, 8, 1]
    sp = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    ref = _engine(target, speculative_algorithm="none").generate(input_ids=[prompt], sampling_params=sp)[0]
    e = _engine(target, speculative_algorithm="ddtree", ddtree_budget=64)  # suffix drafts alone
    first = e.generate(input_ids=[prompt], sampling_params=sp)[0]
    second = e.generate(input_ids=[prompt], sampling_params=sp)[0]
    assert first.token_ids == second.token_ids == ref.token_ids
    assert second.spec_accepted_suffix == second.spec_accepted_tokens
    assert second.acceptance_length > 13, (second.acceptance_length, first.acceptance_length)
    _assert_released(e)
