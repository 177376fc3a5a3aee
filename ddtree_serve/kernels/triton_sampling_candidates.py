"""Candidate sets and the draw for the sampling kernel (``kernels/triton_sampling.py``).

After pass 1 the first radix digit of every threshold the row needs is known: top-k's k-th largest key lies in the
bin ``kd0`` (exact counts), top-p's in a bin at or above ``pd0`` (top-k's survivors or the whole row); min-p keeps
``e >= min_p``. Every kept logit is then among the row's candidates: keys in a bin ``>= kd0`` (top-k on), else
``>= pd0`` (top-p on), else ``e >= min_p`` (min-p alone). Pass 2 (``collect``) writes the candidates' logits and
indices, in index order, to a per-program buffer of ``CAP`` entries (a barrier after it; the buffer read at
L2, ``.cg``, so every warp sees every warp's writes); the exact thresholds (``cand_thresholds``:
bisection over the keys, each step a count or a mass over the buffer) and the draw (``cand_draw``) then read the
buffer only (``CAP`` x 8 bytes, cache-resident), never the row again. A row whose candidates would not fit
(counted from pass 1's histogram: top-k / top-p; counted by ``collect``: min-p) takes the row-wide radix search
(``triton_sampling_radix.radix_thresholds``) and the row-wide draw (``row_draw``).

Top-p's ``pd0`` is picked for 1.001 times its mass target: pass 1's mass histogram is summed in tf32 halves (~22
bits), so a bin chosen for the exact target could sit one above the true threshold's; if the buffer's mass still
falls short of the target, the row falls back to the row-wide search (never a wrong threshold).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ddtree_serve.kernels.triton_sampling_radix import TINY, key_value, ukeys, weights


@triton.jit
def collect(base, V, m, temp, min_p, lo_key, min_e, cand_x, cand_i, CAP: tl.constexpr, BLOCK: tl.constexpr):
    """Pass 2: writes the logits whose key is ``>= lo_key`` and whose ``e >= min_e``, and their indices, in index
    order to ``cand_x`` / ``cand_i`` ``[CAP]`` float32 (those past ``CAP`` counted, not written). Returns their
    count and the row's mass of ``e >= min_p`` (min-p's kept total)."""
    offs = tl.arange(0, BLOCK)
    n = 0
    kept = 0.0
    for start in range(0, V, BLOCK):
        valid = start + offs < V
        x = tl.load(base + start + offs, mask=valid, other=-float("inf")).to(tl.float32)  # [BLOCK]
        e = weights(x, m, temp)  # [BLOCK]
        kept += tl.sum(tl.where(e >= min_p, e, 0.0), 0)
        sel = valid & (ukeys(x) >= lo_key) & (e >= min_e)  # [BLOCK]
        pos = n + tl.cumsum(sel.to(tl.int32), 0) - 1  # [BLOCK] buffer slot of each selected logit
        tl.store(cand_x + pos, x, mask=sel & (pos < CAP))
        tl.store(cand_i + pos, (start + offs).to(tl.float32), mask=sel & (pos < CAP))  # exact below 2^24
        n += tl.sum(sel.to(tl.int32), 0)
    return n, kept


@triton.jit
def _suffix(cand_x, n, t, m, temp, CB: tl.constexpr):
    """The count and the mass of the ``n`` buffered candidates whose key is ``>= t`` (chunks of ``CB``)."""
    offs = tl.arange(0, CB)
    cnt = 0.0
    mass = 0.0
    for s in range(0, n, CB):
        valid = s + offs < n
        x = tl.load(cand_x + s + offs, mask=valid, other=-float("inf"), cache_modifier=".cg")  # [CB]
        sel = valid & (ukeys(x) >= t)
        cnt += tl.sum(sel.to(tl.float32), 0)
        mass += tl.sum(tl.where(sel, weights(x, m, temp), 0.0), 0)
    return cnt, mass


@triton.jit
def _largest_key(cand_x, n, lo, hi, want, m, temp, BY_MASS: tl.constexpr, CB: tl.constexpr):
    """The largest key ``t`` in ``[lo, hi)`` whose candidates ``{key >= t}`` number ``want`` (mass ``want``:
    ``BY_MASS``) or more, by bisection; ``lo`` must reach ``want`` and ``hi`` must not. It is a candidate's key."""
    while hi - lo > 1:
        mid = lo + (hi - lo) // 2
        cnt, mass = _suffix(cand_x, n, mid, m, temp, CB)
        if BY_MASS:
            ok = mass >= want
        else:
            ok = cnt >= want
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid)
    return lo


@triton.jit
def cand_thresholds(cand_x, n, m, s_all, temp, k, top_p, min_p, V, lo_key, CB: tl.constexpr):
    """The kept threshold on ``e`` (max of top-k's, top-p's and min-p's) from the buffer, and whether the buffer
    held it (False only when top-p alone needs mass below the candidates: the row-wide search runs instead)."""
    k_on = k < V
    hi = ukeys(m) + 1  # no key reaches above the max's
    tk = lo_key
    t_k = 0.0
    s_k = s_all
    if k_on:
        tk = _largest_key(cand_x, n, lo_key, hi, k.to(tl.float32), m, temp, False, CB)
        cnt, s_k = _suffix(cand_x, n, tk, m, temp, CB)
        t_k = weights(key_value(tk), m, temp)
    t_p = 0.0
    ok = True
    if top_p < 1.0:
        want = tl.maximum(top_p * s_k, TINY)
        cnt, have = _suffix(cand_x, n, tk, m, temp, CB)
        if have >= want:
            t_p = weights(key_value(_largest_key(cand_x, n, tk, hi, want, m, temp, True, CB)), m, temp)
        else:  # top-k's survivors: rounding, top-p keeps them all; top-p alone: its threshold is below the buffer
            ok = k_on
    return tl.maximum(tl.maximum(t_k, t_p), min_p), ok


@triton.jit
def cand_draw(cand_x, cand_i, n, m, temp, thr, u, V, CB: tl.constexpr):
    """The inverse-CDF draw over the kept candidates (``e >= thr``, ``e > 0``) in index order: the first whose
    running mass exceeds ``u`` times their total (rounding leaving none: the last kept; none kept: ``V - 1``)."""
    offs = tl.arange(0, CB)
    total = 0.0
    for s in range(0, n, CB):
        x = tl.load(cand_x + s + offs, mask=s + offs < n, other=-float("inf"), cache_modifier=".cg")  # [CB]
        e = weights(x, m, temp)
        total += tl.sum(tl.where((e >= thr) & (e > 0), e, 0.0), 0)
    target = u * total
    run = 0.0
    token = V
    last = -1
    for s in range(0, n, CB):
        valid = s + offs < n
        x = tl.load(cand_x + s + offs, mask=valid, other=-float("inf"), cache_modifier=".cg")  # [CB]
        idx = tl.load(cand_i + s + offs, mask=valid, other=0.0, cache_modifier=".cg").to(tl.int32)  # [CB] increasing
        e = weights(x, m, temp)
        w = tl.where((e >= thr) & (e > 0), e, 0.0)
        cum = run + tl.cumsum(w, 0)
        token = tl.minimum(token, tl.min(tl.where((cum > target) & (w > 0), idx, V), 0))
        last = tl.maximum(last, tl.max(tl.where(w > 0, idx, -1), 0))
        run += tl.sum(w, 0)
    return tl.where(token < V, token, tl.where(last >= 0, last, V - 1))


@triton.jit
def row_draw(base, V, m, temp, thr, target, start, run, BLOCK: tl.constexpr):
    """The draw over the row from index ``start`` (a block's first) with ``run`` the kept mass before it: the
    first kept index whose running kept mass exceeds ``target``, stopping at its block (rounding leaving none:
    the last kept index; none kept: ``V - 1``). Returns it and the blocks read."""
    offs = tl.arange(0, BLOCK)
    token = -1
    last = -1
    blocks = 0
    while (start < V) & (token < 0):
        x = tl.load(base + start + offs, mask=start + offs < V, other=-float("inf")).to(tl.float32)  # [BLOCK]
        e = weights(x, m, temp)
        w = tl.where((e >= thr) & (e > 0), e, 0.0)
        cum = run + tl.cumsum(w, 0)
        first = tl.min(tl.where((cum > target) & (w > 0), start + offs, V), 0)
        token = tl.where(first < V, first, token)
        last = tl.maximum(last, tl.max(tl.where(w > 0, start + offs, -1), 0))
        run += tl.sum(w, 0)
        start += BLOCK
        blocks += 1
    return tl.where(token >= 0, token, tl.where(last >= 0, last, V - 1)), blocks
