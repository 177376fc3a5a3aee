"""Per-depth calibration of the drafter's path probabilities against verification (the adaptive budget's expected
tokens, ``ddtree_serve.speculative.budget``). The drafter's probabilities are not calibrated: ``AcceptanceCalibrator``
scales the Q of a depth-d node by a ratio r_d = (observed + prior) / (predicted + prior) of how often
verification reached depth d against the summed Q of the depth-d nodes it was offered, kept separately for
greedy and sampled requests (for a deterministic draft tree, target-only sampling accepts a child c with
probability p_target(c), so the same sum is the sampled prediction). A sampled step's observation is not its
one draw of the coins but each node's reach probability, the product of the target probabilities along its
path (``ddtree_serve.speculative.verify.node_reach``: the draw's expectation given the tree, Rao-Blackwell), so sampled
requests calibrate, and are charged, as steadily as greedy ones, whose outcome is deterministic given the
tree. The prior of each mode is the other mode's ratio (itself on a prior of 1), so sampled requests arriving
after greedy ones start from what greedy steps measured. The prior's ratio of 1 is optimistic for this
drafter, and on purpose: deep nodes, seldom offered, keep being tried (a prior taken from the depth above let
one unlucky stretch shrink every deeper ratio and the trees with them, with no evidence left to undo it;
tests/speculative/test_budget_closed_loop.py). Old evidence decays geometrically with every calibrated step;
steps without a tree do not decay it (a stretch of plain steps let the prior's optimism return, and the
explorations it then predicted to pay lost).
"""

from __future__ import annotations

import numpy as np

from ddtree_serve.speculative.ddtree import DraftTree, PoppedNodes


class AcceptanceCalibrator:
    """Per sampling mode and depth: ratio of observed to predicted acceptance, with a prior of ratio 1."""

    def __init__(self, max_depth: int, prior: float, decay: float):
        self.pred = np.zeros((2, max_depth + 1))  # [mode, depth] decayed sum of offered Q at depth d
        self.obs = np.zeros((2, max_depth + 1))  # [mode, depth] decayed count of reaching depth d
        self.prior, self.decay = prior, decay
        self._ratios: np.ndarray | None = None  # cached ratios() (they change only in observe)
        self.predicted_total = np.zeros(2)  # [mode] calibrated expected accepted tokens of built trees
        self.observed_total = np.zeros(2)  # [mode] accepted tokens

    def ratios(self) -> np.ndarray:
        """[2, max_depth + 1] calibration factors (depth 0 unused): per mode, with the other mode's ratio (on a
        prior of 1) as its prior."""
        if self._ratios is None:
            other = (self.obs[::-1] + self.prior) / (self.pred[::-1] + self.prior)  # [2, max_depth + 1]
            self._ratios = (self.obs + self.prior * other) / (self.pred + self.prior)
        return self._ratios

    def gains(self, popped: PoppedNodes, sampled: np.ndarray, monotone: bool = True) -> np.ndarray:
        """Calibrated marginal gains [bs, B]: Q * r[mode, depth], made non-increasing along the pop order
        (``monotone``: a running minimum, so that taking the largest gains keeps a prefix of every request's
        pops; a lower bound of what a prefix adds). ``monotone`` False: each pop's own calibrated Q, the
        expected tokens it adds to any tree that holds it (a padded step's prefix of b pops adds their sum)."""
        r = self.ratios()[sampled.astype(np.int64)[:, None], popped.depths]  # [bs, B]
        g = np.minimum(popped.path_probs() * r, 1.0)  # [bs, B]
        return np.minimum.accumulate(g, axis=1) if g.size and monotone else g

    def observe(self, tree: DraftTree, accept_length: np.ndarray, sampled: np.ndarray,
                reach: np.ndarray | None = None, select: np.ndarray | None = None,
                keys: np.ndarray | None = None) -> None:
        """Verification result of a built tree batch: per depth, the offered Q and how often it was reached (and
        the totals of predicted and accepted tokens, for metrics). ``reach`` [bs, D]: the probability that
        each node was accepted given the tree and the target (``ddtree_serve.speculative.verify.node_reach``: the coins'
        noise taken out of sampled outcomes); without it, depth d counts as reached by the requests whose
        ``accept_length`` [bs] is at least d. ``select`` [bs, D] bool (with ``reach``): only these nodes are
        observed (a merged tree's nodes of one draft source, docs/DESIGN.md 4.13); ``keys`` [bs, D]: the column
        of each node instead of its depth (suffix drafts: their match length)."""
        depths = tree.numpy("depths") if keys is None else keys  # [bs, D] (0: root / unused)
        if select is not None:
            assert reach is not None, "observing a subset of the nodes needs their reach"
            depths = np.where(select, depths, 0)
        q = np.exp(tree.numpy("node_logws").astype(np.float64)) * (depths > 0)  # [bs, D]
        mode = sampled.astype(np.int64)  # [bs]
        ratios = self.ratios()
        predicted = (q * ratios[mode[:, None], depths]).sum(1)  # [bs]
        self.predicted_total += np.bincount(mode, predicted, minlength=2)
        observed = accept_length if select is None else (np.asarray(reach) * (depths > 0)).sum(1)  # [bs]
        self.observed_total += np.bincount(mode, observed, minlength=2)
        self.pred *= self.decay
        self.obs *= self.decay
        self._ratios = None
        width = self.pred.shape[1]
        cells = (mode[:, None] * width + depths).reshape(-1)  # [bs*D] flat (mode, depth) of every slot
        self.pred += np.bincount(cells, q.reshape(-1), minlength=2 * width).reshape(2, width)
        if reach is not None:
            hit = np.asarray(reach, dtype=np.float64) * (depths > 0)  # [bs, D]
            self.obs += np.bincount(cells, hit.reshape(-1), minlength=2 * width).reshape(2, width)
            return
        # depth d is reached by the requests whose accepted path has at least d nodes (never past the tree)
        hist = np.bincount(mode * width + accept_length.astype(np.int64), minlength=2 * width).reshape(2, width)  # [2, L+1]
        self.obs[:, 1:] += hist[:, ::-1].cumsum(1)[:, ::-1][:, 1:]
