"""Trees padded to a captured width (docs/DESIGN.md 4.17: what lets a verify forward replay a CUDA graph) stay
lossless: the padding slots run through the verify forward but no link reaches them, so they are never accepted,
and the commit frees their KV. Greedy and seeded outputs equal plain decoding (float32) at a fixed budget and
with the adaptive budget, a mixed batch and a grammar included, with drafts accepted and every verify forward
padded; the simulated device replays a graph for every padded verify forward."""

from __future__ import annotations

import pytest

from ddtree_serve.model_executor.cuda_graph_runner import (
    auto_verify_widths,
    serving_graph_keys,
    verify_widths,
)
from ddtree_serve.model_executor.models.simulated import greedy_continuation
from ddtree_serve.server.engine import Engine, SamplingParams
from ddtree_serve.sim.checkpoint import write_simulated_pair
from ddtree_serve.speculative.spec_worker import SpecWorker
from ddtree_serve.speculative.worker_graphs import pad_trees_to
from tests.speculative.test_adaptive_engine import _set_costs
from tests.speculative.test_seeded_lossless import _check


def _count_padded(monkeypatch) -> list[tuple[bool, int, int]]:
    """Record (padded, tokens, bs x width) of every verify forward."""
    calls: list[tuple[bool, int, int]] = []
    real = SpecWorker._verify_forward

    def spy(self, tree, idx, cached, host=None, padded=False, params=None, prepared=None):
        bs, d = tree.candidates.shape
        calls.append((padded, host.tokens if host is not None else -1, bs * d))
        return real(self, tree, idx, cached, host, padded, params, prepared)

    monkeypatch.setattr(SpecWorker, "_verify_forward", spy)
    return calls


@pytest.mark.parametrize("budget", [16, "auto"])
def test_padded_trees_seeded_and_greedy_equal_plain(plain_refs, default_model_path, budget, monkeypatch):
    ids, refs = plain_refs
    calls = _count_padded(monkeypatch)
    spec = Engine(default_model_path, dtype="float32", max_total_tokens=16384, speculative_algorithm="ddtree",
                  draft_model_path="default", ddtree_budget=budget)
    try:
        worker = spec.scheduler.spec
        widths = (17,) if budget == 16 else auto_verify_widths(worker.budget)
        pad_trees_to(worker, {8: widths})
        if budget == "auto":  # every step drafts, whatever the machine's load (exactness is the point here)
            _set_costs(spec, 1e-7)
        calls.clear()  # (the start-up warm-up's verify forwards ran before the padding was set)
        _check(spec, ids, refs, ["mixed", "grammar"] if budget == 16 else ["mixed"])
    finally:
        spec.shutdown()
    assert calls and all(p and tokens == size for p, tokens, size in calls), calls[:5]
    if budget == "auto":  # the widths follow the trees
        assert len({size for *_, size in calls}) >= 2, calls


def test_serving_graph_keys_for_auto_and_widths() -> None:
    assert auto_verify_widths(16) == (2, 3, 5, 9, 17) and auto_verify_widths(24) == (2, 3, 5, 9, 17, 25)
    keys = serving_graph_keys((1, 2, 4, 8), (0,), 16, max_verify_tokens=64, auto=True)
    widths = verify_widths(keys)
    assert widths == {1: (2, 3, 5, 9, 17), 2: (2, 3, 5, 9, 17), 4: (2, 3, 5, 9), 8: (2, 3, 5)}  # 8 x 9 > 64
    fixed = verify_widths(serving_graph_keys((1, 2, 4), (0,), 16))
    assert fixed == {1: (17,), 2: (17,), 4: (17,)}


@pytest.mark.parametrize("budget", [16, "auto"])
def test_simulated_graphs_replay_padded_verify_forwards(tmp_path, budget) -> None:
    """With graphs on, every decode and (padded) verify forward replays: per step the host launches the
    drafter's eager kernels and the step's ops, not the target's ~8,500; the output is the known one."""
    target, drafter = write_simulated_pair(tmp_path, vocab=128, accept_prob=0.8)
    eng = Engine(target, device="cpu", dtype="float32", max_running_requests=8, max_total_tokens=4096,
                 disable_radix_cache=True, speculative_algorithm="ddtree", speculative_draft_model_path=drafter,
                 ddtree_budget=budget, speculative_draft_sources="dflash", cuda_graph_max_bs=8)
    prompts = [[i + 1, 5, 9] for i in range(6)]
    builder = eng.scheduler.spec.tree_builder
    try:
        assert eng.scheduler.spec.verify_widths  # trees are padded to the captured widths
        clock = eng.scheduler.runner.model.clock
        clock.reset_counters()
        outs = eng.generate(input_ids=prompts, sampling_params=SamplingParams(temperature=0, max_tokens=24,
                                                                               ignore_eos=True))
        counters = clock.reset_counters()
    finally:
        eng.shutdown()
    assert [o.token_ids for o in outs] == [greedy_continuation(p, 24, 128) for p in prompts]
    assert sum(o.spec_accepted_tokens for o in outs) > 0
    assert counters.eager_forwards <= counters.forwards - counters.target_forwards + 1  # prefill alone eager
    if budget == 16:  # the fixed budget's tree build replays a graph too (speculative/tree_graphs.py)
        assert builder.replays > 0 and builder.graphs
