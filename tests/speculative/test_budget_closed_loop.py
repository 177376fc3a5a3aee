"""The adaptive budget in a closed loop with a simulated machine: its realized tokens per second against every
fixed budget's on the same step sequence (same drafts, same verification draws, same timing noise).

The bench (benchmarks/bench_spec.py) measures the real engine, but only on the machine it runs on; here the
machine is a model, so the cases this CPU may never show run everywhere: speculation that pays at batch 1,
speculation that loses, and a machine that runs twice as slow for a stretch while it drafts. The controller
and the step-cost model are the real ones (probe included); only the forwards are replaced by a clock.

Simulated draft: one chain per request whose node d has the drafter's path probability ``Q_d`` (the measured
mean Q of the d-th pop of the shipped drafter at batch 1, session 8, in the git history of docs/BENCHMARKS.md) raised to a per-step
power (easy and hard steps); verification reaches depth d with probability ``0.7 Q_d`` (the drafter is
overconfident, as measured). Tolerances: auto must reach 0.95x the best fixed budget (the issue's bar) and
0.97x plain decoding where speculation loses or nearly pays (explorations spend at most 1% of the time;
the start-up exploration, the probe's empty-context prices and near-ties cost the rest), 0.985x on average
over three step sequences where a slowdown comes while no step drafts. Measured with the verify-minus-plain
tree table of session 7, the slowdown-while-drafting case gives 0.915x the best fixed budget; with verify
tables that did not follow the plain table (session 8's), the slowdown-while-plain cases give 0.981x and
0.971x plain decoding (session 9, in the git history of docs/BENCHMARKS.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ddtree_serve.speculative.budget import BudgetConfig, BudgetController
from ddtree_serve.speculative.ddtree import PoppedNodes, assemble_tree
from ddtree_serve.speculative.step_cost import StepCostModel

Q = np.array([0.357, 0.156, 0.080, 0.056, 0.044, 0.035, 0.029, 0.025, 0.021, 0.019, 0.017, 0.016, 0.014, 0.013,
              0.012, 0.011])  # [16] mean path probability of the d-th pop (budget-64 run, batch 1)
Q = np.concatenate([Q, 0.011 * 0.93 ** np.arange(1, 49)])  # [64] the tail, slowly decreasing
TRUE_RATIO = 0.7  # verification reaches a node with 0.7 x its drafter probability
FIXED = (0, 1, 2, 4, 8, 16, 32, 64)


@dataclass(frozen=True)
class Machine:
    """Seconds of each phase at load 1: plain(bs) = base + per_req bs; verify = plain + per_node e."""

    base: float
    per_req: float
    per_node: float
    draft: float
    slow_steps: tuple[int, int] = (0, 0)  # steps [start, end) run at load 2

    def load(self, step: int) -> float:
        return 2.0 if self.slow_steps[0] <= step < self.slow_steps[1] else 1.0

    def plain(self, bs: int) -> float:
        return self.base + self.per_req * bs

    def verify(self, bs: int, e: int) -> float:
        return self.plain(bs) + self.per_node * e


class Steps:
    """The step sequence shared by every policy: per step a power of Q, a uniform per request (which depth
    verification reaches) and a timing noise factor."""

    def __init__(self, n: int, bs: int, seed: int):
        rng = np.random.default_rng(seed)
        self.power = rng.uniform(0.6, 1.6, n)  # [n] easy (< 1) and hard (> 1) steps
        self.u = rng.uniform(size=(n, bs))  # [n, bs]
        self.noise = np.exp(rng.normal(0.0, 0.1, (n, 2)))  # [n, (draft, verify)]

    def pops(self, step: int, bs: int, width: int) -> PoppedNodes:
        """Every request's chain of ``width`` pops (depth d at pop d)."""
        q = Q[:width] ** self.power[step]  # [w]
        logws = np.tile(np.log(q), (bs, 1))  # [bs, w]
        depths = np.tile(np.arange(1, width + 1), (bs, 1))  # [bs, w]
        parents = np.tile(np.arange(width), (bs, 1))  # [bs, w]
        return PoppedNodes(np.ones((bs, width), dtype=np.int64), parents, depths, logws, np.full(bs, width))

    def reach(self, step: int, depths: np.ndarray) -> np.ndarray:
        """[bs, D] the probability that verification accepts each node of a chain tree with ``depths`` [bs, D]
        (root 1, unused slots 0): what ``ddtree_serve.speculative.verify.node_reach`` gives the controller for sampled
        requests, the expectation over the draw that ``accepted`` makes."""
        p = TRUE_RATIO * Q ** self.power[step]  # [64] P(reaching depth d + 1)
        out = np.where(depths > 0, p[np.maximum(depths - 1, 0)], 0.0)  # [bs, D]
        out[:, 0] = 1.0
        return out

    def accepted(self, step: int, budgets: np.ndarray) -> np.ndarray:
        """Accepted nodes [bs]: the depths d <= budget whose true probability exceeds the request's uniform."""
        reach = TRUE_RATIO * Q ** self.power[step]  # [64] non-increasing
        hit = self.u[step][:, None] < reach[None, :]  # [bs, 64]
        return np.minimum(hit.sum(1), budgets)


def run(machine: Machine, steps: Steps, n: int, bs: int, fixed: int | None, sampled: bool = False) -> float:
    """Tokens per simulated second of ``n`` steps under a fixed budget, or under auto (``fixed`` None).
    ``sampled``: the requests sample, and the controller is given the nodes' reach probabilities (as the
    worker gives them, ``Steps.reach``) instead of the draw; greedy (False): the draw."""
    tokens, seconds = 0.0, 0.0
    mode = np.full(bs, sampled)
    ctl = None
    if fixed is None:
        cost = StepCostModel(max_batch=16, max_budget=64)
        cost.probe(lambda b: machine.draft, machine.plain, machine.verify, budget_s=0.0)  # empty-context prices
        ctl = BudgetController(BudgetConfig(max_budget=64), depth_limit=64, cost=cost)
    for t in range(n):
        load = machine.load(t) * steps.noise[t]  # [2]
        drafted = fixed != 0 if ctl is None else ctl.plan_draft(mode)
        budgets = np.zeros(bs, dtype=np.int64)
        popped = None
        if drafted and ctl is not None:
            popped, budgets = ctl.pop_and_choose(lambda w, t=t: steps.pops(t, bs, w), mode)
        elif drafted:
            budgets[:] = fixed
        draft_s = machine.draft * load[0] if drafted else None
        e = int(budgets.sum())
        verify_s = (machine.verify(bs, e) if e else machine.plain(bs)) * load[1]
        acc = steps.accepted(t, budgets)
        tokens += bs + acc.sum()
        seconds += (draft_s or 0.0) + verify_s
        if ctl is not None:
            tree, reach, seen = None, None, acc
            if e:
                tree = assemble_tree(popped, torch.from_numpy(budgets), torch.zeros(bs, dtype=torch.int64),
                                     torch.full((bs,), 100), "cpu")
                if sampled:
                    reach = steps.reach(t, tree.depths.numpy())  # [bs, D]
                    seen = reach[:, 1:].sum(1)
            ctl.record(budgets, tree, seen, mode, bs, bs + e, draft_s, verify_s, reach)
    return tokens / seconds


def _compare(machine: Machine, bs: int, n: int = 600, seed: int = 0,
             sampled: bool = False) -> tuple[float, dict[int, float]]:
    steps = Steps(n, bs, seed)
    return run(machine, steps, n, bs, None, sampled), {b: run(machine, steps, n, bs, b) for b in FIXED}


def test_auto_drafts_where_speculation_pays():
    """Batch 1, verify nearly free (a memory-bound forward): small trees pay ~1.2x over plain decoding."""
    auto, fixed = _compare(Machine(base=0.020, per_req=0.001, per_node=0.0003, draft=0.003), bs=1)
    best = max(fixed.values())
    assert fixed[4] > 1.1 * fixed[0]  # the case is one where speculation pays
    assert auto >= 0.95 * best, (auto, fixed)


def test_auto_steps_aside_where_speculation_loses():
    """Batch 4, every node costs what a request does: every tree loses to plain decoding."""
    auto, fixed = _compare(Machine(base=0.020, per_req=0.004, per_node=0.004, draft=0.008), bs=4)
    assert max(fixed.values()) == fixed[0]
    assert auto >= 0.97 * fixed[0], (auto, fixed)


def test_auto_stays_near_plain_where_speculation_nearly_pays():
    """Batch 4 near break-even (one node per request: 0.98x plain decoding): the case where a biased price
    makes auto lose to plain decoding most (a stale table that follows a noisy one lost 5% here)."""
    auto, fixed = _compare(Machine(base=0.020, per_req=0.004, per_node=0.0015, draft=0.004), bs=4)
    assert max(fixed.values()) == fixed[0] and fixed[1] > 0.95 * fixed[0]
    assert auto >= 0.97 * fixed[0], (auto, fixed)


def test_auto_keeps_paying_through_a_slowdown_while_it_drafts():
    """As the first case, with the machine twice as slow for steps 200-400 (then as fast again): the slowdown
    is seen by drafted steps only, and must not turn auto to plain steps (or keep it there afterwards)."""
    machine = Machine(base=0.020, per_req=0.001, per_node=0.0003, draft=0.003, slow_steps=(200, 400))
    auto, fixed = _compare(machine, bs=1)
    assert auto >= 0.95 * max(fixed.values()), (auto, fixed)


def _mean_ratio_to_plain(machine: Machine, bs: int, seeds: tuple[int, ...] = (0, 1, 2)) -> float:
    """auto / plain decoding, averaged over step sequences (one sequence's near-ties swing it by ~2%)."""
    ratios = []
    for seed in seeds:
        auto, fixed = _compare(machine, bs, seed=seed)
        assert max(fixed.values()) == fixed[0]  # cases where plain decoding is best
        ratios.append(auto / fixed[0])
    return float(np.mean(ratios))


def test_auto_steps_aside_through_a_slowdown_while_plain():
    """The losing case with the machine twice as slow for steps 200-400: plain steps measure the slowdown, the
    drafted prices must follow it (left at their old, cheap level, explorations that lose keep coming;
    session 8's model: 0.981)."""
    machine = Machine(base=0.020, per_req=0.004, per_node=0.004, draft=0.008, slow_steps=(200, 400))
    assert _mean_ratio_to_plain(machine, bs=4) >= 0.985


def test_auto_stays_near_plain_through_a_slowdown_while_plain():
    """The near-break-even case with the machine twice as slow for steps 200-400 (session 8's model: 0.971)."""
    machine = Machine(base=0.020, per_req=0.004, per_node=0.0015, draft=0.004, slow_steps=(200, 400))
    assert _mean_ratio_to_plain(machine, bs=4) >= 0.985


def test_sampled_requests_near_break_even_draft_on_reach_probabilities():
    """Batch 1 where speculation pays ~1.08x (bench_spec's batch-1 T=1 miss on AMX CPUs, session 9: auto ran
    80% plain steps where ddtree@4 paid 1.11x). A sampled step's outcome is one draw of the coins; fed that
    draw, the calibration and the exploration charges are noisy around break-even, and auto reaches 0.977 /
    0.949 / 0.947 / 1.013 of the best fixed budget over these four step sequences. Fed the nodes' reach
    probabilities (the draw's expectation, ``ddtree_serve.speculative.verify.node_reach``): 1.008 / 1.025 / 1.021 / 1.008."""
    machine = Machine(base=0.041, per_req=0.002, per_node=0.001, draft=0.010)
    for seed in range(4):
        auto, fixed = _compare(machine, bs=1, seed=seed, sampled=True)
        assert max(fixed.values()) > 1.03 * fixed[0]  # speculation pays, a little (1.04-1.08x)
        assert auto >= 0.97 * max(fixed.values()), (seed, auto, fixed)


def test_a_plain_price_left_dear_by_a_slowdown_is_measured_again():
    """The losing case, twice as slow for steps 200-400, sampled requests, step sequence 5: when the machine
    speeds up again, the first explorations see the fast speed and drafting looks good against a plain price
    still at the slow level, so no plain step measures the speed-up: with the plain table averaged at rate 0.2
    and refreshed after 64 planned drafts only, its price stayed ~30% too dear for the last 200 steps and auto
    ran at 0.935x plain decoding. An age-based refresh (explorations included) whose measurement counts for
    most of a stale price: 0.973."""
    machine = Machine(base=0.020, per_req=0.004, per_node=0.004, draft=0.008, slow_steps=(200, 400))
    auto, fixed = _compare(machine, bs=4, seed=5, sampled=True)
    assert max(fixed.values()) == fixed[0]
    assert auto >= 0.96 * fixed[0], (auto, fixed)
