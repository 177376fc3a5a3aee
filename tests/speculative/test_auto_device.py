"""The adaptive budget on the device path (``speculative/auto_device.py``; docs/DESIGN.md 4.17): its tree is the
fixed budget's, popped wider so the controller sees past it; its one budget is chosen among the widths a graph
holds from the learned curve; an engine on the device path (as on a GPU) stays lossless with it, drafts ahead,
learns from the step's one read and leaks no KV slot."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ddtree_serve.model_executor.model_runner import ModelRunner
from ddtree_serve.server.engine import Engine, SamplingParams
from ddtree_serve.speculative.allocation import choose_budgets
from ddtree_serve.speculative.auto_device import allowed_budgets, pop_width
from ddtree_serve.speculative.budget import BudgetConfig, BudgetController
from ddtree_serve.speculative.ddtree import PoppedNodes, build_device_tree, draft_topk
from ddtree_serve.speculative.ddtree_pop import device_pairs, device_pops
from ddtree_serve.speculative.step_cost import StepCostModel
from tests.speculative.test_adaptive_engine import _set_costs
from tests.speculative.test_device_tree import FIELDS, _logits


@pytest.mark.parametrize("budget,wide", [(4, 8), (8, 16), (3, 7)])
def test_wide_pops_keep_the_tree_and_show_past_it(budget: int, wide: int) -> None:
    """Popping ``wide`` > budget gives the very tree of ``budget`` (the pop order's prefix property, ties included),
    and the pops past it equal a pop of ``wide`` alone."""
    logits = _logits(4, 5, 40, seed=7)  # [bs, L, V]
    logits[1, :, 3] = logits[1, :, 4]  # ties
    topk = draft_topk(logits.log_softmax(-1), 16)  # [bs, L, K]
    limits = torch.tensor([5, 2, 0, 4])
    budgets = torch.where(limits > 0, budget, 0)
    roots, cached = torch.arange(4) + 3, torch.arange(4) * 5 + 7
    shape = (budget, min(5, budget), False)
    narrow = build_device_tree(topk, budgets, limits, shape, roots, cached, budget + 2, device_pairs(budget, 16, "cpu"))
    got = build_device_tree(topk, budgets, limits, shape, roots, cached, budget + 2, device_pairs(wide, 16, "cpu"),
                            wide)
    for name in FIELDS:
        assert torch.equal(getattr(got, name), getattr(narrow, name)), name
    _, _, depths, logws, counts = device_pops(*topk, torch.where(limits > 0, wide, 0), limits, wide,
                                              device_pairs(wide, 16, "cpu"))
    assert torch.equal(got.pop_depths, depths) and torch.equal(got.pop_logws, logws)
    assert int(counts.max()) > budget  # pops past the tree exist
    assert narrow.pop_depths is None


def test_padded_choice_takes_only_allowed_widths() -> None:
    gains = np.array([[0.9, 0.8, 0.7, 0.6, 0.5, 0.4]] * 2)  # [bs, B]

    def cost(tokens):  # a base of 10 tokens' time
        return 10.0 + np.asarray(tokens, dtype=np.float64)

    free, _ = choose_budgets(gains, cost, padded=True)
    assert free.tolist() == [5, 5]  # (2 + 2 * 3.5) / 22 beats (2 + 2 * 3.9) / 24
    some, _ = choose_budgets(gains, cost, padded=True, widths=np.array([1, 2, 4]))
    assert some.tolist() == [4, 4]
    none, _ = choose_budgets(gains, cost, padded=True, widths=np.array([6]), max_total_tokens=12)
    assert none.tolist() == [0, 0]  # the only width passes the cap: no tree


def _controller(widths: np.ndarray | None) -> BudgetController:
    cost = StepCostModel(8, 16)
    cost.draft.y[:] = 1e-3
    cost.plain.y[:] = 1e-2
    for table in cost.verify:
        table.y[:] = 1e-2 + 1e-5 * table.x  # a node nearly free
    ctl = BudgetController(BudgetConfig(max_budget=16), 8, cost, padded=True)
    ctl.widths_for = lambda bs: widths
    return ctl


def test_device_budget_is_an_allowed_width_from_the_learned_curve() -> None:
    ctl = _controller(np.array([1, 2, 4, 8]))
    sampled = np.zeros(2, dtype=bool)
    assert ctl.device_budget(sampled) == 1  # no curve yet: the smallest tree (the first draft explores)

    depths = np.tile(np.arange(1, 9), (2, 1))  # [bs, 8] a chain of 8 pops, each half as likely
    ctl.learn(PoppedNodes(tokens=np.zeros_like(depths), parents=np.zeros_like(depths), depths=depths,
                          logws=np.log(0.9) * depths, counts=np.full(2, 8)), sampled)
    assert ctl.device_budget(sampled) == 8  # nodes nearly free: the widest allowed
    assert ctl.device_budget(sampled, max_verify_tokens=2 * 5) == 4  # 2 x (8 + 1) passes the cap
    assert ctl.device_budget(sampled, max_verify_tokens=3) == 0  # not even one node each fits
    assert _controller(None).device_budget(sampled) == 1  # no captured widths: any, the smallest first


def test_pop_width_and_allowed_budgets() -> None:
    cfg = BudgetConfig(max_budget=64, min_pops=8)
    assert [pop_width(b, cfg) for b in (1, 4, 8, 32, 64)] == [8, 8, 16, 64, 64]
    widths = {1: (2, 3, 5, 9), 8: (2, 5, 17)}
    assert allowed_budgets(widths, 1).tolist() == [1, 2, 4, 8]
    assert allowed_budgets(widths, 5).tolist() == [1, 4, 16]
    assert allowed_budgets(widths, 9) is None  # no captured size: any budget


def test_auto_engine_on_the_device_path_equals_plain(default_model_path, monkeypatch) -> None:
    """Greedy, seeded and penalised requests with stops over three running slots, the auto budget on the device
    path (forced: the runner reports an accelerator): token for token plain decoding's, drafts accepted, trees
    drafted ahead and taken, the controller's curve learned from the reads, budgets one per step, no KV held."""
    from tests.speculative.test_draft_ahead import KW, plain_refs

    ids, params, refs = plain_refs(default_model_path)  # (computed once for the package's device-path tests)
    kw = KW
    monkeypatch.setattr(ModelRunner, "accelerated", property(lambda self: True))
    spec = Engine(default_model_path, speculative_algorithm="ddtree", draft_model_path="default",
                  ddtree_budget="auto", ddtree_max_budget=16, speculative_draft_sources="dflash", **kw)
    try:
        worker = spec.scheduler.spec
        ctl = worker.controller
        assert ctl.padded
        _set_costs(spec, 1e-7)  # every step drafts (exactness is the point, not the machine's timing)
        outs = spec.generate(input_ids=ids, sampling_params=params)
        assert [(o.token_ids, o.finish_reason) for o in outs] == refs
        assert sum(o.spec_accepted_tokens for o in outs) > 0
        assert worker.ahead_taken > 0 and ctl.curve_steps.sum() > 0
        assert ctl.curve[0, 8:].any()  # learned past the first 8 pops: the wide pops were read
        assert sum(n for b, n in ctl.stats()["budget_counts"].items() if b > 0) > 0
        st = spec.stats()
        assert st.running == 0 and st.kv_used_tokens == 0
        assert spec.scheduler.runner.slots.num_free + st.cache_held_tokens == st.kv_total_tokens
    finally:
        spec.shutdown()


@pytest.mark.parametrize("budget", [8, "auto"])
def test_warm_up_captures_every_draft_and_tree_graph(tmp_path, budget) -> None:
    """Under the simulated device with graphs on, the warm-up captures the drafter's graph at every padded batch
    size and the tree build's at every budget a step may take (each auto width); serving batches of 1..8 requests
    then replays them and captures nothing new; greedy output is the known continuation."""
    from ddtree_serve.model_executor.models.simulated import greedy_continuation
    from ddtree_serve.sim.checkpoint import write_simulated_pair

    vocab, n = 128, 12
    target, drafter = write_simulated_pair(tmp_path, vocab=vocab, accept_prob=0.9)
    eng = Engine(target, device="cpu", dtype="float32", max_running_requests=8, max_total_tokens=4096,
                 cuda_graph_max_bs=8, speculative_algorithm="ddtree", speculative_draft_model_path=drafter,
                 ddtree_budget=budget, speculative_draft_sources="dflash",
                 **({"ddtree_max_budget": 16} if budget == "auto" else {}))
    try:
        worker = eng.scheduler.spec
        trees, drafts = dict(worker.tree_builder.graphs), dict(worker.draft_graphs.graphs)
        assert sorted(b for b, _ in drafts) == [1, 2, 4, 8]
        budgets = {key[3] for key in trees}
        assert budgets == ({1, 2, 4, 8, 16} if budget == "auto" else {8}), budgets
        assert {key[0] for key in trees} == {1, 2, 4, 8}
        if budget == "auto":
            _set_costs(eng, 1e-7)  # every step drafts
        for bs in (1, 3, 8):
            prompts = [[(5 * i + j) % 100 + 1 for j in range(4 + i)] for i in range(bs)]
            outs = eng.generate(input_ids=prompts, sampling_params=SamplingParams(temperature=0, max_tokens=n,
                                                                                  ignore_eos=True))
            assert [o.token_ids for o in outs] == [greedy_continuation(p, n, vocab) for p in prompts]
        assert worker.tree_builder.graphs.keys() == trees.keys() and worker.draft_graphs.graphs.keys() == drafts.keys()
        assert worker.tree_builder.replays > 0 and worker.draft_graphs.replays > 0
    finally:
        eng.shutdown()
