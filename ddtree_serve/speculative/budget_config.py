"""The adaptive budget's configuration (``speculative/budget.py``'s ``BudgetController``; docs/DESIGN.md 4.8)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BudgetConfig:
    max_budget: int = 64  # upper bound of any request's budget
    prior: float = 4.0  # calibration prior per depth: this much offered Q at the prior's ratio
    decay: float = 0.995  # forgetting of the calibration evidence per step with a tree
    curve_rate: float = 0.1  # EMA rate of the mean gain curve used before drafting
    draft_margin: float = 0.05  # draft only if the predicted rate beats a plain step's by this fraction
    min_pops: int = 8  # pop at least this many nodes per request (see pop_and_choose)
    explore_share: float = 0.01  # explorations lose at most this share of run time (module docstring)
    explore_credit: float = 2.0  # the exploration balance holds at most this many exploration step times
    explore_power: float = 4.0  # deposits scale with (predicted speculative / plain rate) ** this (docstring)
    replan_every: int = 16  # plain steps between re-predictions of the speculative rate (calibration drifts)
    correction_rate: float = 0.05  # forgetting rate of the realized / predicted rate sums (rate_correction.py)
    correction_prior: float = 8.0  # drafted steps of evidence at which the correction counts half (in log)
    plain_refresh_every: int = 64  # a step that would draft is a plain step when plain(bs) is this many steps old
    deferred_context_tokens: int = 1024  # plain steps' drafter context: written in batches of up to this many
    probe_seconds: float = 3.0  # start-up cost probe budget (step_cost.StepCostModel.probe)
