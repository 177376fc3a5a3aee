"""End-to-end correction of the pre-draft speculative-rate prediction, per batch-size band.

``BudgetController.plan_draft`` predicts the rate of the best speculative step from the mean gain curve and
the step-cost model. Each part is measured, yet the product can be off in ways neither sees: the curve is a
mean over recent drafted steps while a step drafts when its requests' pops look good (the chosen trees
accept more than the mean), the tree tables are fit to small differences of noisy step times, and a
budget chosen per step is not the curve's fixed allocation. So every drafted step compares what it realized
(tokens emitted per second of draft + verify) with what ``plan_draft`` predicted for it, and later
predictions in its band are scaled by

    kappa = (realized tokens / realized seconds) / (predicted tokens / predicted seconds),

each sum forgetting geometrically (``rate`` per drafted step of that band: a ratio of sums, not a mean of
noisy per-step ratios), shrunk towards 1 while evidence is thin (``kappa ** (n / (n + prior_steps))``, n the
band's drafted steps) and clipped to [1/4, 4]. Bands that never draft keep kappa = 1 until an exploration
drafts there. Selection works both ways: where the drafted steps realize less than predicted, kappa < 1
stops drafting; where they realize more (batch 1 on a CPU whose verify forward is nearly free), kappa > 1
keeps drafting that a pessimistic prediction would have turned into plain steps.
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
        """kappa of ``band`` (1 without evidence)."""
        real_t, real_s, pred_t, pred_s = self.sums[band].tolist()
        if real_s <= 0 or pred_t <= 0 or pred_s <= 0:
            return 1.0
        kappa = min(max((real_t / real_s) / (pred_t / pred_s), 0.25), 4.0)
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
