"""End-to-end correction of the pre-draft speculative-rate prediction, per batch-size band.

``BudgetController.plan_draft`` predicts the rate of the best speculative step from the mean gain curve and
the step-cost model. Each part is measured, yet the product can be off in ways neither sees: the curve is a
mean over recent drafted steps while a step drafts when its requests' pops look good (the chosen trees
accept more than the mean), the verify tables are fit to noisy step times at other moments, and a
budget chosen per step is not the curve's fixed allocation. So every drafted step compares what it realized
(tokens emitted per second of draft + verify) with what ``plan_draft`` predicted for it, and later
predictions in its band are scaled by

    kappa = (realized tokens / realized seconds) / (predicted tokens / predicted seconds),

each sum forgetting geometrically (``rate`` per drafted step of that band: a ratio of sums, not a mean of
noisy per-step ratios), shrunk towards 1 while evidence is thin (``kappa ** (n / (n + prior_steps))``, n the
band's drafted steps), clipped to at most 4, and never below 1: the correction only ever argues for
drafting. Only drafted steps produce its evidence, so a correction below 1 would stop the drafting that
could undo it and keep a transient error (the first steps' trees priced by the start-up probe) for good;
above 1 it is re-measured by every step it causes. Where the drafted steps realize more than predicted
(batch 1 on a CPU whose verify forward is nearly free, steps that draft when their pops look good), it
keeps drafting that a pessimistic prediction would have turned into plain steps; where they realize less,
the cost tables, which every drafted step updates, are what stops the drafting.
"""

from __future__ import annotations

import numpy as np


class RateCorrection:
    """Per band: decayed sums of realized and predicted tokens and seconds of drafted steps."""

    def __init__(self, bands: int, rate: float, prior_steps: float):
        self.sums = np.zeros((bands, 4))  # [band, (real tokens, real s, predicted tokens, predicted s)]
        self.count = np.zeros(bands)  # [band] drafted steps observed (not decayed: the shrinkage's evidence)
        self.rate, self.prior_steps = rate, prior_steps

    def factor(self, band: int) -> float:
        """kappa of ``band``, at least 1 (1 without evidence)."""
        real_t, real_s, pred_t, pred_s = self.sums[band].tolist()
        if real_s <= 0 or pred_t <= 0 or pred_s <= 0:
            return 1.0
        kappa = min(max((real_t / real_s) / (pred_t / pred_s), 1.0), 4.0)
        n = float(self.count[band])
        return float(kappa ** (n / (n + self.prior_steps)))

    def observe(self, band: int, tokens: float, seconds: float, predicted_rate: float,
                predicted_seconds: float) -> None:
        """A drafted step of ``band`` emitted ``tokens`` in ``seconds``; ``plan_draft`` had predicted
        ``predicted_rate`` tokens/s over ``predicted_seconds``."""
        r = max(self.rate, 1.0 / (self.count[band] + 1))  # a plain sum over the first 1 / rate steps
        step = np.array([tokens, seconds, predicted_rate * predicted_seconds, predicted_seconds])
        self.sums[band] = (1 - r) * self.sums[band] + r * step
        self.count[band] += 1
