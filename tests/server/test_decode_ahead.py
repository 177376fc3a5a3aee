"""Plain decoding with the next forward launched before the tokens are read (server/scheduling/decode_ahead.py;
docs/DESIGN.md 4.17): on an accelerator (the runner made to report one here, as on a GPU) the output equals
plain decoding's token for token, greedy, seeded, penalties, logprobs, a grammar, stops and requests joining
mid-decode, with the forwards launched ahead used and discarded, and no KV slot left held."""

from __future__ import annotations

import pytest

from ddtree_serve.model_executor.model_runner import ModelRunner
from ddtree_serve.server.engine import Engine, SamplingParams
from ddtree_serve.server.scheduling import decode_ahead


def _params() -> list[SamplingParams]:
    """Requests that end at different steps (over three slots: the last three join mid-decode)."""
    return [SamplingParams(temperature=0, max_tokens=7),
            SamplingParams(temperature=0, max_tokens=20, stop_token_ids=(13, 30)),
            SamplingParams(temperature=0.7, top_p=0.9, seed=11, max_tokens=15, logprobs=2),
            SamplingParams(temperature=0, max_tokens=16, presence_penalty=0.5, frequency_penalty=0.3),
            SamplingParams(temperature=0.8, top_k=20, seed=5, max_tokens=11, stop_token_ids=(28,)),
            SamplingParams(temperature=0.6, seed=3, max_tokens=13, regex="[a-z ]{5,40}\\.")]


def _run(path: str, ids, params) -> list[tuple]:
    eng = Engine(path, dtype="float32", max_total_tokens=16384, max_running_requests=3)
    try:
        outs = []
        for _ in range(2):  # the second run hits the prefix cache
            outs.append([(o.token_ids, o.finish_reason, o.logprobs) for o in
                         eng.generate(input_ids=ids, sampling_params=params)])
        st = eng.stats()
        assert st.running == 0 and st.kv_used_tokens == 0
        assert eng.scheduler.runner.slots.num_free + st.cache_held_tokens == st.kv_total_tokens
        return outs
    finally:
        eng.shutdown()


def test_decode_ahead_equals_plain_decoding(default_model_path, monkeypatch) -> None:
    from benchmarks.common import CHAT_PROMPTS, chat_ids
    from ddtree_serve.server.process_utils import load_tokenizer

    ids = chat_ids(load_tokenizer(default_model_path), CHAT_PROMPTS)[:6]  # the tokenizer Engine loads, no engine
    params = _params()
    refs = _run(default_model_path, ids, params)
    seen = {"launched": 0, "released": 0}
    launch, release = decode_ahead.launch_ahead, decode_ahead.DecodeAhead.release

    def launched(*args):
        seen["launched"] += 1
        return launch(*args)

    def released(self, slots):
        seen["released"] += 1
        return release(self, slots)

    monkeypatch.setattr(ModelRunner, "accelerated", property(lambda self: True))
    monkeypatch.setattr(decode_ahead, "launch_ahead", launched)
    monkeypatch.setattr(decode_ahead.DecodeAhead, "release", released)
    assert _run(default_model_path, ids, params) == refs
    assert seen["launched"] > 2 * seen["released"] > 0, seen  # mostly used; dropped when the batch changed


@pytest.mark.parametrize("batch", [1, 8])
def test_simulated_plain_decode_ahead_is_the_known_continuation(tmp_path, batch: int, monkeypatch) -> None:
    """Under the simulated device (an accelerator: the step launches ahead) with graphs, requests ending at
    different steps: the known continuation, forwards launched ahead, no slot held."""
    from ddtree_serve.model_executor.models.simulated import greedy_continuation
    from ddtree_serve.sim.checkpoint import write_simulated_pair

    target, _ = write_simulated_pair(tmp_path, vocab=512)
    prompts = [[(7 * i + j) % 500 + 1 for j in range(5 + i % 3)] for i in range(batch + 2)]
    n = 20
    refs = [greedy_continuation(p, n, 512) for p in prompts]
    params = [SamplingParams(temperature=0, max_tokens=n - i % 5, ignore_eos=True) for i in range(len(prompts))]
    launched = []
    launch = decode_ahead.launch_ahead
    monkeypatch.setattr(decode_ahead, "launch_ahead", lambda *a: launched.append(1) or launch(*a))
    eng = Engine(target, device="cpu", dtype="float32", max_running_requests=batch, max_total_tokens=4096,
                 cuda_graph_max_bs=8)
    try:
        outs = eng.generate(input_ids=prompts, sampling_params=params)
        assert [o.token_ids for o in outs] == [r[:p.max_tokens] for r, p in zip(refs, params, strict=True)]
        assert eng.stats().kv_used_tokens == 0 and len(launched) >= n - 1
    finally:
        eng.shutdown()


def test_disable_overlap_schedule_runs_every_step_serially(tmp_path, monkeypatch) -> None:
    """``--disable-overlap-schedule`` launches nothing ahead of a read, plain or speculative (the same outputs)."""
    from ddtree_serve.model_executor.models.simulated import greedy_continuation
    from ddtree_serve.sim.checkpoint import write_simulated_pair

    target, drafter = write_simulated_pair(tmp_path, vocab=512)
    prompts = [[(5 * i + j) % 500 + 1 for j in range(6)] for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    launched = []
    launch = decode_ahead.launch_ahead
    monkeypatch.setattr(decode_ahead, "launch_ahead", lambda *a: launched.append(1) or launch(*a))
    spec = dict(speculative_algorithm="ddtree", speculative_draft_model_path=drafter, ddtree_budget=8,
                speculative_draft_sources="dflash")
    for kw in ({}, spec):
        eng = Engine(target, device="cpu", dtype="float32", max_running_requests=4, max_total_tokens=4096,
                     disable_overlap_schedule=True, **kw)
        try:
            outs = eng.generate(input_ids=prompts, sampling_params=params)
            assert [o.token_ids for o in outs] == [greedy_continuation(p, 16, 512) for p in prompts]
            assert not launched and (not kw or eng.scheduler.spec.ahead_taken == 0)
            if kw:
                assert sum(o.spec_accepted_tokens for o in outs) > 0
        finally:
            eng.shutdown()
