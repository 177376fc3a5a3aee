"""The step-cost model (ddtree_serve/speculative/step_cost.py) on hand-set timings: the probe's tables, the online
updates per batch-size table, and the drafted prices following the plain table."""

from __future__ import annotations

import numpy as np
import pytest

from ddtree_serve.speculative.step_cost import PiecewiseLinear, StepCostModel


def test_piecewise_linear_and_online_update():
    f = PiecewiseLinear(np.array([1.0, 2.0, 4.0]), np.array([1.0, 2.0, 2.0]))
    assert f(np.array([1.5, 3.0, 8.0])).tolist() == [1.5, 2.0, 2.0]
    f.update(3.0, 4.0, lr=1.0)  # error 2 split half/half between the points 2 and 4
    assert f.y.tolist() == [1.0, 3.0, 3.0]


def _fake_times(calls: list):
    """Hand-set timings: draft 0.1 s per request, plain 10 ms + 1 ms per request, a tree-verify step the plain
    step + 3 ms + 2 ms per node + 0.1 ms per request (``calls`` records the verify points timed)."""

    def verify(bs, e):
        calls.append((bs, e))
        return 0.01 + 0.001 * bs + 0.003 + 0.002 * e + 0.0001 * bs

    return (lambda bs: 0.1 * bs), (lambda bs: 0.01 + 0.001 * bs), verify


def _extra(cost: StepCostModel, bs: int, e) -> np.ndarray:
    """What a verify step costs beyond a plain step over the same requests."""
    return cost.verify_time(bs, e) - cost.plain.at(bs)


def test_probe_fills_tables_by_hand():
    cost = StepCostModel(max_batch=16, max_budget=8)
    calls: list = []
    cost.probe(*_fake_times(calls), budget_s=0.0)
    # after a warm-up, batch sizes 1 and 4 (at least two; no time left for 16), nodes 1, bs, 4 bs, 16 bs up to
    # 8 per request, each the minimum of two timings
    assert calls == [(1, 1)] + [(1, 1)] * 2 + [(1, 4)] * 2 + [(4, 1)] * 2 + [(4, 4)] * 2 + [(4, 16)] * 2
    assert float(cost.draft(8)) == pytest.approx(0.8) and float(cost.plain(2)) == pytest.approx(0.012)
    # tree tables: 3 ms + 2 ms per node + 0.1 ms per request; bs 16's copies bs 4's (not reached)
    assert _extra(cost, 1, np.array([2.0, 64.0])).tolist() == pytest.approx([0.0071, 0.1311])
    assert float(_extra(cost, 4, 8)) == pytest.approx(0.0194) and float(_extra(cost, 16, 8)) == pytest.approx(0.0194)
    # bs 2 lies a third of the way from the bs-1 table to the bs-4 table
    assert float(_extra(cost, 2, 8)) == pytest.approx(0.0191 + (0.0194 - 0.0191) / 3)
    assert float(cost.step_time(4, 4 + 8, drafted=True)) == pytest.approx(0.4 + 0.014 + 0.0194)
    assert float(cost.step_time(4, 4, drafted=False)) == pytest.approx(0.014)  # roots alone: a plain step


def test_tree_costs_depend_on_the_batch_size():
    """Eight nodes over one request and over sixteen requests are different steps: the online updates of a
    batch-16 step move the batch-16 table, not the batch-1 one (one table over total tokens mixed them)."""
    cost = StepCostModel(max_batch=16, max_budget=8)
    calls: list = []
    cost.probe(*_fake_times(calls), budget_s=10.0)
    assert (16, 64) in calls  # the time budget reached batch 16
    before1, before16 = float(cost.verify_time(1, 8)), float(cost.verify_time(16, 8))
    cost.observe(16, 16 + 8, 0.5, before16 + 0.01)  # 10 ms dearer than predicted
    # the first observation after the probe weighs as much as the probe: half way
    assert float(cost.verify_time(16, 8)) == pytest.approx(before16 + 0.005)
    assert float(cost.verify_time(1, 8)) == before1
    assert float(cost.draft(16)) == pytest.approx((1.6 + 0.5) / 2)
    for _ in range(5):  # evidence 3 .. 7: a running mean (rate 1/3, 1/4, ...) until the rate reaches lr = 0.2
        cost.observe(16, 16 + 8, None, before16 + 0.01)
    assert float(cost.verify_time(16, 8)) == pytest.approx(before16 + 0.01 * (1 - 1 / 5 * 0.8 * 0.8))


def _probed() -> StepCostModel:
    cost = StepCostModel(max_batch=4, max_budget=8)
    cost.probe(*_fake_times([]), budget_s=0.0)
    return cost


def test_a_slowdown_seen_by_drafted_steps_is_charged_once():
    """While every step drafts, the machine runs twice as slow: the verify table learns it, the plain table
    does not move. Then a plain step measures the slowdown (and, 201 steps after the last plain measurement,
    counts nearly in full: the plain table's evidence decays): the verify price moves only by the share of it
    that came after the verify point's measurement (a tree table learned as verify minus the plain table
    charged the slowdown twice once a plain step measured it)."""
    cost = _probed()
    v, p, d = float(cost.verify_time(4, 8)), float(cost.plain(4)), float(cost.draft(4))
    for _ in range(200):
        cost.observe(4, 4 + 8, d, 2 * v)
    assert float(cost.verify_time(4, 8)) == pytest.approx(2 * v)
    assert float(cost.plain(4)) == p
    point = cost.verify[2]  # batch 4; e = 8 is a grid point of it
    age = cost.steps + 1 - point.time[point.x.tolist().index(8.0)]  # ~5 steps: a running mean of rate 0.2
    cost.observe(4, 4, None, 2 * p)
    # the probe's evidence (1) halved every 32 steps over the plain point's 201 unmeasured steps: the new
    # observation weighs nearly all
    rate = 1 / (1 + 0.5 ** (201 / 32))
    assert float(cost.plain(4)) == pytest.approx((1 + rate) * p)
    # the plain point was measured by the probe (step 0), 201 steps ago; the verify point ~5 steps ago
    assert 1 < age < 6
    assert float(cost.verify_time(4, 8)) == pytest.approx(2 * v * (1 + rate * age / 201))
    assert float(cost.draft(4)) == pytest.approx(d * (1 + rate * age / 201))  # measured as often
    assert float(cost.step_time(4, 12, drafted=True)) == pytest.approx(float(cost.draft(4) + cost.verify_time(4, 8)))


def test_a_slowdown_seen_by_plain_steps_reaches_the_drafted_prices():
    """While no step drafts, the machine runs twice as slow: the plain table learns it, and the verify tables
    and drafter points, which no step measured since the probe, follow it by the same factor (they stayed
    stale-cheap before, and explorations that lose kept coming)."""
    cost = _probed()
    v1, v4, p, d = float(cost.verify_time(1, 4)), float(cost.verify_time(4, 8)), float(cost.plain(4)), float(cost.draft(4))
    for _ in range(50):
        cost.observe(4, 4, None, 2 * p)
    assert float(cost.plain(4)) == pytest.approx(2 * p, rel=1e-3)
    assert float(cost.verify_time(4, 8)) == pytest.approx(v4 * float(cost.plain(4)) / p)
    assert float(cost.draft(4)) == pytest.approx(d * float(cost.plain(4)) / p)
    assert float(cost.verify_time(1, 4)) == v1  # batch 1: no plain step measured anything there
    # a step that drafted and then chose no node measured the drafter: it does not follow
    d4 = float(cost.draft(4))
    cost.observe(4, 4, d4, 4 * p)
    assert float(cost.draft(4)) == pytest.approx(d4)


def test_a_batch_between_two_tables_moves_both_by_the_plain_difference():
    """A batch-3 verify step updates the batch-2 and batch-4 tables, each by half, towards the measurement
    shifted by the plain table's difference between batch 3 and the table's batch size."""
    cost = StepCostModel(max_batch=4, max_budget=8)
    cost.probe(*_fake_times([]), budget_s=0.0)
    v2, v4 = float(cost.verify_time(2, 6)), float(cost.verify_time(4, 6))  # grid points of e: 4, 8
    p2, p3, p4 = (float(cost.plain(b)) for b in (2, 3, 4))
    measured = float(cost.verify_time(3, 6)) + 0.02
    cost.observe(3, 3 + 6, None, measured)
    # e = 6 lies half way between grid points 4 and 8: each table's share is 1/2, each point's 1/4 (evidence
    # 1 + 1/4: a running-mean rate of 0.8), so both points, and the value at 6, move by 0.8 / 4 of the error
    for v, p, table in ((v2, p2, cost.verify[1]), (v4, p4, cost.verify[2])):
        target = measured + p - p3
        assert float(table(6.0)) == pytest.approx(v + 0.2 * (target - v))


def test_probe_with_room_for_one_point_only():
    """A pool with one request row (max_running_requests 1) or few KV slots times one batch size: the tables
    are then proportional to its points beyond (pessimistic), not an error; no point at all is an error."""
    cost = StepCostModel(max_batch=2, max_budget=64)
    draft, plain, verify = _fake_times([])
    cost.probe(lambda bs: draft(bs) if bs == 1 else None, plain, lambda bs, e: verify(bs, e) if e < 8 else None,
               budget_s=0.0)
    assert float(cost.draft(1)) == pytest.approx(0.1) and float(cost.draft(2)) == pytest.approx(0.2)
    assert float(cost.plain(2)) == pytest.approx(0.022)  # one point (bs 1): proportional
    assert _extra(cost, 2, np.array([1.0, 4.0, 16.0])).tolist() == pytest.approx([0.0051, 0.0111, 0.0351])
    with pytest.raises(RuntimeError, match="single forward"):
        StepCostModel(max_batch=2, max_budget=8).probe(lambda bs: None, plain, verify, budget_s=0.0)


def test_a_stale_plain_price_trusts_its_next_measurement():
    """The plain table's evidence (at most the 1 / lr observations of its running average) halves every
    ``plain_half_life`` steps that no plain step measures it: measured every step it averages at rate lr;
    64 steps after its last measurement (a stretch of drafted steps) the next plain step moves it 1 / (1 +
    5 / 4) of the way, where a plain average of rate 0.2 left a price from before a speed-up for hundreds of
    drafted steps (the closed loop's slowdown-then-drafting case). ``plain_age`` counts those steps."""
    cost = _probed()
    p = float(cost.plain(4))
    for _ in range(50):
        cost.observe(4, 4, None, p)
    assert cost.plain_age(4) == 0
    before = float(cost.plain(4))
    cost.observe(4, 4, None, 2 * p)  # measured every step: lr (evidence 5 x 0.5^(1 / 32) + 1)
    assert float(cost.plain(4)) - before == pytest.approx(0.2 * (2 * p - before), rel=0.02)
    for _ in range(50):
        cost.observe(4, 4, None, p)
    d = float(cost.draft(4))
    for _ in range(64):
        cost.observe(4, 12, d, float(cost.verify_time(4, 8)))  # drafted steps: the plain price ages
    assert cost.plain_age(4) == 64 and cost.plain_age(1) == 165  # (batch 1: only the probe)
    before = float(cost.plain(4))
    cost.observe(4, 4, None, 2 * p)
    assert float(cost.plain(4)) - before == pytest.approx((2 * p - before) / (1 + 5 / 4), rel=0.02)
