"""The auto budget's choice of one padded width (docs/DESIGN.md 4.17): what a padded tree of b pops is expected to
add is the sum of its b pops' own calibrated Q, whatever their order (a running minimum, the unpadded choice's
prefix bound, let one poorly reached deep pop cap every shallow branch after it), and the start-up probe times
the largest batch size, whose wide trees were priced off a smaller batch's table."""

from __future__ import annotations

import numpy as np
import pytest

from ddtree_serve.speculative.budget import BudgetConfig, BudgetController
from ddtree_serve.speculative.ddtree import PoppedNodes
from ddtree_serve.speculative.step_cost import StepCostModel

# one request's best-first pops of a two-token drafter (0.8 / 0.2 at every depth): the chain to depth 3, then the
# second token at depth 1 and its child, the chain's sibling at depth 2
Q = np.array([0.8, 0.64, 0.512, 0.2, 0.16, 0.16])
DEPTHS = np.array([1, 2, 3, 1, 2, 2])


def _controller(padded: bool) -> BudgetController:
    cost = StepCostModel(8, 16)
    cost.draft.y[:] = 0.0
    cost.plain.y[:] = 1.0
    for table in cost.verify:
        table.y[:] = 1.0 + 0.015 * table.x  # 1.5% of a step per node (3% per width over the two requests)
    ctl = BudgetController(BudgetConfig(max_budget=8), 4, cost, padded=padded)
    ctl.widths_for = lambda bs: np.array([1, 2, 3, 6])
    # verification reached depth 3 about one time in ten it was offered (a drafter whose deep chain is
    # over-confident); depths 1 and 2 as predicted
    ctl.calib.pred[:, 3], ctl.calib.obs[:, 3] = 1000.0, 100.0
    ctl.calib.pred[:, 1:3], ctl.calib.obs[:, 1:3] = 1000.0, 1000.0
    ctl.calib._ratios = None
    return ctl


def _pops(bs: int) -> PoppedNodes:
    depths = np.tile(DEPTHS, (bs, 1))  # [bs, 6]
    return PoppedNodes(tokens=np.zeros_like(depths), parents=np.zeros_like(depths), depths=depths,
                       logws=np.tile(np.log(Q), (bs, 1)), counts=np.full(bs, len(Q)))


def test_padded_width_expects_the_sum_of_its_pops_calibrated_q() -> None:
    ctl = _controller(padded=True)
    sampled = np.zeros(2, dtype=bool)
    ctl.learn(_pops(2), sampled)
    r3 = float(ctl.calib.ratios()[0, 3])
    assert r3 == pytest.approx(0.1, abs=0.01)
    own = Q * np.where(DEPTHS == 3, r3, 1.0)  # each pop's calibrated Q
    gains = ctl.predicted_gains(sampled)  # [bs, B]
    # a 6-pop tree adds 0.8 + 0.64 + 0.05 + 0.2 + 0.16 + 0.16: the pops after the deep one are not capped at its 0.05
    assert gains[0, :6] == pytest.approx(own)
    assert gains[:, :6].sum(1) == pytest.approx([own.sum()] * 2)
    # so the 6-wide tree (3.0 tokens a request in 1.18 step times) wins; capped, it lost to the 2-wide one
    assert ctl.device_budget(sampled) == 6
    # the unpadded choice still takes prefixes of non-increasing rows: the running minimum (a lower bound)
    assert ctl.predicted_gains(sampled, padded=False)[0, :6] == pytest.approx(np.minimum.accumulate(own))


def test_padded_host_choice_sums_the_pops_as_they_are() -> None:
    """The host path of a padded step (suffix drafts, grammars on an accelerator) chooses from this step's pops
    alike."""
    ctl = _controller(padded=True)
    budgets = ctl.choose(_pops(2), np.zeros(2, dtype=bool))
    assert budgets.tolist() == [6, 6]


def test_probe_times_the_largest_batch_size() -> None:
    """A server of 32 requests: the probe times batch 32 itself, not only 1, 4, 16 (a batch-32 table read off
    batch 16's at equal node counts priced 512 nodes as 16 per request over 16 requests, extrapolated)."""
    calls: list = []

    def verify(bs: int, e: int) -> float:  # the cost per node falls with the node count (experts shared)
        calls.append((bs, e))
        return 0.01 + 0.001 * bs + 0.002 * np.sqrt(e)

    cost = StepCostModel(max_batch=32, max_budget=64)
    cost.probe(lambda bs: 0.001 * bs, lambda bs: 0.01 + 0.001 * bs, verify, budget_s=10.0)
    assert (32, 512) in calls
    assert float(cost.verify_time(32, 512)) == pytest.approx(verify(32, 512), rel=1e-6)
