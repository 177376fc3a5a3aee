"""The simulated device (ddtree_serve/sim/): exact where it can be. Greedy output under it, plain and DDTree, equals
the synthetic target's known continuation at batch 1, 32 and 128 with drafts accepted; the drafter's
acceptance follows its ``accept_prob``; the clock runs device work off the host thread; the cost model holds its
calibration points."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from ddtree_serve.model_executor.models.simulated import greedy_continuation
from ddtree_serve.server.engine import Engine, SamplingParams
from ddtree_serve.sim.checkpoint import write_simulated_pair
from ddtree_serve.sim.device_clock import DeviceClock
from ddtree_serve.sim.machines import MACHINES, DeviceCostModel
from tests.speculative.scripted_drafts import install

VOCAB = 512
N_TOKENS = 24


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return write_simulated_pair(tmp_path_factory.mktemp("sim"), vocab=VOCAB, accept_prob=0.8)


@pytest.mark.parametrize("batch", [1, 32, 128])
def test_greedy_equals_the_known_continuation(pair, batch: int) -> None:
    target, drafter = pair
    prompts = [[(7 * i + j) % 500 + 1 for j in range(5 + i % 3)] for i in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=N_TOKENS, ignore_eos=True)
    kw = dict(device="cpu", dtype="float32", max_running_requests=batch, max_total_tokens=batch * 64 + 1024,
              disable_radix_cache=True)
    for spec in ({}, dict(speculative_algorithm="ddtree", speculative_draft_model_path=drafter, ddtree_budget=16,
                          speculative_draft_sources="dflash")):
        eng = Engine(target, **kw, **spec)
        log = install(eng, None) if spec else None  # every speculative step's accepted nodes
        try:
            outs = eng.generate(input_ids=prompts, sampling_params=params)
            assert [o.token_ids for o in outs] == [greedy_continuation(p, N_TOKENS, VOCAB) for p in prompts]
            if spec:
                accepted = [o.spec_accepted_tokens for o in outs]
                assert min(accepted) > 0 and sum(accepted) >= batch * N_TOKENS // 2, accepted
                assert max(log.accepted) >= 2, "no path of depth >= 2 accepted"
            clock = eng.scheduler.runner.model.clock
            assert clock.launches > 0 and clock.device_s > 0
        finally:
            eng.shutdown()


def test_acceptance_follows_accept_prob(tmp_path) -> None:
    """More often right, more tokens per step: tau rises with accept_prob (the same prompts, budget 16)."""
    prompts = [[i + 1, 2, 3] for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    taus = []
    for p in (0.55, 0.95):  # (a calibrated drafter: below 0.5 its second token is the likelier one)
        target, drafter = write_simulated_pair(tmp_path / str(p), vocab=VOCAB, accept_prob=p)
        eng = Engine(target, device="cpu", dtype="float32", max_running_requests=8, max_total_tokens=4096,
                     disable_radix_cache=True, speculative_algorithm="ddtree", speculative_draft_model_path=drafter,
                     ddtree_budget=16, speculative_draft_sources="dflash")
        try:
            outs = eng.generate(input_ids=prompts, sampling_params=params)
            steps = sum(o.spec_verify_steps for o in outs)
            taus.append(sum(len(o.token_ids) for o in outs) / steps)
        finally:
            eng.shutdown()
    assert taus[0] + 2.0 < taus[1], taus


def test_clock_runs_off_the_host_thread() -> None:
    clock = DeviceClock(DeviceCostModel())
    t0 = time.perf_counter()
    clock.launch(0.05, kernels=1, graphed=True)
    clock.launch(0.05, kernels=1, graphed=True)  # queued behind the first
    assert time.perf_counter() - t0 < 0.05  # launches return at once
    clock.wait()
    assert time.perf_counter() - t0 >= 0.1 and clock.device_s == pytest.approx(0.1)
    assert clock.waited_s > 0


def test_clock_charges_and_refunds_move_the_host_clock() -> None:
    """Host time the CPU did not spend is charged, device work it did spend is refunded; a wait blocks until the
    device is done on the corrected clock, so a refund made while a forward runs hides nothing."""
    clock = DeviceClock(DeviceCostModel(launch_us=100.0, graph_launch_us=10.0))
    n0 = clock.now()
    clock.launch(0.0, kernels=50, graphed=False)  # 50 eager launches: 5 ms of host time
    assert clock.now() - n0 >= 0.005 and clock.counters.launches == 50
    clock.launch(0.0, kernels=50, graphed=True)  # one replay
    assert clock.counters.launches == 51
    clock.launch(0.03, kernels=1, graphed=True)
    time.sleep(0.01)
    clock.refund(0.01)  # the CPU ran device work for 10 ms: the host clock did not move
    t0 = time.perf_counter()
    clock.wait()
    assert time.perf_counter() - t0 >= 0.025  # still ~30 ms of device work left on the host's clock


def test_cost_models_calibration_and_shape() -> None:
    """The PCIe model with gathered logits (vLLM's) reproduces users' vLLM figures for K2.x on 8x RTX PRO 6000
    (~10 ms at batch 1, ~57 ms at 128: machines.py), within 10%; the NVLink machine is faster everywhere; expert
    reads grow concavely; a wide verify is far costlier than a decode step; the logits gather grows with rows,
    and vocabulary-parallel logits (the default) exchange O(1) bytes a row but for logprob rows."""
    pcie, nvl = MACHINES["rtx-pro-6000"], MACHINES["b300"]
    gathered = replace(pcie, vocab_parallel=False)
    assert 9.0 <= gathered.target_s(1, 0, 1) * 1e3 <= 11.0
    assert 52.0 <= gathered.target_s(128, 0, 128) * 1e3 <= 63.0
    for t in (1, 17, 128, 128 * 17):
        assert nvl.target_s(t, 0, t) < pcie.target_s(t, 0, t)
    e = [pcie.expert_bytes(t) for t in (1, 2, 4, 8, 16, 32, 64, 128, 256)]
    steps = [b - a for a, b in zip(e, e[1:], strict=False)]
    assert all(x > 0 for x in steps) and all(b < 2 * a for a, b in zip(steps, steps[1:], strict=False))  # concave
    assert pcie.expert_bytes(10**6) <= 384 * 60 * 3 * 7168 * 2048 * 0.5625 / 8 * 1.0001  # at most every expert
    assert gathered.target_s(128 * 65, 0, 128 * 65) > 5 * gathered.target_s(128, 0, 128)
    assert gathered.target_s(128 * 17, 0, 128 * 17) - pcie.target_s(128 * 17, 0, 128 * 17) > 0.02
    assert pcie.logits_bytes_per_row("greedy") == 16 and gathered.logits_bytes_per_row("greedy") == 163840 * 4
    assert pcie.logits_bytes_per_row("seeded") < 20e3 and pcie.logits_bytes_per_row("logprobs") == 163840 * 4
    all_lp = pcie.target_s(128 * 17, 0, 128 * 17, logprob_rows=128 * 17)  # logprob rows are gathered whole
    n = 128 * 17  # plus every row's argmax exchange, and each rank's row work on its shard only
    assert all_lp == pytest.approx(gathered.target_s(n, 0, n) + pcie.logits_exchange_s(n) - gathered.row_s(n)
                                   + pcie.row_s(n))


def test_auto_drafts_a_repeated_answer_as_deep_as_it_matches(pair) -> None:
    """Issue 47 item 5 under GPU-like costs (a verify of 1 or 64 tokens costs about the same at batch 1): the
    second time a request comes, the shared suffix index holds its answer and the auto budget verifies deep
    suffix drafts, many more tokens a step than the old 12-level cap allowed; the output is the known one."""
    target, drafter = pair
    prompt, n = [11, 22, 33, 44, 55], 192
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    eng = Engine(target, device="cpu", dtype="float32", max_running_requests=1, max_total_tokens=4096,
                 disable_radix_cache=True, speculative_algorithm="ddtree", speculative_draft_model_path=drafter,
                 ddtree_budget="auto", speculative_draft_sources="dflash,suffix")
    try:
        first, second = (eng.generate(input_ids=[prompt], sampling_params=params)[0] for _ in range(2))
        assert first.token_ids == second.token_ids == greedy_continuation(prompt, n, VOCAB)
        assert second.spec_accepted_suffix > n // 2, (second.spec_accepted_suffix, second.spec_accepted_tokens)
        assert second.acceptance_length > 20, (second.acceptance_length, first.acceptance_length)
        assert second.mean_budget > 20, second.mean_budget
    finally:
        eng.shutdown()
