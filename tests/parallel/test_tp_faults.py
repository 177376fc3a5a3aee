"""Faults under TP=2 (gloo, 2 processes), through the offline Engine (ddtree_serve/server/scheduling/step_recovery.py,
ddtree_serve/server/tp/protocol.py, ddtree_serve/server/tp/step_agreement.py).

- A step that raises on every rank (the test-only fault hook, ddtree_serve/server/scheduling/fault_injection.py, armed in rank 0
  and in the follower: the target forward, the drafter forward, the speculative commit) fails that step's
  requests with a clear error; a request streaming meanwhile finishes with its reference tokens, later
  requests too; rank 0 holds no KV afterwards, and the consistency check at shutdown (which hashes the
  KV state of every rank) passes: the follower recovered to the same state.
- The drafter has one KV head, fewer than the ranks: it loads and runs unsharded on both ranks
  (``drafter_group``), and speculative greedy output equals plain TP=1 output.
- A forward that fails on one rank only (``forward@1:N``, then ``forward@0:N``: before the forward's
  collectives, as an out-of-memory there would) and a step that fails on rank 0 alone after the step's last
  collective (its sampler) are agreed by every rank: the step's requests fail with an error naming the
  rank, in seconds (not the 120 s collective timeout), and serving goes on with identical states.
- A fault on rank 0 alone between two collectives of a forward cannot be agreed (the follower waits in a
  collective rank 0 never joins): rank 0 raises ``TPRankError`` within the agreement's grace, not the
  collective timeout, and the follower exits.
- Ranks whose outputs differ (rank 0's tokens altered) are caught by the consistency check: ``TPDivergence``.
"""

from __future__ import annotations

import time

import pytest

from ddtree_serve.model_executor.sampling_params import SamplingParams
from ddtree_serve.server.engine import Engine
from ddtree_serve.server.scheduling.fault_injection import TEST_FAULT_ENV
from ddtree_serve.server.tp.errors import TPDivergence, TPRankError

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
GOOD = [[5, 17, 42, 99, 7, 3], [11, 23, 31, 47, 59]]


def _engine(model: str, **kw) -> Engine:
    return Engine(model, device="cpu", dtype="float32", max_total_tokens=512, max_running_requests=4, **kw)


def _good_request_decoding(eng: Engine):  # noqa: ANN202
    """Start the good request streaming and return (its stream, its first tokens): it is decoding when a bad
    request fails in its prefill."""
    stream = eng.generate_stream(input_ids=[GOOD[0]], sampling_params=GREEDY)
    got: list[int] = []
    for d in stream:
        got += d.token_ids
        if len(got) >= 2:
            break
    return stream, got


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from tests.conftest import write_tiny_llama_family
    from tests.speculative.drafter_utils import write_random_drafter

    target = write_tiny_llama_family(tmp_path_factory.mktemp("tiny-llama"), "llama")
    drafter = write_random_drafter(target, tmp_path_factory.mktemp("drafter"), num_layers=1, block_size=4,
                                   num_key_value_heads=1)  # fewer KV heads than TP ranks
    ref = _engine(target)
    try:
        refs = [o.token_ids for o in ref.generate(input_ids=GOOD, sampling_params=GREEDY)]
    finally:
        ref.shutdown()
    seen = {t for ids in GOOD + refs for t in ids}
    bad = [t for t in range(100, 250) if t not in seen][:3]  # fault tokens no good request ever holds
    return target, drafter, refs, bad


def _no_kv_held(eng: Engine) -> None:
    s = eng.scheduler.scheduler  # rank 0's Scheduler
    slots = s.runner.slots
    assert not s.running and not s.waiting
    assert slots.num_free + s.kv.cached_tokens == slots.num_slots  # every slot free or a cached prefix
    assert set(slots.allocated().tolist()) == set(s.kv.tree.held_slots().tolist())
    assert slots.num_free_rows == slots.max_rows


def test_tp2_failed_steps_fail_their_requests_and_serving_goes_on(models) -> None:
    target, drafter, refs, (t_fwd, t_draft, t_commit) = models
    with pytest.MonkeyPatch.context() as mp:  # the follower inherits the environment
        mp.setenv(TEST_FAULT_ENV, f"forward:{t_fwd},drafter:{t_draft},commit:{t_commit}")
        eng = _engine(target, tp_size=2, speculative_algorithm="ddtree", draft_model_path=drafter,
                      ddtree_budget=4)
    try:
        assert eng.scheduler.scheduler.spec.drafter.tp.size == 1  # 1 KV head < 2 ranks: unsharded
        stream, got = _good_request_decoding(eng)
        with pytest.raises(RuntimeError, match="scheduler step running this request failed") as e:
            eng.generate(input_ids=[[3, t_fwd, 9]], sampling_params=GREEDY)
        assert "injected step failure (forward" in str(e.value)
        for d in stream:
            got += d.token_ids
        assert got == refs[0]
        for site, tok in (("drafter", t_draft), ("commit", t_commit)):  # both fail in the first verify step
            with pytest.raises(RuntimeError, match=f"injected step failure \\({site}"):
                eng.generate(input_ids=[[4, tok, 8, 2]], sampling_params=GREEDY)
            _no_kv_held(eng)
        outs = eng.generate(input_ids=GOOD, sampling_params=GREEDY)
        assert [o.token_ids for o in outs] == refs
        assert sum(o.spec_verify_steps for o in outs) > 0  # the verify path ran after the failures
        _no_kv_held(eng)
    finally:
        eng.shutdown()  # the last consistency check: raises TPDivergence if the follower's state differs
    assert [p.exitcode for p in eng.scheduler.followers] == [0]


def _serves_on(eng: Engine, refs: list[list[int]]) -> None:
    outs = eng.generate(input_ids=GOOD, sampling_params=GREEDY)
    assert [o.token_ids for o in outs] == refs
    _no_kv_held(eng)


def test_tp2_one_rank_forward_faults_are_agreed_and_serving_goes_on(models) -> None:
    target, _, refs, (t_rank1, t_rank0, _) = models
    with pytest.MonkeyPatch.context() as mp:  # the follower inherits the environment
        mp.setenv(TEST_FAULT_ENV, f"forward@1:{t_rank1},forward@0:{t_rank0}")
        eng = _engine(target, tp_size=2)
    try:
        stream, got = _good_request_decoding(eng)
        for rank, tok in ((1, t_rank1), (0, t_rank0)):
            start = time.monotonic()
            with pytest.raises(RuntimeError, match=f"step failed on TP rank {rank} of 2") as e:
                eng.generate(input_ids=[[3, tok, 9]], sampling_params=GREEDY)
            assert time.monotonic() - start < 30  # agreed at once, not after the 120 s collective timeout
            assert f"injected step failure (forward@{rank}, token {tok})" in str(e.value)
        for d in stream:
            got += d.token_ids
        assert got == refs[0]
        _serves_on(eng, refs)
    finally:
        eng.shutdown()  # the last consistency check: raises TPDivergence if the follower's state differs
    assert [p.exitcode for p in eng.scheduler.followers] == [0]


def test_tp2_rank0_failure_after_the_last_collective_is_agreed(models) -> None:
    target, _, refs, _ = models
    eng = _engine(target, tp_size=2)
    rank0 = eng.scheduler.scheduler
    sample = rank0._sample_device  # prefill and decode sample through it
    calls = []

    def fail_once(reqs, logits, shard):  # noqa: ANN001, ANN202 - after the step's last collective, on rank 0 only
        calls.append(1)
        tokens = sample(reqs, logits, shard)  # vocabulary-parallel sampling exchanges per-shard statistics
        if len(calls) == 2:  # the first decode step: the follower runs it to the end
            raise RuntimeError("rank 0 alone fails")
        return tokens

    rank0._sample_device = fail_once
    try:
        with pytest.raises(RuntimeError, match="step failed on TP rank 0 of 2 \\(rank 0: RuntimeError: rank 0 alone"):
            eng.generate(input_ids=[GOOD[0]], sampling_params=GREEDY)
        _no_kv_held(eng)
        _serves_on(eng, refs)
    finally:
        eng.shutdown()
    assert [p.exitcode for p in eng.scheduler.followers] == [0]


def test_tp2_one_rank_fault_between_collectives_ends_the_engine_in_seconds(models) -> None:
    target, _, _, _ = models
    eng = _engine(target, tp_size=2)
    eng.scheduler._agreement.grace_s = 2.0
    armed = [True]

    def fail(module, args):  # noqa: ANN001, ANN202 - rank 0's first MLP: after the embedding's and attention's all-reduces
        if armed[0]:
            armed[0] = False
            raise RuntimeError("rank 0 fails inside its forward")

    eng.scheduler.scheduler.runner.model.layers[0].mlp.register_forward_pre_hook(fail)
    start = time.monotonic()
    try:
        with pytest.raises(TPRankError, match="never joins"):
            eng.generate(input_ids=[GOOD[0]], sampling_params=GREEDY)
        assert time.monotonic() - start < 30
    finally:
        eng.shutdown()
    assert time.monotonic() - start < 40  # the follower, waiting in the forward's collective, failed at once
    assert [p.exitcode for p in eng.scheduler.followers] == [1]


@pytest.mark.slow
def test_tp2_diverged_outputs_are_detected(models) -> None:
    target, _, _, _ = models
    eng = _engine(target, tp_size=2)
    rank0 = eng.scheduler.scheduler
    sample = rank0._sample_device  # prefill and decode sample through it
    rank0._sample_device = lambda reqs, logits, shard: (sample(reqs, logits, shard) + 1) % 200  # rank 0's differ
    try:
        with pytest.raises(TPDivergence, match="diverged"):
            eng.generate(input_ids=GOOD, sampling_params=SamplingParams(temperature=0, max_tokens=40,
                                                                        ignore_eos=True))
    finally:
        eng.shutdown()
