"""The batch's best split of extra tree tokens (the adaptive budget's decision, ``ddtree_serve.speculative.budget``).

With the marginal gains of every request non-increasing along its pop order, the best allocation of n extra tree
tokens over the batch takes the n largest gains (each request keeps a prefix of its pops); one sort and one
cumulative sum give the expected tokens of every n, and a step-time model turns them into a rate; the argmax
wins (n = 0: no tree).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np


def choose_budgets(
    gains: np.ndarray,
    step_time: Callable[[np.ndarray], np.ndarray],
    max_total_tokens: int | None = None,
    padded: bool = False,
    widths: np.ndarray | None = None,
) -> tuple[np.ndarray, float]:
    """Budgets [bs] maximising ``(bs + expected accepted tokens) / step_time(verified tokens)``, and that rate.

    gains [bs, B]: expected accepted tokens added by each successive pop of each request (non-increasing
    along a row; zero for pops that do not exist). step_time: seconds for a number of verified tree tokens,
    roots included (vectorised). max_total_tokens: cap on those tokens. padded=False: a step verifies
    ``bs + sum(budgets)`` tokens, so the n largest gains of the batch win (each request keeps a prefix of
    its pops); padded=True: every request is padded to the widest tree, ``bs * (1 + max(budgets))`` tokens,
    so for a width w every request takes its first w pops; ``widths`` (padded only): the widths allowed
    (those a captured graph or a built tree holds), 0 always. Ties prefer fewer tokens; among equal gains in
    the unpadded case, the earlier request."""
    bs, width = gains.shape
    positive = (gains > 0).sum(axis=1)  # [bs] pops worth anything (a prefix: rows are non-increasing)
    if padded:
        expected = bs + np.concatenate([[0.0], np.cumsum(gains.sum(axis=0))])  # [B+1] by width
        tokens = bs * (1 + np.arange(width + 1))  # [B+1]
    else:
        flat = gains.reshape(-1)  # [bs*B]
        keep = np.flatnonzero(flat > 0)
        order = keep[np.argsort(-flat[keep], kind="stable")]  # row-major stable: each row keeps a prefix
        expected = bs + np.concatenate([[0.0], np.cumsum(flat[order])])  # [n+1] by extra tokens
        tokens = bs + np.arange(len(order) + 1)  # [n+1]
    rate = expected / np.maximum(step_time(tokens), 1e-12)
    if max_total_tokens is not None:
        rate[1:][tokens[1:] > max_total_tokens] = -np.inf
    if padded and widths is not None:
        rate[1:][~np.isin(np.arange(1, width + 1), widths)] = -np.inf
    n = int(np.argmax(rate))
    if padded:
        return np.minimum(positive, n), float(rate[n])
    return np.bincount(order[:n] // width, minlength=bs), float(rate[n])


def merged_gains(curve: np.ndarray, suffix: np.ndarray, width: int) -> np.ndarray:
    """Predicted gains [bs, width] of a drafted step whose tree merges DFlash's pops (``curve`` [bs, B], the
    predicted mean curve) with this step's suffix drafts (``suffix`` [bs, S]), both non-increasing along a row:
    at each pop index the larger of the two. The two sources often propose the same continuation (a
    repeated phrase is what both see), and a node proposed twice is one node in the merged tree
    (``draft_sources.merge_popped``), so adding the rows counted that probability twice; the larger is what
    the merged tree keeps if their best nodes coincide, a lower bound otherwise. The drafter forward is then
    planned only when DFlash's own curve beats the suffix drafts by enough to pay for it (measured on chat
    text at batch 8: the sum planned drafted steps that lost, docs/BENCHMARKS.md)."""
    out = np.zeros((curve.shape[0], width))  # [bs, width]
    out[:, :min(width, curve.shape[1])] = curve[:, :width]
    k = min(width, suffix.shape[1])
    out[:, :k] = np.maximum(out[:, :k], suffix[:, :k])
    return out  # elementwise max of two non-increasing rows: non-increasing


def pops_could_matter(gains: np.ndarray, counts: np.ndarray, width: int, rate: float,
                      step_time: Callable[[np.ndarray], np.ndarray], max_budget: int,
                      max_total_tokens: int | None = None, padded: bool = False) -> bool:
    """Whether some allocation using pops past ``width`` could beat ``rate`` (``BudgetController.pop_and_choose``):
    the pops past a cut row (``counts`` [bs] >= ``width``) have gains at most that row's last gain g, so
    ``(bs + H(n)) / step_time(bs + n)``, with H the batch's sorted popped gains ``gains`` [bs, width] merged with
    an endless supply of g, bounds the rate of every allocation. Padded steps: no bound, any cut row matters."""
    bs = gains.shape[0]
    cut = counts >= width  # [bs] rows that may have more pops
    if padded or width == 0 or not cut.any():
        return bool(cut.any())
    g = float(gains[cut, width - 1].max())  # no unpopped gain exceeds this
    if g <= 0:
        return False
    flat = np.sort(gains.reshape(-1))[::-1]  # [bs*w] descending
    extra = bs * max_budget  # tokens of the largest possible allocation
    h = np.concatenate([flat[flat >= g], np.full(extra, g)])[:extra]  # [extra] merged, descending
    tokens = bs + np.arange(extra + 1)  # [extra + 1] verified tokens
    bound = (bs + np.concatenate([[0.0], np.cumsum(h)])) / np.maximum(step_time(tokens), 1e-12)
    if max_total_tokens is not None:
        bound[1:][tokens[1:] > max_total_tokens] = -np.inf
    return bool(bound.max() > rate * (1 + 1e-9))
