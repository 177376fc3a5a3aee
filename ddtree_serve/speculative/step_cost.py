"""Step-time model of a speculative decode step, measured on the machine it runs on.

A step over ``bs`` requests that verifies ``n`` tokens (roots included; ``e = n - bs`` tree nodes) costs

    draft(bs) [when it drafts] + plain(bs)       when e = 0 (every tree is its root alone)
    draft(bs) [when it drafts] + verify(bs, e)   when e > 0

``draft``: the drafter forward over ``bs`` blocks and the pops. ``plain``: the plain decode step (causal
decode forward + sampler) that the worker runs when every tree is its root alone. ``verify``: the whole
tree-verify step (a forward over ``bs + e`` tokens under the tree mask, verification, commit). The same
``e`` costs differently split over 1 request or over 16 (per-request attention and masks, a larger
forward), so ``verify`` is one table over ``e`` per batch-size grid point (1, 2, 4, ...), interpolated
linearly in ``bs`` between them (the last table beyond). A single table over total tokens let batch-1
steps (16 nodes, cheap) and batch-16 steps (16 roots + a few nodes, dear) pull the same points, pricing
small trees at large batch far too low (docs/BENCHMARKS.md).

Each table learns only from the steps it prices. An earlier model learned a tree table of ``verify -
plain``, the measured verify step minus the plain table: while every step drafts, the plain table is
measured one step in ``plain_refresh_every``, so a slowdown of the machine went into the tree table alone
and, once a plain step measured it, was charged twice (session 8 measurements, in the git history of docs/BENCHMARKS.md). Instead the
drafter point and the verify table at a batch-size grid point follow the plain table there, one way, by
what they have not seen: each point keeps the step at which it was measured (blended as its value is), and
a plain observation that moves the plain value by a factor f scales a point by ``1 + u (f - 1)``, u the
share of the time since the plain point's previous measurement that passed after the point's (1 for a
point older than the plain one). While no step drafts (explorations aside), a slowdown or growing contexts
that plain steps measure so reach the drafted prices, which stayed stale-cheap before and kept losing
explorations coming; while every step drafts, a plain refresh step moves what the drafted steps measured by
a small share only (the slowdown it finds is mostly one they saw). The plain table never follows the
others: its one point per batch size telescopes (the product of its factors is its own change), while
following the noisy per-node points of a verify table compounded (tests/speculative/
test_budget_closed_loop.py, DESIGN 4.8).

Every table is piecewise linear over a geometric grid of its argument, extrapolated linearly past the
last point. A start-up probe (``probe``) times real forwards: for bs = 1, 4, 16, ... and the largest batch
size (the last table's) while its time budget lasts, the drafter, a plain step and tree-verify steps with 1, bs, 4 bs, 16 bs (and 64 bs up to 256)
nodes, each the minimum of ``repeats`` timings. Then every step's measured phase times move the grid
points around the observation (a running mean at first, so that real steps soon outweigh the probe's
empty contexts, then an average of rate ``lr``), so the model follows the machine's load and the
requests' context lengths. The plain table's evidence halves every ``plain_half_life`` steps that no plain
step measures it: the controller stops measuring the plain price exactly when it looks dear (it drafts
then), so a price that one noisy stretch, or a slowdown since over, left too high would otherwise persist
through the drafting it causes (the verify tables have the mirror case covered by following the plain
table); its next measurement, which ``BudgetController`` forces once the price is ``plain_refresh_every``
steps old, now counts for most of it.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable

import numpy as np


def geometric_grid(limit: int, factor: int = 2) -> np.ndarray:
    """1, factor, factor^2, ... up to the first power >= ``limit`` (at least two points)."""
    pts = [1]
    while pts[-1] < max(limit, 2):
        pts.append(pts[-1] * factor)
    return np.asarray(pts, dtype=np.float64)


class PiecewiseLinear:
    """y(x) on a grid of x values; linear between points, linear extrapolation past the ends."""

    def __init__(self, grid: np.ndarray, values: np.ndarray | None = None):
        self.x = np.asarray(grid, dtype=np.float64)  # [G]
        self.y = (
            np.zeros_like(self.x) if values is None else np.asarray(values, dtype=np.float64).copy()
        )  # [G]
        self.evidence = np.ones_like(self.x)  # [G] observations behind each point (the probe counts as one)
        self.time = np.zeros_like(self.x)  # [G] when each point was measured (blended like its value; probe: 0)
        self.last = np.zeros_like(self.x)  # [G] when each point was last moved by a measurement (probe: 0)
        self._xs = self.x.tolist()  # the grid as Python floats (scalar lookups, once per step)

    def _bracket_scalar(self, x: float) -> tuple[int, float]:
        """``_bracket`` for one query, without numpy (the per-step scalar path)."""
        xs = self._xs
        i = min(max(bisect_right(xs, x) - 1, 0), len(xs) - 2)
        return i, (x - xs[i]) / (xs[i + 1] - xs[i])

    def at(self, x: float) -> float:
        """``self(x)`` for one scalar query."""
        i, w = self._bracket_scalar(float(x))
        return max((1 - w) * float(self.y[i]) + w * float(self.y[i + 1]), 0.0)

    def _bracket(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Left grid index and the weight of the right point, per query (weights may leave [0, 1])."""
        i = np.clip(np.searchsorted(self.x, x, side="right") - 1, 0, len(self.x) - 2)
        w = (x - self.x[i]) / (self.x[i + 1] - self.x[i])
        return i, w

    def __call__(self, x: np.ndarray | float) -> np.ndarray:
        xa = np.asarray(x, dtype=np.float64)
        i, w = self._bracket(xa)
        return np.maximum((1 - w) * self.y[i] + w * self.y[i + 1], 0.0)

    def update(self, x: float, target: float, lr: float, weight: float = 1.0, now: float = 0.0,
               half_life: float = 0.0) -> None:
        """Move the interpolated value at ``x`` towards ``target``: each bracketing point by its share of the
        error (weights clipped to [0, 1], so an extrapolated observation only moves the nearest point) times
        its rate, ``max(lr, 1 / evidence)``: a running mean while a point has little evidence (the first
        observation after the probe weighs as much as the probe), an average of rate ``lr`` after. ``weight``
        scales the observation (a step between two tables); ``lr <= 0`` freezes the table. ``now``: the
        observation's time (step count), blended into each point's measurement time by the same rate.
        ``half_life`` > 0: a point's evidence (at most the ``1 / lr`` observations an average of rate ``lr``
        holds) halves every ``half_life`` steps since its last measurement, so an observation after a long
        gap weighs more (after 64 unmeasured steps at half-life 32 and lr 0.2: rate 0.44 instead of 0.2)."""
        if lr <= 0 or weight <= 0:
            return
        err = target - self.at(x)
        i, w = self._bracket_scalar(float(x))
        w = min(max(w, 0.0), 1.0)
        for j, share in ((i, (1 - w) * weight), (i + 1, w * weight)):
            if share > 0:
                if half_life > 0:
                    held = min(self.evidence[j], 1.0 / lr)
                    self.evidence[j] = held * 0.5 ** (max(now - self.last[j], 0.0) / half_life)
                self.evidence[j] += share
                rate = max(lr, 1.0 / self.evidence[j]) * share
                self.y[j] += rate * err
                self.time[j] += rate * (now - self.time[j])
                self.last[j] = now


class StepCostModel:
    """Seconds per step: ``draft(bs) * drafted + plain(bs)`` without tree nodes, ``draft(bs) * drafted +
    verify(bs, n - bs)`` with them (module docstring)."""

    def __init__(self, max_batch: int, max_budget: int, lr: float = 0.2, plain_half_life: float = 32.0):
        self.max_budget = max_budget  # nodes per request at most
        self.draft = PiecewiseLinear(geometric_grid(max_batch))
        self.plain = PiecewiseLinear(geometric_grid(max_batch))
        self.verify_bs = geometric_grid(max_batch)  # [G] batch sizes of the verify tables: 1, 2, 4, ...
        self.verify = [PiecewiseLinear(geometric_grid(max_batch * max_budget)) for _ in self.verify_bs]
        self.lr = lr
        self.plain_half_life = plain_half_life  # evidence half-life of the plain table (module docstring)
        self.steps = 0  # observations so far: the clock of the tables' measurement times
        self.probed = False

    def _bs_weights(self, bs: int) -> tuple[int, float]:
        """Left verify table and the weight of the right one for ``bs`` (clipped: the last table beyond)."""
        g = self.verify_bs
        i = int(np.clip(np.searchsorted(g, bs, side="right") - 1, 0, len(g) - 2))
        w = float(np.clip((bs - g[i]) / (g[i + 1] - g[i]), 0.0, 1.0))
        return i, w

    def verify_time(self, bs: int, extra: np.ndarray | float) -> np.ndarray:
        """Seconds of a tree-verify step over ``bs`` requests holding ``extra`` (>= 1) nodes in all."""
        i, w = self._bs_weights(bs)
        return (1 - w) * self.verify[i](extra) + w * self.verify[i + 1](extra)

    def step_time(self, bs: int, total_tokens: np.ndarray | int, drafted: bool) -> np.ndarray:
        """Predicted seconds of a step over ``bs`` requests verifying ``total_tokens`` tokens (vectorised over
        total_tokens; ``total_tokens == bs``: a plain step)."""
        e = np.asarray(total_tokens, dtype=np.float64) - bs
        t = np.where(e > 0, self.verify_time(bs, np.maximum(e, 1.0)), self.plain.at(bs))
        return t + (self.draft.at(bs) if drafted else 0.0)

    def plain_time(self, bs: int) -> float:
        """Predicted seconds of a plain decode step over ``bs`` requests (``step_time(bs, bs, False)``)."""
        return self.plain.at(bs)

    def plain_age(self, bs: int) -> float:
        """Steps since a plain step last measured the plain price at ``bs`` (its bracketing points, weighted)."""
        i, w = self.plain._bracket_scalar(float(bs))
        w = min(max(w, 0.0), 1.0)
        return self.steps - ((1 - w) * self.plain.last[i] + w * self.plain.last[i + 1])

    def observe(self, bs: int, total_tokens: int, draft_s: float | None, verify_s: float) -> None:
        """One step's measured phase times (``draft_s`` None when the step did not draft; ``verify_s``: the
        plain step's time when ``total_tokens == bs``, else the tree-verify step's). A batch size between two
        verify tables moves each by its weight, towards the measurement shifted by the plain table's
        difference between the two batch sizes (a difference within one table, at one moment). A plain step
        moves the drafter and verify points by the share of the plain table's change they have not seen
        (module docstring)."""
        self.steps += 1
        now = float(self.steps)
        if draft_s is not None:
            self.draft.update(bs, draft_s, self.lr, now=now)
        e = total_tokens - bs
        if e <= 0:  # the common step where speculation does not pay: scalar work on the two points it moves
            i, _ = self.plain._bracket_scalar(float(bs))
            before = [(j, float(self.plain.y[j]), now - float(self.plain.time[j])) for j in (i, i + 1)]
            self.plain.update(bs, verify_s, self.lr, now=now, half_life=self.plain_half_life)
            for j, y, since in before:
                change = float(self.plain.y[j]) / y - 1.0 if y > 0 else 0.0  # relative
                if change == 0.0:
                    continue
                table = self.verify[j]
                table.y *= 1.0 + _unseen(now - table.time, since) * change  # [E]
                if draft_s is None:  # (a step that drafted and chose no node measured the drafter)
                    self.draft.y[j] *= 1.0 + float(_unseen(now - self.draft.time[j], since)) * change
            return
        i, w = self._bs_weights(bs)
        here = self.plain.at(bs)
        for j, weight in ((i, 1 - w), (i + 1, w)):
            if weight > 0:
                target = verify_s + self.plain.at(float(self.verify_bs[j])) - here
                self.verify[j].update(e, target, self.lr, weight, now=now)

    def probe(
        self,
        time_draft: Callable[[int], float | None],
        time_plain: Callable[[int], float | None],
        time_verify: Callable[[int, int], float | None],
        budget_s: float = 4.5,
        agree: Callable[[bool], bool] = bool,
        repeats: int = 2,
    ) -> None:
        """Fill the tables by timing real forwards: ``time_draft(bs)``, ``time_plain(bs)`` and
        ``time_verify(bs, e)`` (a whole tree-verify step: ``bs`` requests, ``e`` nodes spread over them) return
        seconds, or None when they cannot run here (too few KV slots or request rows). For bs = 1, 4, 16, ...
        and the last table's batch size (at least two, more while ``budget_s`` lasts; the last one measured: the
        extra cost of a batch past the probed ones, read at its node count off a smaller batch's table, was
        priced ~30% high where the cost per node falls with the batch, so wide trees never ran there): the three
        timings, ``e`` in 1, bs, 4 bs, 16 bs, 64 bs (up
        to 256: large trees cost more than a straight line through small ones predicts; at most
        ``max_budget`` per request). Each point is the minimum of ``repeats`` timings (other jobs only add
        time). Grid points between are interpolated, points past the last measurement extrapolated from the
        last two. A verify table between two probed batch sizes gets the plain table's value at its batch
        size plus the tree's extra cost (verify - plain) interpolated between them; one past the last probed
        batch size, that batch size's extra cost. ``agree(stop)`` makes every tensor-parallel rank take rank
        0's stop decision."""
        import time

        def best(fn: Callable[..., float | None], *args: int) -> float | None:
            ys = [fn(*args) for _ in range(repeats)]
            return None if any(y is None for y in ys) else min(ys)  # type: ignore[type-var]

        time_draft(1), time_plain(1), time_verify(1, 1)  # warm-up (first-call allocations)
        start = time.perf_counter()
        draft_pts: list[tuple[float, float]] = []
        plain_pts: list[tuple[float, float]] = []
        extra_pts: dict[int, list[tuple[float, float]]] = {}  # probed bs -> (e, verify - plain)
        last = int(self.verify_bs[-1])
        sizes = sorted({min(int(b), last) for b in geometric_grid(last, 4)})  # 1, 4, 16, ... and the last table's
        for i, g in enumerate(sizes):
            if agree(i >= 2 and time.perf_counter() - start > budget_s):
                break
            d, p = best(time_draft, g), best(time_plain, g)
            if d is None or p is None:
                break
            draft_pts.append((g, d))
            plain_pts.append((g, p))
            pts = []
            for e in sorted({1, g, 4 * g, 16 * g} | ({64 * g} if 64 * g <= 256 else set())):
                v = best(time_verify, g, e) if e <= g * self.max_budget else None
                if v is None:
                    break
                pts.append((e, max(v - p, 0.0)))
            if not pts:
                break
            extra_pts[g] = pts
        if not extra_pts:
            raise RuntimeError("the step-cost probe could not time a single forward (KV cache too small?)")
        _fit(self.draft, draft_pts)
        _fit(self.plain, plain_pts)
        probed = sorted(extra_pts)
        extra = {g: PiecewiseLinear(self.verify[0].x) for g in probed}
        for g in probed:
            _fit(extra[g], extra_pts[g])
        for table, b in zip(self.verify, self.verify_bs.tolist(), strict=True):
            lo = max([g for g in probed if g <= b], default=probed[0])
            hi = min([g for g in probed if g >= b], default=probed[-1])
            w = 0.0 if hi == lo else (b - lo) / (hi - lo)
            table.y[:] = self.plain.at(b) + (1 - w) * extra[lo].y + w * extra[hi].y
        self.probed = True


def _unseen(age: np.ndarray, plain_age: np.ndarray | float) -> np.ndarray:
    """Share of a plain table's change that a table measured ``age`` steps ago has not seen, the plain point
    having been measured ``plain_age`` steps ago: all of it when the table is the older one, else the share
    of the interval since the plain measurement that came after the table's (a change as likely at any
    step)."""
    return np.clip(age / np.maximum(plain_age, 1e-9), 0.0, 1.0)


def _fit(table: PiecewiseLinear, points: list[tuple[float, float]]) -> None:
    """Table values from measured (x, seconds): interpolated inside, extrapolated linearly from the last two
    points beyond (a wide span, so timing noise hardly tilts the slope); one point: proportional to it
    (pessimistic). More work never takes less time: the measurements are made non-decreasing first."""
    xs = [x for x, _ in points]
    ys = list(np.maximum.accumulate([y for _, y in points]))
    if len(xs) == 1:
        xs, ys = [0.0, xs[0]], [0.0, ys[0]]
    inside = table.x <= xs[-1]
    table.y[inside] = np.interp(table.x[inside], xs, ys)
    slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
    table.y[~inside] = ys[-1] + slope * (table.x[~inside] - xs[-1])
