"""The end-to-end rate correction of the pre-draft prediction, with values computed by hand."""

from __future__ import annotations

import numpy as np
import pytest

from ddtree_serve.speculative.budget import BudgetConfig, BudgetController
from ddtree_serve.speculative.rate_correction import RateCorrection
from tests.speculative.test_budget import _FakeCost


def test_ratio_of_sums_shrunk_while_evidence_is_thin():
    c = RateCorrection(bands=2, rate=0.5, prior_steps=2.0)
    assert c.factor(0) == 1.0  # no evidence
    # predicted 2 tokens/s over 1 s; realized 3 tokens in 1 s, then 1 token in 1 s: running mean (rate 1, 1/2)
    c.observe(0, 3.0, 1.0, 2.0, 1.0)
    assert c.factor(0) == pytest.approx(1.5 ** (1 / 3))  # kappa 1.5, one step against a prior of two
    c.observe(0, 1.0, 1.0, 2.0, 1.0)
    assert c.sums[0].tolist() == pytest.approx([2.0, 1.0, 2.0, 1.0]) and c.factor(0) == pytest.approx(1.0)
    # then an average of rate 0.5: realized 8 tokens in 2 s against 2/s predicted over 1 s -> sums 5, 1.5, 2, 1
    c.observe(0, 8.0, 2.0, 2.0, 1.0)
    assert c.factor(0) == pytest.approx(((5 / 1.5) / 2) ** (3 / 5))
    assert c.factor(1) == 1.0  # bands apart
    c.observe(1, 1.0, 1.0, 2.0, 1.0)  # realized half the prediction: no correction below 1 (only drafting
    assert c.factor(1) == 1.0  # produces the evidence, so a factor below 1 could never be undone)
    for _ in range(50):  # far beyond the prior, clipped at 4
        c.observe(1, 100.0, 1.0, 1.0, 1.0)
    assert c.factor(1) == pytest.approx(4.0 ** (51 / 53))


def test_controller_drafts_where_drafted_steps_realized_more_than_predicted():
    """The curve predicts a speculative step just short of the margin; drafted steps that realize 1.5x their
    prediction turn the decision to drafting, in their band only."""
    cfg = BudgetConfig(max_budget=3, correction_prior=1.0)
    ctl = BudgetController(cfg, depth_limit=3, cost=_FakeCost())
    one, four = np.array([False]), np.zeros(4, dtype=bool)
    ctl.curve_steps[:] = 1
    ctl.explore_balance[:] = -1e9  # (no exploration)
    # curve 0.9, 0.5: budget 2 gives 2.4 tokens in 3.5 s = 0.686/s against plain 1 / 1.5 = 0.667/s: < 5% margin
    ctl.curve[0] = [0.9, 0.5, 0.0]
    assert not ctl.plan_draft(one) and ctl._plan == pytest.approx((2.4 / 3.5, 3.5))
    # a drafted step (as the plain refresh or an exploration would run one): 3.6 tokens in 3.5 s, 1.5x
    ctl.record(np.array([2]), None, np.array([2.6]), one, 1, 3, 1.0, 2.5)
    assert ctl.correction.factor(0) == pytest.approx(1.5 ** 0.5)  # one step against a prior of one
    assert ctl._plan is None  # consumed
    assert ctl.plan_draft(one) and not ctl._exploring  # 0.686 x 1.22 = 0.84/s > 0.7/s: drafts
    assert ctl.correction.factor(1) == 1.0 and not ctl.plan_draft(four)  # batch 4 keeps its own (none yet)
