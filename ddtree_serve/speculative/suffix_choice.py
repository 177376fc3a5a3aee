"""The adaptive budget's suffix-only step (docs/DESIGN.md 4.13): the budgets of a step whose trees hold this step's
suffix drafts alone (``BudgetController.plan_step`` chose SUFFIX_ONLY), priced without a drafter forward."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np

from ddtree_serve.speculative.allocation import choose_budgets
from ddtree_serve.speculative.ddtree import PoppedNodes
from ddtree_serve.speculative.step_cost import StepCostModel


class BudgetChooser(Protocol):
    """What a suffix-only choice reads of the controller (``BudgetController`` is one; a protocol keeps this file
    free of an import of budget.py, which imports it)."""

    cost: StepCostModel
    padded: bool
    widths_for: Callable[[int], np.ndarray | None]

    def gains(self, popped: PoppedNodes, sampled: np.ndarray, monotone: bool = True) -> np.ndarray: ...


def suffix_choice(ctl: BudgetChooser, gains: np.ndarray, max_verify_tokens: int | None) -> tuple[np.ndarray, float]:
    """``choose_budgets`` over ``gains`` [bs, S] priced without a drafter forward: budgets [bs] and the rate."""
    bs = gains.shape[0]
    return choose_budgets(gains, lambda n: ctl.cost.step_time(bs, n, drafted=False), max_verify_tokens, ctl.padded,
                          ctl.widths_for(bs))


def choose_suffix(ctl: BudgetChooser, popped: PoppedNodes, sampled: np.ndarray,
                  max_verify_tokens: int | None = None) -> np.ndarray:
    """Budgets [bs] for a suffix-only step from its pops (padded: their calibrated Q as they are, as ``choose``)."""
    return suffix_choice(ctl, ctl.gains(popped, sampled, not ctl.padded), max_verify_tokens)[0]
