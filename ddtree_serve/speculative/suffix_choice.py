"""The adaptive budget's suffix-only step (docs/DESIGN.md 4.13): the budgets of a step whose trees hold this step's
suffix drafts alone (``BudgetController.plan_step`` chose SUFFIX_ONLY), priced without a drafter forward."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ddtree_serve.speculative.allocation import choose_budgets
from ddtree_serve.speculative.ddtree import PoppedNodes

if TYPE_CHECKING:
    from ddtree_serve.speculative.budget import BudgetController


def suffix_choice(ctl: BudgetController, gains: np.ndarray, max_verify_tokens: int | None) -> tuple[np.ndarray, float]:
    """``choose_budgets`` over ``gains`` [bs, S] priced without a drafter forward: budgets [bs] and the rate."""
    bs = gains.shape[0]
    return choose_budgets(gains, lambda n: ctl.cost.step_time(bs, n, drafted=False), max_verify_tokens, ctl.padded,
                          ctl.widths_for(bs))


def choose_suffix(ctl: BudgetController, popped: PoppedNodes, sampled: np.ndarray,
                  max_verify_tokens: int | None = None) -> np.ndarray:
    """Budgets [bs] for a suffix-only step from its pops (padded: their calibrated Q as they are, as ``choose``)."""
    return suffix_choice(ctl, ctl.gains(popped, sampled, not ctl.padded), max_verify_tokens)[0]
