"""The acceptance calibrator (ddtree_serve/speculative/calibration.py): per-depth, per-mode ratios computed by hand."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ddtree_serve.speculative.calibration import AcceptanceCalibrator
from ddtree_serve.speculative.ddtree import assemble_tree
from tests.speculative.test_budget import _popped


def test_calibrator_ratio_per_depth_and_mode():
    # one greedy request: depth-1 nodes Q = 0.5, 0.25, one depth-2 node Q = 0.4; verification accepted 1
    popped = _popped([[np.log(0.5), np.log(0.4), np.log(0.25)]], [[1, 2, 1]], [[0, 1, 0]])
    tree = assemble_tree(popped, torch.tensor([3]), torch.tensor([7]), torch.tensor([10]), "cpu")
    cal = AcceptanceCalibrator(max_depth=3, prior=1.0, decay=1.0)
    cal.observe(tree, np.array([1]), np.array([False]))
    r = cal.ratios()  # greedy: on the sampled mode's ratio (1: no evidence) ...
    assert r[0, 1] == pytest.approx(2 / 1.75) and r[0, 2] == pytest.approx(1 / 1.4) and r[0, 3] == 1.0
    assert r[1].tolist() == pytest.approx(r[0].tolist())  # ... which is the prior of the unseen sampled mode
    assert cal.predicted_total[0] == pytest.approx(1.15) and cal.observed_total[0] == 1
    # calibrated gains in pop order 0.5*r1, 0.4*r2, 0.25*r1, made non-increasing
    g = cal.gains(popped, np.array([False]))
    assert g[0].tolist() == pytest.approx([0.5 * 2 / 1.75, 0.4 / 1.4, 0.25 * 2 / 1.75])
    cal.observe(tree, np.array([2]), np.array([True]))  # the sampled mode learns separately (depth 2: reached
    # once of Q 0.4), on the greedy ratio 1 / 1.4 as its prior; greedy now on the sampled ratio 2 / 1.4
    assert cal.ratios()[1, 2] == pytest.approx((1 + 1 / 1.4) / 1.4)
    assert cal.ratios()[0, 2] == pytest.approx((0 + 2 / 1.4) / 1.4)


def test_calibrator_learns_from_reach_probabilities():
    """With ``reach`` (per-node acceptance probabilities, sampled requests), depth d counts the summed reach of
    its nodes, not whether one draw of the coins reached it: the tree of the test above, with reach 0.3 and
    0.1 at the depth-1 nodes and 0.2 at the depth-2 node, gives ratios 0.4 / 0.75 and 0.2 / 0.4 (no prior)."""
    popped = _popped([[np.log(0.5), np.log(0.4), np.log(0.25)]], [[1, 2, 1]], [[0, 1, 0]])
    tree = assemble_tree(popped, torch.tensor([3]), torch.tensor([7]), torch.tensor([10]), "cpu")
    depth = tree.depths[0].tolist()
    reach = np.zeros((1, tree.num_slots))
    reach[0, 0] = 1.0
    for i, d in enumerate(depth[1:], start=1):
        reach[0, i] = 0.2 if d == 2 else (0.3 if np.isclose(float(tree.node_logws[0, i].exp()), 0.5) else 0.1)
    cal = AcceptanceCalibrator(max_depth=3, prior=1e-9, decay=1.0)
    cal.observe(tree, reach[:, 1:].sum(1), np.array([True]), reach)
    assert cal.ratios()[1, 1] == pytest.approx(0.4 / 0.75) and cal.ratios()[1, 2] == pytest.approx(0.2 / 0.4)
    assert cal.observed_total[1] == pytest.approx(0.6)
