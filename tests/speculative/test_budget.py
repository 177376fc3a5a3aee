"""The adaptive budget controller with hand-set costs and acceptance: budgets computed by hand."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ddtree_serve.speculative.budget import BudgetConfig, BudgetController, _band, choose_budgets
from ddtree_serve.speculative.ddtree import PoppedNodes, assemble_tree

# Two requests: pops offer 0.9, 0.5, 0.1 and 0.6, 0.3 (then nothing) expected accepted tokens.
GAINS = np.array([[0.9, 0.5, 0.1], [0.6, 0.3, 0.0]])


def _linear(base: float, per_token: float):
    return lambda n: base + per_token * (np.asarray(n, dtype=np.float64) - 2)


def test_unpadded_takes_the_largest_gains_of_the_batch():
    # order 0.9 (r0), 0.6 (r1), 0.5 (r0), 0.3 (r1), 0.1 (r0); expected 2, 2.9, 3.5, 4.0, 4.3, 4.4
    # step time 1 + 0.25 * extra: rates 2, 2.32, 2.333, 2.286, 2.15, 1.956 -> 2 extra tokens, one each
    budgets, rate = choose_budgets(GAINS, _linear(1.0, 0.25))
    assert budgets.tolist() == [1, 1] and rate == pytest.approx(3.5 / 1.5)
    budgets, rate = choose_budgets(GAINS, _linear(1.0, 0.25), max_total_tokens=3)  # cap: roots + 1 node
    assert budgets.tolist() == [1, 0] and rate == pytest.approx(2.9 / 1.25)
    assert choose_budgets(GAINS, lambda n: np.ones_like(n, dtype=float))[0].tolist() == [3, 2]  # free: all
    assert choose_budgets(GAINS, _linear(1.0, 2.0))[0].tolist() == [0, 0]  # dear: a plain decode step


def test_padded_chooses_one_width_for_the_batch():
    # widths 0..3 cost 2, 4, 6, 8 tokens; expected 2, 3.5, 4.3, 4.4
    budgets, rate = choose_budgets(GAINS, _linear(1.0, 0.25), padded=True)  # times 1, 1.5, 2, 2.5
    assert budgets.tolist() == [1, 1] and rate == pytest.approx(3.5 / 1.5)
    gpu_like = lambda n: np.maximum(1.0, 0.2 * np.asarray(n, dtype=float))  # noqa: E731 flat, then linear
    budgets, rate = choose_budgets(GAINS, gpu_like, padded=True)  # times 1, 1, 1.2, 1.6 -> width 2
    assert budgets.tolist() == [2, 2] and rate == pytest.approx(4.3 / 1.2)
    budgets, _ = choose_budgets(GAINS, lambda n: np.ones_like(n, dtype=float), padded=True)
    assert budgets.tolist() == [3, 2]  # row 1 has only two pops worth anything
    assert choose_budgets(GAINS, gpu_like, max_total_tokens=5, padded=True)[0].tolist() == [1, 1]


def _popped(logws: list[list[float]], depths: list[list[int]], parents: list[list[int]]) -> PoppedNodes:
    n = np.array([len(r) for r in logws])
    return PoppedNodes(
        np.ones((len(n), 3), dtype=np.int64),
        np.array(parents),
        np.array(depths),
        np.array(logws, dtype=np.float64),
        n,
    )


def test_calibration_does_not_decay_without_trees():
    """Plain steps leave the calibration alone: with a drafter that is overconfident (verification reaches a
    node half as often as its Q says), the ratio stays near 1/2 through a stretch without trees instead of
    returning to the prior's optimism."""
    popped = _popped([[np.log(0.8)]], [[1]], [[0]])
    tree = assemble_tree(popped, torch.tensor([1]), torch.tensor([7]), torch.tensor([10]), "cpu")
    ctl = BudgetController(BudgetConfig(max_budget=1), depth_limit=1, cost=_FakeCost())
    for i in range(200):  # reached on 2 steps in 5: 0.4 of a Q of 0.8
        ctl.record(np.array([1]), tree, np.array([int(i % 5 < 2)]), np.array([False]), 1, 2, 1.0, 1.0)
    before = float(ctl.calib.ratios()[0, 1])
    assert before == pytest.approx(0.5, abs=0.05)
    for _ in range(1000):
        ctl.record(np.zeros(1, dtype=np.int64), None, np.zeros(1), np.array([False]), 1, 1, None, 1.0)
    assert float(ctl.calib.ratios()[0, 1]) == before


class _FakeCost:
    """Hand-set step times: draft 1 s, verify 1 s per 2 tokens plus 1 s."""

    def step_time(self, bs, total_tokens, drafted):
        return 1.0 + 0.5 * np.asarray(total_tokens, dtype=float) + (1.0 if drafted else 0.0)

    def plain_time(self, bs):
        return float(self.step_time(bs, bs, False))

    age = 0.0  # steps since plain(bs) was measured (set by hand)

    def plain_age(self, bs):
        return self.age

    def observe(self, *args):
        pass


def test_controller_drafts_only_when_it_pays_and_explores():
    # (deposits unweighted: see below; no rate correction: test_rate_correction.py)
    cfg = BudgetConfig(max_budget=3, explore_share=0.25, explore_power=0.0, correction_prior=1e12)
    ctl = BudgetController(cfg, depth_limit=3, cost=_FakeCost())
    greedy = np.array([False])
    assert ctl.plan_draft(greedy) and ctl._exploring  # no curve yet: draft, as an exploration
    # one request, pops Q = 0.9, 0.8, 0.1 (prior ratios 1): widths 0..3 -> tokens 1..4, times 2.5, 3, 3.5, 4
    # expected 1, 1.9, 2.7, 2.8 -> rates 0.4, 0.633, 0.771, 0.7 -> budget 2
    popped = _popped([[np.log(0.9), np.log(0.8), np.log(0.1)]], [[1, 2, 3]], [[0, 1, 2]])
    assert ctl.choose(popped, greedy).tolist() == [2]
    assert ctl.curve[0].tolist() == pytest.approx([0.9, 0.8, 0.1])
    # it emitted 3 tokens in 1 + 2 s where plain decoding takes 4.5 s: a loss of -1.5 s, banked
    ctl.record(np.array([2]), None, np.array([2]), greedy, 1, 3, 1.0, 2.0)
    assert ctl.explore_balance[0] == pytest.approx(1.5)
    # before drafting: plain step 1 token in 1.5 s (0.667/s) vs the curve's best 0.771/s -> draft
    assert ctl.plan_draft(greedy) and not ctl._exploring
    ctl.record(np.array([2]), None, np.array([2]), greedy, 1, 3, 1.0, 2.0)  # a planned draft: no exploration,
    assert ctl.explore_balance[0] == pytest.approx(1.5)  # nor a step that pays for one (only plain-predicted do)
    # a poor drafter: best speculative rate 1.3 / 3 = 0.433/s (budget 1, 3 s) against plain 0.667/s -> plain;
    # an exploration is predicted to lose 3 s x (1 - 0.433 / 0.667) = 1.05 s, which the balance (1.5) covers
    ctl.curve[0], ctl._spec_rates = [0.3, 0.1, 0.0], {}
    poor = _popped([[np.log(0.1), np.log(0.05), -np.inf]], [[1, 2, 0]], [[0, 1, -1]])  # 1.1 / 3 < 1 / 2.5
    assert ctl.plan_draft(greedy) and ctl._exploring
    assert ctl.choose(poor, greedy).tolist() == [0]  # the exploration chose a plain step
    ctl.record(np.array([0]), None, np.array([0]), greedy, 1, 1, 1.0, 1.5)  # 1 token in 1 + 1.5 s: loses 1 s
    assert ctl.explore_balance[0] == pytest.approx(0.5)
    # 0.5 < 1.05: no exploration until plain steps deposit 0.25 x 1.5 s each (0.875, then 1.25)
    plans = []
    for _ in range(3):
        plans.append(ctl.plan_draft(greedy))
        if not plans[-1]:
            ctl.record(np.array([0]), None, np.array([0]), greedy, 1, 1, None, 1.5)
    assert plans == [False, False, True] and ctl.explore_balance[0] == pytest.approx(1.25)
    # the curve is a running mean over its first steps: [0.3, 0.1, 0] (set), then the poor step's pops at
    # rate 1/2 -> [0.2, 0.075, 0]; this exploration's pops at rate 1/3 -> [0.4333, 0.3167, 0.0333]
    assert ctl.choose(popped, greedy).tolist() == [2]
    assert ctl.curve[0].tolist() == pytest.approx([0.3 + 0.4 / 3, 0.05 + 0.8 / 3, 0.1 / 3])
    # it pays: 3 tokens in 1 + 2.5 s where plain decoding takes 4.5 s (balance 2.25); the curve now predicts
    # 1.75 / 3.5 = 0.5/s (budget 2) -> plain, an exploration predicted to lose 3.5 x 0.25 s: it explores again
    ctl.record(np.array([2]), None, np.array([2]), greedy, 1, 3, 1.0, 2.5)
    assert ctl.explore_balance[0] == pytest.approx(2.25) and ctl.plan_draft(greedy) and ctl._exploring
    # credit is capped at explore_credit (2) exploration step times: 11 tokens in 3.5 s banks 7 s, not 15.25
    ctl.record(np.array([2]), None, np.array([10]), greedy, 1, 3, 1.0, 2.5)
    assert ctl.explore_balance[0] == pytest.approx(7.0)
    assert ctl.stats()["budget_counts"] == {2: 4, 0: 3}
    # a step that would draft (planned, or an exploration) is a plain step instead once the plain price is
    # plain_refresh_every (64) steps old
    assert ctl.plan_draft(greedy) and ctl._exploring
    ctl.cost.age = 64
    assert not ctl.plan_draft(greedy) and not ctl._exploring and ctl._planned_plain  # (a deposit, as plain)
    ctl.curve[0], ctl._spec_rates = [0.9, 0.8, 0.1], {}
    ctl.cost.age = 63
    assert ctl.plan_draft(greedy) and not ctl._exploring
    ctl.cost.age = 64
    assert not ctl.plan_draft(greedy)
    assert not ctl._exploring and not ctl._planned_plain  # (no exploration, no regret accounting)
    ctl.cost.age = 0
    # near break-even (plain 1 / 1.5 = 0.667/s, margin 5%: a draft must promise > 0.7/s): the curve 0.9, 0.6
    # gives 2.5 / 3.5 = 0.714/s at budget 2 -> draft; 0.9, 0.5 gives 2.4 / 3.5 = 0.686/s -> plain
    ctl.explore_balance[:] = -1e9  # (no exploration)
    ctl.curve[0], ctl._spec_rates = [0.9, 0.6, 0.0], {}
    assert ctl.plan_draft(greedy) and not ctl._exploring
    ctl.curve[0], ctl._spec_rates = [0.9, 0.5, 0.0], {}
    assert not ctl.plan_draft(greedy)


def test_deposits_shrink_with_the_predicted_gap():
    """A plain-predicted step deposits explore_share x rho ** explore_power of its time, rho the predicted
    speculative rate over the plain rate: the farther speculation is from paying, the rarer explorations."""
    ctl = BudgetController(BudgetConfig(max_budget=3, explore_share=0.25), depth_limit=3, cost=_FakeCost())
    greedy = np.array([False])
    ctl.curve_steps[:] = 1
    ctl.explore_balance[:] = -10.0  # (no exploration)
    for curve, rho in (([0.3, 0.1, 0.0], 1.3 / 3 / (1 / 1.5)), ([0.0, 0.0, 0.0], 1 / 2.5 / (1 / 1.5))):
        ctl.curve[0], ctl._spec_rates = curve, {}
        before = ctl.explore_balance[0]
        assert not ctl.plan_draft(greedy) and ctl._rho == pytest.approx(rho)
        ctl.record(np.array([0]), None, np.array([0]), greedy, 1, 1, None, 1.5)
        assert ctl.explore_balance[0] - before == pytest.approx(0.25 * rho**4 * 1.5)


def test_the_curve_follows_the_calibration():
    """The pre-draft prediction rescales the learned curve by how the calibration of its depths moved since:
    a depth-1 ratio halved by evidence halves a depth-1 curve."""
    ctl = BudgetController(BudgetConfig(max_budget=2, prior=1.0, decay=1.0), depth_limit=2, cost=_FakeCost())
    greedy = np.array([False])
    popped = _popped([[np.log(0.8), np.log(0.4)]], [[1, 1]], [[0, 0]])  # two depth-1 pops
    ctl.choose(popped, greedy)
    assert ctl.curve[0].tolist() == pytest.approx([0.8, 0.4]) and ctl._curve_drift()[0] == pytest.approx(1.0)
    # verification offered Q 1.2 at depth 1 and never reached it: ratio (0 + 1) / (1.2 + 1) = 1 / 2.2
    ctl.calib.obs[0, 1], ctl.calib.pred[0, 1] = 0.0, 1.2
    ctl.calib._ratios = None  # (set by hand: observe clears the cache)
    assert ctl._curve_drift()[0] == pytest.approx(1 / 2.2)


def test_an_exploration_is_charged_the_tokens_it_emitted():
    """An exploration's loss counts the tokens verification accepted, not the calibrated expectation (which
    the prior of ratio 1 makes optimistic): a tree of Q 0.9 + 0.8 that accepted nothing is charged its whole
    time beyond one plain step; one that accepted both nodes banks credit."""
    ctl = BudgetController(BudgetConfig(max_budget=3), depth_limit=3, cost=_FakeCost())
    greedy = np.array([False])
    popped = _popped([[np.log(0.9), np.log(0.8), np.log(0.1)]], [[1, 2, 3]], [[0, 1, 2]])
    balance = 0.0
    for accepted in (0, 2):
        ctl._exploring = True  # (forced: an exploration each time)
        budgets = ctl.choose(popped, greedy)
        assert budgets.sum() >= accepted
        tree = assemble_tree(popped, torch.from_numpy(budgets), torch.tensor([3]), torch.tensor([7]), "cpu")
        # 1 + accepted tokens in 1 + 2 s where plain decoding takes 1.5 s per token
        ctl.record(budgets, tree, np.array([accepted]), greedy, 1, 1 + int(budgets.sum()), 1.0, 2.0)
        balance = min(balance - (3.0 - (1 + accepted) * 1.5), 2 * 3.0)
        assert ctl.explore_balance[0] == pytest.approx(balance)
    assert balance == pytest.approx(-1.5 + 1.5)


def test_exploration_balance_per_batch_size_band():
    ctl = BudgetController(BudgetConfig(max_budget=3, explore_power=0.0), depth_limit=3, cost=_FakeCost())
    ctl.curve_steps[:] = 1  # a curve of zeros: every step predicts a plain step
    sixteen, one = np.zeros(16, dtype=bool), np.zeros(1, dtype=bool)
    # batch 16: a speculative step of roots alone takes 10 s for 16 tokens, plain decoding 9 s: an exploration
    # is predicted to lose 1 s; batch 1: 2.5 s against 1.5 s, 1 s too. A new band starts with nothing saved.
    assert not ctl.plan_draft(sixteen) and not ctl.plan_draft(one)
    ctl.explore_balance[2] = 1.0
    assert ctl.plan_draft(sixteen) and ctl._exploring  # its band's balance covers the predicted loss
    # 16 tokens in 1 + 9 s where plain decoding takes 9 s: a loss of 1 s in the batch-16 band
    ctl.record(np.zeros(16, dtype=np.int64), None, np.zeros(16, dtype=np.int64), sixteen, 16, 16, 1.0, 9.0)
    assert ctl.explore_balance.tolist() == pytest.approx([0, 0, 0, 0, 0, 0, 0, 0])
    assert not ctl.plan_draft(sixteen)  # batch 16 waits for its band's deposits ...
    ctl.record(np.zeros(16, dtype=np.int64), None, np.zeros(16, dtype=np.int64), sixteen, 16, 16, None, 9.0)
    assert ctl.explore_balance.tolist() == pytest.approx([0, 0, 0.09, 0, 0, 0, 0, 0])  # 1% of 9 s
    ctl.explore_balance[0] = 1.0
    assert ctl.plan_draft(one) and ctl._exploring  # ... batch 1 explores on its own balance
    assert [_band(b) for b in (1, 2, 3, 4, 8, 16, 32, 64, 10**6)] == [0, 0, 1, 1, 2, 2, 2, 3, 7]


def test_a_mode_without_a_curve_borrows_the_other():
    """Sampled requests arriving after greedy ones are predicted from the greedy curve (no exploration);
    only the very first draft, with no curve at all, is one."""
    ctl = BudgetController(BudgetConfig(max_budget=3), depth_limit=3, cost=_FakeCost())
    greedy, sampled = np.array([False]), np.array([True])
    assert ctl.plan_draft(sampled) and ctl._exploring
    popped = _popped([[np.log(0.9), np.log(0.8), np.log(0.1)]], [[1, 2, 3]], [[0, 1, 2]])
    ctl.choose(popped, greedy)  # a greedy curve [0.9, 0.8, 0.1]: 2.7 / 3.5 = 0.771/s beats 0.667/s plain
    assert ctl.curve_steps.tolist() == [1, 0]
    assert ctl.plan_draft(sampled) and not ctl._exploring and not ctl._planned_plain
    assert ctl._spec_rates[(1, 1)] == pytest.approx((2.7 / 3.5, 3.5))




def _pops_of(q: list[float]):
    """A pop function over one request's best-first pops with path probabilities ``q`` (a chain of depths
    1, 2, ...), recording the widths it was asked for."""
    asked: list[int] = []

    def pop(width: int) -> PoppedNodes:
        asked.append(width)
        n = min(width, len(q))
        return PoppedNodes(np.ones((1, n), dtype=np.int64), np.arange(n)[None], np.arange(1, n + 1)[None],
                           np.log(np.array([q[:n]])), np.array([n]))

    return pop, asked


def test_pop_and_choose_pops_only_what_can_matter():
    # step time 2 + 0.5 * tokens (drafted); one greedy request; prior ratios 1, so gains = Q
    ctl = BudgetController(BudgetConfig(max_budget=4, min_pops=2), depth_limit=4, cost=_FakeCost())
    greedy = np.array([False])
    ctl.pop_width = 2
    # pops 0.9, 0.2 | 0.1, 0.05: rates 1/2.5, 1.9/3, 2.1/3.5 -> budget 1 (0.633/s). Unpopped gains <= 0.2:
    # the bound (1 + 0.9 + 0.2 * (n - 1)) / (2.5 + 0.5 n) peaks at n = 1, so two pops decide it
    pop, asked = _pops_of([0.9, 0.2, 0.1, 0.05])
    popped, budgets = ctl.pop_and_choose(pop, greedy)
    assert asked == [2] and budgets.tolist() == [1] and popped.counts.tolist() == [2]
    assert ctl.pop_width == 2  # twice the largest budget chosen, at least min_pops
    # pops 0.9, 0.8 | 0.1, 0.05: two pops give budget 2 at 2.7 / 3.5 = 0.771/s, but the bound at n = 3,
    # (1 + 0.9 + 0.8 + 0.8) / 4 = 0.875/s, exceeds it: all four pops, which still choose 2 (2.8 / 4 = 0.7)
    pop, asked = _pops_of([0.9, 0.8, 0.1, 0.05])
    popped, budgets = ctl.pop_and_choose(pop, greedy)
    assert asked == [2, 4] and budgets.tolist() == [2] and popped.counts.tolist() == [4]
    assert ctl.pop_width == 4
    assert ctl.curve[0].tolist() == pytest.approx([0.9, (0.2 + 0.8) / 2, 0.1 / 2, 0.05 / 2])  # running mean
    # of the popped widths (the first step's unpopped 3rd and 4th gains count as 0)
