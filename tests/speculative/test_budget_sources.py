"""The controller's choice between plain, suffix-only and drafted steps (``BudgetController.plan_step``), with
hand-set costs, DFlash curves and suffix drafts: rates computed by hand."""

from __future__ import annotations

import numpy as np
import pytest

from ddtree_serve.speculative.allocation import merged_gains
from ddtree_serve.speculative.budget import DRAFT, PLAIN, SUFFIX_ONLY, BudgetConfig, BudgetController
from ddtree_serve.speculative.ddtree import SUFFIX, PoppedNodes
from ddtree_serve.speculative.suffix_choice import choose_suffix


class _Cost:
    """Step time 1 s + 0.1 s per verified token, + 0.5 s for the drafter forward (plain step: 1.1 s)."""

    def step_time(self, bs, total_tokens, drafted):
        return 1.0 + 0.1 * np.asarray(total_tokens, dtype=float) + (0.5 if drafted else 0.0)

    def plain_time(self, bs):
        return float(self.step_time(bs, bs, False))

    def plain_age(self, bs):
        return 0

    def observe(self, *args):
        pass


def _suffix_chain(q: list[float]) -> PoppedNodes:
    """One request's suffix drafts: a chain whose prefixes have path probabilities ``q``."""
    n = len(q)
    return PoppedNodes(tokens=np.arange(1, n + 1)[None], parents=np.arange(n)[None], depths=np.arange(1, n + 1)[None],
                       logws=np.log(np.array(q, dtype=np.float64))[None], counts=np.array([n]),
                       sources=np.full((1, n), SUFFIX), match_lens=np.full((1, n), 4))


def _controller(curve: list[float]) -> BudgetController:
    """A controller whose DFlash gain curve (greedy) is ``curve``, without rate correction or explorations."""
    cfg = BudgetConfig(max_budget=6, correction_prior=1e12, explore_share=0.0)
    ctl = BudgetController(cfg, depth_limit=6, cost=_Cost())
    ctl.curve[0, :len(curve)] = curve
    ctl.curve_steps[0] = 1  # learned (no exploration of a first draft); no curve mass: no drift
    return ctl


def test_merged_gains_takes_the_larger_gain_per_pop_index():
    curve = np.array([[0.9, 0.5, 0.2, 0.0], [0.3, 0.2, 0.1, 0.1]])
    suffix = np.array([[0.8, 0.7], [0.9, 0.0]])
    got = merged_gains(curve, suffix, 3)
    assert got.tolist() == [[0.9, 0.7, 0.2], [0.9, 0.2, 0.1]]
    assert (np.diff(got, axis=1) <= 0).all()  # still non-increasing: choose_budgets' contract
    assert merged_gains(curve[:, :1], suffix, 4).tolist() == [[0.9, 0.7, 0.0, 0.0], [0.9, 0.0, 0.0, 0.0]]


def test_confident_suffix_drafts_skip_a_drafter_that_proposes_the_same():
    """Suffix drafts 0.9, 0.9, 0.9 and a DFlash curve of the same gains: suffix-only, 3.7 tokens in 1.4 s =
    2.64/s; drafting, the merged tree keeps 3 nodes of 0.9 (the larger gain per index), 3.7 tokens in 1.9 s
    = 1.95/s. Adding the two rows (6 nodes of 0.9: 6.4 tokens in 2.2 s = 2.91/s) would plan the drafter
    forward for nodes it proposes twice."""
    ctl = _controller([0.9, 0.9, 0.9])
    greedy = np.array([False])
    suffix = _suffix_chain([0.9, 0.9, 0.9])
    assert ctl.gains(suffix, greedy)[0].tolist() == pytest.approx([0.9, 0.9, 0.9])  # prior ratio 1
    assert ctl.plan_step(greedy, True, suffix) == SUFFIX_ONLY
    assert choose_suffix(ctl, suffix, greedy).tolist() == [3]


def test_a_drafter_that_beats_weak_suffix_drafts_runs():
    """Suffix drafts of 0.3 (1.3 tokens in 1.2 s = 1.08/s beat plain's 0.91/s) beside a DFlash curve of six
    0.95s (6.7 tokens in 2.2 s = 3.05/s): the drafter runs and both sources go into the tree."""
    ctl = _controller([0.95] * 6)
    assert ctl.plan_step(np.array([False]), True, _suffix_chain([0.3])) == DRAFT
    assert ctl.plan_step(np.array([False]), False, _suffix_chain([0.3])) == SUFFIX_ONLY  # no room for the block


def test_plain_when_neither_source_pays():
    """A DFlash curve of 0.05s and suffix drafts of 0.05 (1.05 tokens in 1.2 s, below plain's 0.91/s): plain."""
    ctl = _controller([0.05] * 6)
    assert ctl.plan_step(np.array([False]), True, _suffix_chain([0.05])) == PLAIN
    assert ctl.plan_step(np.array([False]), True, None) == PLAIN
