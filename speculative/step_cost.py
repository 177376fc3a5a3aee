"""Step-time model of a speculative decode step, measured on the machine it runs on.

A step costs ``draft(bs)`` (one drafter forward over ``bs`` blocks plus the tree build; zero when the step
does not draft) plus ``verify(n)``: the target forward over ``n`` tree tokens in total (roots included), the
verification and the commit; or, when every tree is its root alone (``n == bs``), ``plain(bs)``: the plain
decode step the worker runs then (causal decode forward + sampler, no tree bookkeeping), cheaper than a
tree-verify forward over as many tokens. All three are piecewise-linear tables over a geometric grid (1, 2,
4, ...) of their argument, extrapolated linearly past the last point. A start-up probe fills the tables
(``probe``, interleaved across the tables); every step's measured phase times then move the two bracketing
grid points of the table that step used towards the observation (one stochastic-gradient step on the
interpolated prediction, rate ``lr``), so the model follows the machine's load and the requests' context
lengths.

Limitation (documented, deliberate): ``verify`` depends on the total token count only, not on how the tokens
split over requests or on context lengths; the online updates absorb the current average of both.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np


def geometric_grid(limit: int) -> np.ndarray:
    """1, 2, 4, ... up to the first power of two >= ``limit`` (at least [1, 2])."""
    pts = [1]
    while pts[-1] < max(limit, 2):
        pts.append(pts[-1] * 2)
    return np.asarray(pts, dtype=np.float64)


class PiecewiseLinear:
    """y(x) on a grid of x values; linear between points, linear extrapolation past the ends."""

    def __init__(self, grid: np.ndarray, values: np.ndarray | None = None):
        self.x = np.asarray(grid, dtype=np.float64)  # [G]
        self.y = (
            np.zeros_like(self.x) if values is None else np.asarray(values, dtype=np.float64).copy()
        )  # [G]

    def _bracket(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Left grid index and the weight of the right point, per query (weights may leave [0, 1])."""
        i = np.clip(np.searchsorted(self.x, x, side="right") - 1, 0, len(self.x) - 2)
        w = (x - self.x[i]) / (self.x[i + 1] - self.x[i])
        return i, w

    def __call__(self, x: np.ndarray | float) -> np.ndarray:
        xa = np.asarray(x, dtype=np.float64)
        i, w = self._bracket(xa)
        return np.maximum((1 - w) * self.y[i] + w * self.y[i + 1], 0.0)

    def update(self, x: float, target: float, lr: float) -> None:
        """Move the interpolated value at ``x`` towards ``target`` (gradient step on both bracketing points,
        weights clipped to [0, 1] so an extrapolated observation only moves the nearest point)."""
        i, w = self._bracket(np.asarray([x], dtype=np.float64))
        i, w = int(i[0]), float(np.clip(w[0], 0.0, 1.0))
        err = target - float(self(x))
        self.y[i] += lr * (1 - w) * err
        self.y[i + 1] += lr * w * err


class StepCostModel:
    """Seconds per step as ``draft(bs) * drafted + (plain(bs) if total_tokens == bs else verify(total_tokens))``."""

    def __init__(self, max_batch: int, max_tokens: int, lr: float = 0.2):
        self.draft = PiecewiseLinear(geometric_grid(max_batch))
        self.verify = PiecewiseLinear(geometric_grid(max_tokens))
        self.plain = PiecewiseLinear(geometric_grid(max_batch))
        self.lr = lr
        self.probed = False

    def step_time(self, bs: int, total_tokens: np.ndarray | int, drafted: bool) -> np.ndarray:
        """Predicted seconds of a step over ``bs`` requests verifying ``total_tokens`` tokens (vectorised over
        total_tokens)."""
        n = np.asarray(total_tokens, dtype=np.float64)
        t = np.where(n <= bs, float(self.plain(bs)), self.verify(n))  # roots alone: a plain decode step
        return t + (float(self.draft(bs)) if drafted else 0.0)

    def observe(self, bs: int, total_tokens: int, draft_s: float | None, verify_s: float) -> None:
        """One step's measured phase times (``draft_s`` None when the step did not draft; ``verify_s``: the plain
        step's time when ``total_tokens == bs``)."""
        if draft_s is not None:
            self.draft.update(bs, draft_s, self.lr)
        if total_tokens <= bs:
            self.plain.update(bs, verify_s, self.lr)
        else:
            self.verify.update(total_tokens, verify_s, self.lr)

    def probe(
        self,
        time_draft: Callable[[int], float | None],
        time_verify: Callable[[int], float | None],
        budget_s: float = 2.0,
        agree: Callable[[bool], bool] = bool,
        time_plain: Callable[[int], float | None] | None = None,
        repeats: int = 2,
    ) -> None:
        """Fill the tables by timing real forwards: ``time_draft(bs)``, ``time_verify(n)`` and ``time_plain(bs)``
        return seconds (None: cannot be measured here, e.g. too few KV slots; ``time_plain`` None: the plain
        table takes the verify table's values). Every other grid point (1, 4, 16, ...) is timed, cheapest
        first, at least three of them and more while ``budget_s`` per table lasts; the tables are timed
        INTERLEAVED (point i of each before point i + 1 of any), each point the minimum of ``repeats``
        timings, so that a machine whose speed drifts (other jobs) does not skew one table against another.
        The points between are interpolated and the ones past the last measurement extrapolated linearly
        from the last two (a wide span, so timing noise hardly tilts the slope).
        ``agree(stop)`` makes every tensor-parallel rank take rank 0's stop decision (same forwards)."""
        import time

        tables = [(self.verify, time_verify), (self.draft, time_draft)]
        if time_plain is not None:
            tables.append((self.plain, time_plain))
        points: list[tuple[list[float], list[float]]] = [([], []) for _ in tables]
        open_ = [True] * len(tables)
        for _, fn in tables:
            fn(1)  # warm-up (first-call allocations)
        start = time.perf_counter()
        for i in range(max(len(table.x[::2]) for table, _ in tables)):
            if agree(i >= 3 and time.perf_counter() - start > budget_s * len(tables)):
                break
            for t, (table, fn) in enumerate(tables):
                if not open_[t] or i >= len(table.x[::2]):
                    continue
                x = table.x[::2][i]
                ys = [fn(int(x)) for _ in range(repeats)]
                if any(y is None for y in ys):
                    open_[t] = False
                    continue
                points[t][0].append(x)
                points[t][1].append(min(ys))
        for (table, _), (xs, ys) in zip(tables, points, strict=True):
            if not xs:
                raise RuntimeError("the step-cost probe could not time a single forward (KV cache too small?)")
            if len(xs) == 1:  # a small pool or one request row: proportional beyond the one point (pessimistic)
                xs, ys = [0.0, xs[0]], [0.0, ys[0]]
            ys = np.maximum.accumulate(np.asarray(ys))  # more work never takes less time
            inside = table.x <= xs[-1]
            table.y[inside] = np.interp(table.x[inside], xs, ys)
            slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
            table.y[~inside] = ys[-1] + slope * (table.x[~inside] - xs[-1])
        if time_plain is None:
            self.plain.y[:] = self.verify(self.plain.x)
        self.probed = True
