"""Adaptive tree budget: each step, the per-request budgets that maximise the batch's expected emitted tokens per
second, down to none (a plain decode step).

Expected tokens (DDTree, arXiv 2604.12989): the best-first builder pops prefixes in decreasing path
probability Q, and a tree's expected accepted length is the sum of Q over its nodes, so ``1 + cumsum(Q over
the pop order)`` is the expected number of emitted tokens of every budget at once. The drafter's probabilities
are not calibrated: ``ddtree_serve.speculative.calibration.AcceptanceCalibrator`` scales the Q of a depth-d node by a
per-mode, per-depth ratio of observed to predicted acceptance (sampled requests observed through the nodes'
reach probabilities, ``ddtree_serve.speculative.verify.node_reach``).

Decision (``choose_budgets``): with the marginal gains of every request non-increasing along its pop order,
the best allocation of n extra tree tokens over the batch takes the n largest gains (each request keeps a
prefix of its pops); one sort and one cumulative sum give the expected tokens of every n, and the step-time
model (``ddtree_serve.speculative.step_cost``) turns them into a rate; the argmax wins (n = 0: no tree).

A step is two decisions. Before drafting (``BudgetController.plan_draft``) the controller compares a plain
decode step with the best speculative step predicted from the recent mean gain curve of each sampling mode (a
running mean over its first ``1 / curve_rate`` drafted steps, then an average of that rate; rescaled by how
the calibration moved since; a mode without a curve yet borrows the other mode's), drafter forward included,
scaled by what this band's drafted steps realized against such predictions (``ddtree_serve.speculative.rate_correction``),
and drafts only if that wins by ``draft_margin`` (timing noise exceeds the gain of a near break-even step;
docs/BENCHMARKS.md). Otherwise it still drafts now and then to keep the curve fresh (an exploration; the very
first draft is one too), under a regret budget kept as a balance in seconds, saved before it is spent: every
step that predicted a plain step and did not explore deposits ``explore_share`` x rho ** ``explore_power`` of
its time (rho: the predicted speculative rate over the plain rate, at most 1, so the farther speculation is
from paying, the slower the balance fills); a step explores only when the balance covers the exploration's
predicted loss (the predicted speculative step's time beyond what plain decoding needs for its predicted
tokens); every exploration withdraws its measured loss, its step time minus what plain decoding would take for
the tokens it emitted (a negative loss, an exploration that paid, deposits). Emitted, not the calibrated
expectation: that is optimistic by design (the prior of ratio 1), and explorations charged by it predicted
~10% more accepted tokens than they verified and kept coming where they lost (session 9 measurements, in the git history of docs/BENCHMARKS.md).
For sampled requests "emitted" is the verified expectation given the tree (reach probabilities, above): one
draw of the coins made a near-break-even step's balance, and with it the exploring, a matter of luck
(tests/speculative/test_budget_closed_loop.py). So explorations lose at most ``explore_share`` of the time
spent where speculation does not pay, never before that time was spent (a new batch size does not start with
an exploration), and continue step after step where they pay on balance (one unlucky step among paying ones
does not stop them); the balance holds at most ``explore_credit`` exploration step times, so credit earned
where speculation paid cannot fund a long run of losing explorations elsewhere. There is one balance per
batch-size band (1, 4, 16, ... to the nearest power of 4): explorations that lose at batch 32 do not keep
batch 1, where speculation may pay, from exploring. Symmetrically, a step that would draft (planned, or an
exploration) is a plain step instead once the plain price at its batch size is ``plain_refresh_every`` steps
old (``StepCostModel.plain_age``), so that the plain-step cost it is compared with stays measured (a start-up
probe timed under load would otherwise keep it drafting where it loses; a price from before a speed-up kept
explorations "paying" for hundreds of steps where they lost, tests/speculative/test_budget_closed_loop.py).
After drafting (``choose``) the drafter's cost is sunk and the budgets come from this step's own pops. Under
tensor parallelism rank 0's decisions are broadcast (timings differ per rank).

Pops (``BudgetController.pop_and_choose``): popping costs host time per node, so a step pops only twice the
largest budget the previous drafted step chose (at least ``min_pops``) and re-pops up to ``max_budget`` only
when the pops it did not make could change the decision: the pops past a cut row have gains at most that row's
last gain g, so ``(bs + H(n)) / step_time(bs + n)``, with H the batch's sorted popped gains merged with an
endless supply of g, bounds the rate of every allocation; if no n beats the chosen rate, that choice is the
one full pops would give.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable

import numpy as np

from ddtree_serve.speculative.allocation import choose_budgets, merged_gains, pops_could_matter
from ddtree_serve.speculative.budget_config import BudgetConfig
from ddtree_serve.speculative.calibration import AcceptanceCalibrator
from ddtree_serve.speculative.ddtree import DFLASH, SUFFIX, DraftTree, PoppedNodes
from ddtree_serve.speculative.rate_correction import RateCorrection
from ddtree_serve.speculative.step_cost import StepCostModel
from ddtree_serve.speculative.suffix_choice import suffix_choice
from ddtree_serve.speculative.suffix_index import MATCH_KEY_CAP

GREEDY, SAMPLED = 0, 1
PLAIN, SUFFIX_ONLY, DRAFT = 0, 1, 2  # a step's plan (plan_step): no tree, suffix drafts only, the drafter runs


def _band(bs: int) -> int:
    """Batch-size band of the exploration balance: the nearest power of 4 (0: 1, 1: 4, 2: 16, ... 7)."""
    return min(int(round(math.log(max(bs, 1), 4))), 7)


class BudgetController:
    """Chooses every step's per-request budgets (see the module docstring). Host-side numpy only."""

    def __init__(self, config: BudgetConfig, depth_limit: int, cost: StepCostModel, padded: bool = False):
        self.config = config
        self.padded = padded  # whether the verify forward pads every tree to the widest (see choose_budgets)
        self.widths_for: Callable[[int], np.ndarray | None] = lambda bs: None  # padded: the budgets a batch may take
        self.cost = cost
        self.calib = AcceptanceCalibrator(depth_limit, config.prior, config.decay)  # DFlash's nodes
        # suffix nodes, by the length of the match that proposed them (capped at MATCH_KEY_CAP)
        self.calib_suffix = AcceptanceCalibrator(MATCH_KEY_CAP, config.prior, config.decay)
        self.curve = np.zeros((2, config.max_budget))  # [mode, B] mean calibrated Q per pop index (no running min)
        self.curve_steps = np.zeros(2)  # [mode] drafted steps behind the curve
        self.curve_mass = np.zeros((2, 2, depth_limit + 1))  # [mode, raw/calibrated, depth] mean Q per step
        self.explore_balance = np.zeros(8)  # [band] seconds of exploration loss still allowed (module docstring)
        self._exploring = False  # this step drafts only to explore
        self._planned_plain = False  # this step's prediction was a plain step
        self._spec_rates: dict[tuple[int, int], tuple[float, float]] = {}  # plan_draft's (rate, seconds) by (bs, sampled)
        self._plans_since_learn = 0  # plan_draft calls since _spec_rates was cleared (replan_every)
        self._rho = 1.0  # this step's predicted speculative / plain rate (scales the deposit)
        self.correction = RateCorrection(8, config.correction_rate, config.correction_prior)  # by band
        self._plan: tuple[float, float] | None = None  # this step's uncorrected (rate, seconds) prediction
        self.pop_width = config.max_budget  # nodes per request the next drafted step pops (pop_and_choose)
        self.chosen: Counter[int] = Counter()  # request-steps per chosen budget (metrics)

    def plan_step(self, sampled: np.ndarray, draft_fits: bool, suffix: PoppedNodes | None,
                  max_verify_tokens: int | None = None) -> int:
        """PLAIN, SUFFIX_ONLY or DRAFT for this step (docs/DESIGN.md 4.13). ``draft_fits``: whether the drafter
        may run (there is one, a node can be of use, its block's slots are free); ``suffix``: this step's suffix
        drafts (tagged SUFFIX) or None. A suffix-only step costs no drafter forward and its expected tokens come
        from this step's own candidates, so its rate is known before anything runs; the DFlash step's rate is
        ``plan_draft``'s prediction, the suffix candidates merged into it. Either must beat a plain step by
        ``draft_margin``; the plain price is refreshed as for drafting."""
        bs = len(sampled)
        s_rate, gains = 0.0, None
        if suffix is not None and suffix.counts.any():
            gains = self.gains(suffix, sampled)  # [bs, S]
            budgets, s_rate = suffix_choice(self, gains, max_verify_tokens)
            s_rate = s_rate if budgets.any() else 0.0
        suffix_ok = s_rate > self._plain_rate(bs) * (1 + self.config.draft_margin)
        self._exploring = self._planned_plain = False
        if draft_fits and self.plan_draft(sampled, True, gains if suffix_ok else None):
            corrected = self._plan[0] * self.correction.factor(_band(bs)) if self._plan else math.inf
            if not suffix_ok or (corrected > s_rate and not self._exploring):
                return DRAFT
        self._exploring = False
        self._plan = None
        if suffix_ok and self.cost.plain_age(bs) < self.config.plain_refresh_every:
            self._planned_plain = False  # a suffix-only step: outside the exploration balance
            return SUFFIX_ONLY
        return PLAIN

    def scale(self, sampled: np.ndarray, suffix: PoppedNodes) -> tuple[np.ndarray, np.ndarray]:
        """The merge's calibration ratios (``draft_sources.merge_popped``): DFlash's [bs, L+1] by request (its
        mode) and depth; the suffix drafts' [bs] (``suffix_ratios``)."""
        return self.calib.ratios()[sampled.astype(np.int64)], self.suffix_ratios(sampled, suffix)

    def suffix_ratios(self, sampled: np.ndarray, popped: PoppedNodes) -> np.ndarray:
        """[bs] calibration ratio of each request's suffix drafts: its own record (reached over offered score,
        ``SuffixProposer.observe``) on a prior of the shared ratio at its match length (all requests' suffix
        nodes of that length, per mode), worth ``config.prior`` offered score: a request that copies and one
        that chats differ even at equal match lengths."""
        keys = popped.match_lens.max(1) if popped.match_lens is not None and popped.match_lens.size else 0  # [bs]
        shared = self.calib_suffix.ratios()[sampled.astype(np.int64), keys]  # [bs]
        if popped.evidence is None:
            return shared
        hit, offered = popped.evidence[:, 0], popped.evidence[:, 1]  # [bs] each
        return (hit + self.config.prior * shared) / (offered + self.config.prior)

    def gains(self, popped: PoppedNodes, sampled: np.ndarray, monotone: bool = True) -> np.ndarray:
        """Calibrated marginal gains [bs, B] of pops from either source (``AcceptanceCalibrator.gains`` with each
        node's ratio taken from its source's calibrator), non-increasing along a row (``monotone``; else each
        pop's own calibrated Q, what it adds to a tree that takes it: padded choices sum them as they are)."""
        if popped.sources is None:
            return self.calib.gains(popped, sampled, monotone)
        mode = sampled.astype(np.int64)[:, None]  # [bs, 1]
        r = np.where(popped.sources == SUFFIX, self.suffix_ratios(sampled, popped)[:, None],
                     self.calib.ratios()[mode, popped.depths])  # [bs, B]
        g = np.minimum(popped.path_probs() * r, 1.0)  # [bs, B]
        return np.minimum.accumulate(g, axis=1) if g.size and monotone else g

    def plan_draft(self, sampled: np.ndarray, fits: bool = True, extra: np.ndarray | None = None) -> bool:
        """Whether this step should run the drafter (False: a plain decode step). ``fits``: whether a draft
        can be of use (some request has room for a node) and the KV slots it needs are free (if not, a plain
        step outside the regret accounting). ``extra`` [bs, S]: gains of this step's suffix drafts, merged into
        the prediction (it is then not cached)."""
        bs = len(sampled)
        self._exploring = self._planned_plain = False
        self._plan = None
        if not fits:
            return False
        if not self.curve_steps.any():  # the very first draft: an exploration
            self._exploring = True
            return True
        key = (bs, int(sampled.sum()))
        self._plans_since_learn += 1
        if self._plans_since_learn > self.config.replan_every:  # the calibration decays meanwhile
            self._spec_rates.clear()
            self._plans_since_learn = 0
        if extra is not None:
            self._plan = self._predict(sampled, extra)
        else:
            if key not in self._spec_rates:  # unchanged while no step drafts (invalidated by record)
                self._spec_rates[key] = self._predict(sampled)
            self._plan = self._spec_rates[key]
        rate, step_s = self._plan
        rate *= self.correction.factor(_band(bs))  # what drafted steps of this band realized (rate_correction.py)
        plain = self._plain_rate(bs)
        self._rho = min(rate / plain, 1.0)
        draft = rate > plain * (1 + self.config.draft_margin)
        if not draft:
            self._planned_plain = True
            loss = max(step_s * (1.0 - rate / plain), 0.0)  # predicted loss of drafting now (module docstring)
            self._exploring = draft = bool(self.explore_balance[_band(bs)] >= loss)
        if draft and self.cost.plain_age(bs) >= self.config.plain_refresh_every:
            self._exploring = False  # a plain price that is never measured could stay wrong forever: refresh it
            return False
        return draft

    def _predict(self, sampled: np.ndarray, extra: np.ndarray | None = None) -> tuple[float, float]:
        """The best speculative step's predicted rate and seconds, from ``predicted_gains``."""
        bs = len(sampled)
        gains = self.predicted_gains(sampled, extra)  # [bs, B]
        budgets, rate = choose_budgets(gains, lambda n: self.cost.step_time(bs, n, drafted=True), padded=self.padded,
                                       widths=self.widths_for(bs))
        tokens = bs * (1 + int(budgets.max(initial=0))) if self.padded else bs + int(budgets.sum())
        return rate, float(self.cost.step_time(bs, tokens, drafted=True))

    def predicted_gains(self, sampled: np.ndarray, extra: np.ndarray | None = None,
                        padded: bool | None = None) -> np.ndarray:
        """[bs, B] gains of a drafted step predicted from the mean gain curves (rescaled by the calibration's
        drift; a mode without a curve yet borrows the other mode's), with ``extra`` [bs, S] gains (suffix drafts)
        merged in. The curve is each pop index's mean calibrated Q, what that pop adds to a tree holding it, so a
        padded step (``padded``, default the controller's) of width b expects the sum of its first b; the
        unpadded choice, which needs rows non-increasing, takes their running minimum (a lower bound)."""
        curves = self.curve * self._curve_drift()[:, None]  # [2, B]
        curves = np.where((self.curve_steps > 0)[:, None], curves, curves[::-1])  # [2, B]
        if not (self.padded if padded is None else padded):
            curves = np.minimum.accumulate(curves, axis=1)  # [2, B]
        gains = curves[sampled.astype(np.int64)]  # [bs, B]
        if extra is not None:  # each pop index's larger gain (merged_gains: the sources may propose alike)
            gains = merged_gains(gains, extra, self.config.max_budget)
        return gains

    def device_budget(self, sampled: np.ndarray, max_verify_tokens: int | None = None) -> int:
        """The one budget of a drafted step whose tree the device builds (speculative/auto_device.py; no pops
        read back before it): the width of ``predicted_gains`` that maximises the padded step's rate among
        ``widths_for(bs)``, at least the smallest allowed (``plan_step`` chose to draft: an exploration too); 0
        when not even that fits ``max_verify_tokens``."""
        bs = len(sampled)
        allowed = self.widths_for(bs)
        allowed = np.arange(1, self.config.max_budget + 1) if allowed is None else np.asarray(allowed)
        if max_verify_tokens is not None:
            allowed = allowed[bs * (allowed + 1) <= max_verify_tokens]
        if not allowed.size:
            return 0
        budgets, _ = choose_budgets(self.predicted_gains(sampled, padded=True),
                                    lambda n: self.cost.step_time(bs, n, drafted=True), max_verify_tokens, padded=True,
                                    widths=allowed)
        best = int(budgets.max(initial=0))  # a row's positive gains may end before the width chosen
        return int(allowed[np.searchsorted(allowed, best)]) if best <= allowed[-1] else int(allowed[-1])

    def learn(self, popped: PoppedNodes, sampled: np.ndarray) -> None:
        """The gain curves from a device-built step's pops, read back after its verification (``choose``'s
        learning without a choice: the budget was ``device_budget``'s)."""
        self._learn(popped, sampled)

    def _curve_drift(self) -> np.ndarray:
        """[mode] how the calibration moved since the curve was learned: the curve's mean Q mass per depth
        under today's ratios over its mass under the ratios it was learned with (1 without a history)."""
        raw, cal = self.curve_mass[:, 0], self.curve_mass[:, 1]  # [2, D+1] each
        now = (raw * self.calib.ratios()).sum(1)  # [2]
        then = cal.sum(1)  # [2]
        return np.where(then > 0, now / np.maximum(then, 1e-12), 1.0)

    def _plain_rate(self, bs: int) -> float:
        """Predicted tokens per second of a plain decode step over ``bs`` requests."""
        return bs / max(self.cost.plain_time(bs), 1e-12)

    def choose(
        self, popped: PoppedNodes, sampled: np.ndarray, max_verify_tokens: int | None = None
    ) -> np.ndarray:
        """Budgets [bs] int64 for this step's pops (drafter cost already paid, still counted in the rate)."""
        budgets, _ = self._decide(self.gains(popped, sampled, not self.padded), max_verify_tokens)  # [bs]
        self._learn(popped, sampled)
        return budgets

    def pop_and_choose(
        self,
        pop: Callable[[int], PoppedNodes],
        sampled: np.ndarray,
        max_verify_tokens: int | None = None,
        agree: Callable[[object], object] = lambda x: x,
    ) -> tuple[PoppedNodes, np.ndarray]:
        """``choose`` on ``pop(width)`` (the best-first pops of every request up to ``width``), popping fewer
        than ``max_budget`` nodes when that provably gives the same budgets (module docstring). ``agree``:
        tensor-parallel ranks take rank 0's re-pop decision and budgets."""
        width = self.pop_width
        popped = pop(width)
        gains = self.gains(popped, sampled, not self.padded)  # [bs, w] (padded: as they are, predicted_gains)
        budgets, rate = self._decide(gains, max_verify_tokens)
        bs = len(sampled)
        if width < self.config.max_budget and agree(pops_could_matter(
                gains, popped.counts, width, rate, lambda n: self.cost.step_time(bs, n, drafted=True),
                self.config.max_budget, max_verify_tokens, self.padded)):
            popped = pop(self.config.max_budget)
            gains = self.gains(popped, sampled, not self.padded)  # [bs, B]
            budgets, rate = self._decide(gains, max_verify_tokens)
        budgets = np.asarray(agree(budgets))
        self._learn(popped, sampled)
        self.pop_width = int(np.clip(2 * budgets.max(initial=0), self.config.min_pops, self.config.max_budget))
        return popped, budgets

    def _decide(self, gains: np.ndarray, max_verify_tokens: int | None) -> tuple[np.ndarray, float]:
        bs = gains.shape[0]
        return choose_budgets(gains, lambda n: self.cost.step_time(bs, n, drafted=True), max_verify_tokens,
                              self.padded, self.widths_for(bs))

    def _learn(self, popped: PoppedNodes, sampled: np.ndarray) -> None:
        """The mean gain curve per mode over the popped width (a running mean, then an EMA) of each pop's own
        calibrated Q (no running minimum: ``predicted_gains``), and its Q mass per depth, raw and calibrated
        (``_curve_drift``)."""
        self._spec_rates.clear()
        self._plans_since_learn = 0
        gains = self.gains(popped, sampled, monotone=False)  # [bs, B]
        q, depths = popped.path_probs(), popped.depths  # [bs, B] each
        if popped.sources is not None:  # the curve is DFlash's own: its nodes, in their order, moved left
            own = popped.sources == DFLASH  # [bs, B]
            order = np.argsort(~own, axis=1, kind="stable")  # [bs, B]
            gains, q, depths = (np.take_along_axis(np.where(own, a, z), order, 1)
                                for a, z in ((gains, 0.0), (q, 0.0), (depths, 0)))
        w = min(gains.shape[1], self.config.max_budget)
        mode = sampled.astype(np.int64)  # [bs]
        ratios = self.calib.ratios()  # [2, D+1]
        q, depths = q[:, :w], depths[:, :w]  # [bs, w]
        nd = self.curve_mass.shape[2]
        for m in (GREEDY, SAMPLED):
            sel = mode == m
            n = int(sel.sum())
            if n:
                self.curve_steps[m] += 1
                r = max(self.config.curve_rate, 1.0 / self.curve_steps[m])
                self.curve[m, :w] = (1 - r) * self.curve[m, :w] + r * gains[sel, :w].mean(0)
                raw = np.bincount(depths[sel].reshape(-1), q[sel].reshape(-1), minlength=nd)[:nd] / n  # [D+1]
                step = np.stack([raw, raw * ratios[m]])  # [2, D+1]
                self.curve_mass[m] = (1 - r) * self.curve_mass[m] + r * step

    def record(
        self,
        budgets: np.ndarray,
        tree: DraftTree | None,
        accept_length: np.ndarray,
        sampled: np.ndarray,
        bs: int,
        total_tokens: int,
        draft_s: float | None,
        verify_s: float,
        reach: np.ndarray | None = None,
        draft_measured: bool = True,
    ) -> None:
        """After the step: the chosen budgets (metrics), the verification outcome (calibration; ``tree``
        None or without nodes: nothing to calibrate) and the measured phase times (cost model).
        ``accept_length`` [bs]: accepted tokens, or with ``reach`` [bs, D] (per-node acceptance probabilities,
        ``ddtree_serve.speculative.verify.node_reach``) their expectation ``reach[:, 1:].sum(1)``, which the worker passes:
        the rate correction and exploration charges then see a sampled step's expected outcome, not one
        draw of its coins. ``draft_measured`` False: ``draft_s`` is the model's own price (a device-built step's
        drafter ran in the shadow of other work, speculative/auto_device.py): the drafter table is not moved."""
        if draft_s is None and tree is None:  # a plain step (the common case where speculation does not pay)
            self.chosen[0] += bs
        else:
            self.chosen.update(budgets.tolist())
            self._spec_rates.clear()  # the curve and the draft / verify tables move
        if tree is not None and int(tree.numpy("num_nodes").max()) > 0:
            if tree.sources is None:
                self.calib.observe(tree, accept_length, sampled, reach)
            else:  # each source's calibration sees the nodes it proposed (docs/DESIGN.md 4.13)
                src = tree.numpy("sources")  # [bs, D]
                if (src == DFLASH).any():
                    self.calib.observe(tree, accept_length, sampled, reach, select=src == DFLASH)
                if (src == SUFFIX).any():  # calibrated by the length of the match that proposed them
                    keys = tree.numpy("match_lens") if tree.match_lens is not None else None
                    self.calib_suffix.observe(tree, accept_length, sampled, reach, select=src == SUFFIX, keys=keys)
        step_s = (draft_s or 0.0) + verify_s
        if draft_s is not None and self._plan is not None:  # a drafted step: realized against predicted
            self.correction.observe(_band(bs), bs + float(np.sum(accept_length)), step_s, *self._plan)
            self._plan = None
        if self._exploring:  # its loss: the time beyond what plain decoding takes for the tokens it emitted
            loss = step_s - (bs + float(np.sum(accept_length))) / self._plain_rate(bs)
            band = _band(bs)
            self.explore_balance[band] = min(self.explore_balance[band] - loss, self.config.explore_credit * step_s)
            self._exploring = False
        elif self._planned_plain:  # explorations are paid for by the steps that predicted a plain step
            weight = self._rho ** self.config.explore_power  # the farther from paying, the less explored
            self.explore_balance[_band(bs)] += self.config.explore_share * weight * step_s
        self.cost.observe(bs, total_tokens, draft_s if draft_measured else None, verify_s)

    def stats(self) -> dict:
        """Cumulative counters for metrics: request-steps per budget, predicted/observed accepted tokens."""
        return {
            "budget_counts": dict(self.chosen),
            "predicted_accepted": self.calib.predicted_total.tolist(),
            "observed_accepted": self.calib.observed_total.tolist(),
            "suffix_predicted_accepted": self.calib_suffix.predicted_total.tolist(),
            "suffix_observed_accepted": self.calib_suffix.observed_total.tolist(),
        }
