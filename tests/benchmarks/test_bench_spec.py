"""bench_spec's verdict arithmetic on hand-made rounds (the bench itself runs engines; this is its summary)."""

from __future__ import annotations

import pytest

from benchmarks.bench_spec import cross_fitted_vs_best, paired_ratio


def _rows(tok_s: dict[str, dict[int, float]]) -> dict[str, list[dict]]:
    return {lab: [{"round": r, "tok_s": v} for r, v in sorted(by_round.items())] for lab, by_round in tok_s.items()}


def test_cross_fitted_best_is_chosen_and_measured_on_different_rounds():
    """ddtree@4 is lucky in round 0 only and ddtree@16 in round 3 only: chosen on one round, measured on the
    other, neither looks as good as the same-round maximum says."""
    rows = _rows({
        "none": {0: 10.0, 1: 10.0, 2: 10.0, 3: 10.0},
        "auto": {0: 11.0, 1: 11.0, 2: 11.0, 3: 11.0},
        "ddtree@4": {0: 15.0, 1: 10.0},  # its rounds: 0 (fold 0), 1 (fold 1)
        "ddtree@16": {2: 9.0, 3: 14.0},  # its rounds: 2 (fold 0), 3 (fold 1)
    })
    # fold 0 picks ddtree@4 (1.5x none) and measures auto on its round 1: 11 / 10; fold 1 picks ddtree@16
    # (1.4x) and measures auto on its round 2: 11 / 9
    assert cross_fitted_vs_best(rows) == pytest.approx((1.1 + 11 / 9) / 2)


def test_cross_fitted_best_can_be_plain_decoding():
    rows = _rows({"none": {0: 10.0, 1: 10.0}, "auto": {0: 9.0, 1: 9.5}, "ddtree@4": {0: 8.0, 1: 7.0}})
    # none wins both folds (ratio 1 against 0.8 / 0.7); auto against none on rounds 1 and 0
    assert cross_fitted_vs_best(rows) == pytest.approx((0.95 + 0.9) / 2)


def test_cross_fitted_needs_two_rounds():
    rows = _rows({"none": {0: 10.0}, "auto": {0: 9.0}, "ddtree@4": {0: 8.0}})
    assert cross_fitted_vs_best(rows) != cross_fitted_vs_best(rows)  # nan: no held-out round


def test_paired_ratio_pairs_each_round_with_none_of_the_same_round():
    """A fixed budget runs in rounds 1 and 3 only: its ratios are 12/8 and 10/10, not against none's median."""
    rows = _rows({"none": {0: 20.0, 1: 8.0, 2: 20.0, 3: 10.0}, "ddtree@4": {1: 12.0, 3: 10.0}})
    assert paired_ratio(rows, "ddtree@4") == pytest.approx((1.5 + 1.0) / 2)
    assert paired_ratio(rows, "none") == 1.0
