"""Radix select over a logits row for the sampling kernel (``kernels/triton_sampling.py``): float32 keys, the
histogram passes and the row-wide threshold search (the path a row takes when its candidate set would not fit
the kernel's buffer, ``kernels/triton_sampling_candidates.py``).

Keys. A float32 logit's bits mapped to a uint32 whose unsigned order is the float order (``ukeys``: negative
floats flip every bit, the others set the sign bit). The weights ``e = exp((l - m) / T)`` (``m`` the row's max) are
a non-decreasing function of the key, so the k-th largest ``e`` is ``e`` of the k-th largest key, and the largest
``e``-threshold whose kept mass reaches a target is ``e`` of the largest key whose ``{key >= x}`` mass reaches it
(ties in ``e`` from rounding included): both searches run on the keys of the logits, and the first can start
before ``m`` is known.

Radix select. Three digits of 11, 11 and 10 bits (2,048 bins). One pass over the row builds, for the elements that
share the digits chosen so far, the count and the mass (sum of ``e``) of every bin of the next digit; the digit
kept is the largest whose suffix (that bin and those above) still holds ``k`` elements (top-k) or ``top_p * S``
of mass (top-p). A histogram of 2,048 bins is small matrix products per slice of 64 logits: the one-hot of the
digit's low 5 bits ``[32, BLOCK]`` times the one-hot of its high 6 bits ``[BLOCK, 64]`` (weighted by ``e`` for
the mass), so the sums run in a fixed order (deterministic, as two TP ranks need; no float atomics, which are
what make flashinfer's radix top-p nondeterministic). On a GPU they run on tensor cores in tf32: the one-hots
are exact (so are the counts), the weight is split into its high 11 significant bits and the rest (two
products, ~22 bits). A block with no element of the chosen bin skips its products (most blocks after pass 1);
the slices of one that has re-read it from cache.

The row-wide search (``radix_thresholds``) after pass 1: top-k's digits 2 and 3 (2 passes; the survivors' mass
``S_k`` from the three levels' mass histograms); top-p over the survivors (target ``top_p * S_k``): its first
digit from pass 1's histogram, digits 2 and 3 from top-k's histograms while top-p's digits equal top-k's, else one
pass each; min-p's kept mass (``e >= min_p``, ``max e = 1``) rides along any of these passes (a pass of its own
when none ran and it decides the kept set).
"""

from __future__ import annotations

import triton
import triton.language as tl

_HI: tl.constexpr = tl.constexpr(64)  # bins of a digit's high 6 bits
_LO: tl.constexpr = tl.constexpr(32)  # bins of its low 5 bits
HIST_BLOCK = 64  # logits per histogram product (its K): more spills registers (triton_smem_check.py)
TINY: tl.constexpr = tl.constexpr(1.1754944e-38)  # least normal float32: a mass target above 0


@triton.jit
def weights(x, m, temp):
    """e = exp((x - m) / T) in [0, 1]; 0 for -inf logits (also when m is -inf)."""
    return tl.where(x > -float("inf"), tl.exp((x - m) / temp), 0.0)


@triton.jit
def ukeys(x):
    """float32 -> uint32 keys whose unsigned order is the float order."""
    b = x.to(tl.uint32, bitcast=True)
    return tl.where((b >> 31) != 0, ~b, b | 0x80000000)


@triton.jit
def key_value(key):
    """The float32 of a key (``ukeys``' inverse)."""
    b = tl.where((key >> 31) != 0, key ^ 0x80000000, ~key)
    return b.to(tl.float32, bitcast=True)


@triton.jit
def _block_hist(digit, sel, e, COUNT: tl.constexpr):
    """Counts (``COUNT``; else zeros) and masses ``[32, 64]`` (bin ``hi * 32 + lo`` at ``[lo, hi]``) of ``digit
    [BLOCK]`` over the ``sel`` elements: the one-hot of the low 5 bits ``[32, BLOCK]`` times that of the high 6
    bits ``[BLOCK, 64]`` (M = 32: mma.sync on every arch; Triton 3.6's sm100 tensor-memory path fails on these
    reductions). The mass is two tf32 products, of ``e``'s high 11 significant bits and of the rest (~22 bits in
    all; the one-hots are exact in tf32, so the counts are exact)."""
    lo = (tl.arange(0, _LO)[:, None] == (digit & 31)[None, :]).to(tl.float32)  # [32, BLOCK]
    hit = ((digit >> 5)[:, None] == tl.arange(0, _HI)[None, :]) & sel[:, None]  # [BLOCK, 64]
    e_hi = (e.to(tl.uint32, bitcast=True) & 0xFFFFE000).to(tl.float32, bitcast=True)  # [BLOCK] tf32-exact
    mass = tl.dot(lo, tl.where(hit, e_hi[:, None], 0.0), input_precision="tf32")  # [32, 64]
    mass = tl.dot(lo, tl.where(hit, (e - e_hi)[:, None], 0.0), mass, input_precision="tf32")
    if COUNT:
        cnt = tl.dot(lo, hit.to(tl.float32), input_precision="tf32")  # [32, 64]
    else:
        cnt = tl.zeros([_LO, _HI], dtype=tl.float32)
    return cnt, mass


@triton.jit
def first_pass(base, V, temp, HIST, BLOCK: tl.constexpr, HBLOCK: tl.constexpr, NB: tl.constexpr):
    """Pass 1: the max, the row's mass, each block's mass ``[NB]`` (relative to the max, rescaled as the max
    grows: the draw of an unfiltered row starts at the block holding its crossing) and (``HIST``) the first
    digit's count and mass histograms ``[32, 64]`` (blocks of ``BLOCK`` logits; the histograms over their
    ``HBLOCK`` slices, re-read from cache)."""
    offs = tl.arange(0, BLOCK)
    bidx = tl.arange(0, NB)
    bm = tl.zeros([NB], dtype=tl.float32)
    hoffs = tl.arange(0, HBLOCK)
    m = -float("inf")
    s = 0.0
    cnt = tl.zeros([_LO, _HI], dtype=tl.float32)
    mass = tl.zeros([_LO, _HI], dtype=tl.float32)
    for start in range(0, V, BLOCK):
        x = tl.load(base + start + offs, mask=start + offs < V, other=-float("inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, 0))
        scale = tl.where(m_new > -float("inf"), tl.exp((m - m_new) / temp), 0.0)
        bsum = tl.sum(weights(x, m_new, temp), 0)
        s = s * scale + bsum
        bm = bm * scale + tl.where(bidx == start // BLOCK, bsum, 0.0)  # [NB]
        if HIST:
            mass = mass * scale
            for sub in range(start, start + BLOCK, HBLOCK):
                valid = sub + hoffs < V
                xs = tl.load(base + sub + hoffs, mask=valid, other=-float("inf")).to(tl.float32)  # [HBLOCK]
                c, w = _block_hist(((ukeys(xs) >> 21) & 2047).to(tl.int32), valid, weights(xs, m_new, temp), True)
                cnt += c
                mass += w
        m = m_new
    return m, s, bm, cnt, mass


@triton.jit
def _level_pass(base, V, m, temp, min_p, prefix, SHIFT: tl.constexpr, WIDTH: tl.constexpr, BLOCK: tl.constexpr,
                HBLOCK: tl.constexpr, COUNT: tl.constexpr):
    """A pass after the first: the histograms ``[32, 64]`` of the digit at ``SHIFT`` (``WIDTH`` bits) over the
    elements whose higher bits equal ``prefix``, and the mass of ``e >= min_p`` (min-p's kept total). Only a
    block holding such an element builds histograms (over its ``HBLOCK`` slices that hold one): after the first
    digit most blocks hold none."""
    offs = tl.arange(0, BLOCK)
    hoffs = tl.arange(0, HBLOCK)
    cnt = tl.zeros([_LO, _HI], dtype=tl.float32)
    mass = tl.zeros([_LO, _HI], dtype=tl.float32)
    kept = 0.0
    for start in range(0, V, BLOCK):
        valid = start + offs < V
        x = tl.load(base + start + offs, mask=valid, other=-float("inf")).to(tl.float32)
        e = weights(x, m, temp)  # [BLOCK]
        kept += tl.sum(tl.where(e >= min_p, e, 0.0), 0)
        hit = valid & ((ukeys(x) >> (SHIFT + WIDTH)) == prefix)
        if tl.max(hit.to(tl.int32), 0) > 0:
            for sub in range(start, start + BLOCK, HBLOCK):
                xs = tl.load(base + sub + hoffs, mask=sub + hoffs < V, other=-float("inf")).to(tl.float32)
                key = ukeys(xs)
                sel = (sub + hoffs < V) & ((key >> (SHIFT + WIDTH)) == prefix)
                if tl.max(sel.to(tl.int32), 0) > 0:
                    c, w = _block_hist(((key >> SHIFT) & ((1 << WIDTH) - 1)).to(tl.int32), sel,
                                       weights(xs, m, temp), COUNT)
                    cnt += c
                    mass += w
    return cnt, mass, kept


@triton.jit
def pick(h, mass, want):
    """Over histograms ``[32, 64]`` (bin ``hi * 32 + lo`` at ``[lo, hi]``): the largest bin whose suffix of
    ``h`` (that bin and those above) reaches ``want`` (-1 if none), the count (or mass, as ``h``) strictly above
    it, and the mass strictly above it and in it."""
    idx = tl.arange(0, _HI)[None, :] * _LO + tl.arange(0, _LO)[:, None]  # [32, 64]
    cols = tl.sum(h, 0)  # [64] per high digit
    cols_above = tl.cumsum(cols, 0, reverse=True) - cols  # [64] the high digits above each
    suffix = cols_above[None, :] + tl.cumsum(h, 0, reverse=True)  # [32, 64]
    d = tl.max(tl.max(tl.where(suffix >= want, idx, -1), 1), 0)
    above = tl.sum(tl.sum(tl.where(idx > d, h, 0.0), 1), 0)
    m_above = tl.sum(tl.sum(tl.where(idx > d, mass, 0.0), 1), 0)
    m_at = tl.sum(tl.sum(tl.where(idx == d, mass, 0.0), 1), 0)
    return d, above, m_above, m_at


@triton.jit
def bins_from(h, d):
    """The sum of histogram ``h`` ``[32, 64]`` over the bins ``>= d`` (bin ``hi * 32 + lo`` at ``[lo, hi]``)."""
    idx = tl.arange(0, _HI)[None, :] * _LO + tl.arange(0, _LO)[:, None]  # [32, 64]
    return tl.sum(tl.sum(tl.where(idx >= d, h, 0.0), 1), 0)


@triton.jit
def radix_thresholds(base, V, m, s_all, c0, m0, temp, k, top_p, min_p, BLOCK: tl.constexpr, HBLOCK: tl.constexpr):
    """The kept threshold on ``e`` (max of top-k's, top-p's and min-p's), the kept mass, and the passes over the
    row this took, by row-wide radix select from pass 1's first-digit histograms ``c0``, ``m0`` ``[32, 64]``."""
    k_on = k < V
    p_on = top_p < 1.0
    passes = 0.0
    kept_min = 0.0  # mass of e >= min_p, once a pass has summed it
    have_min = False

    # top-k: the k-th largest key, digit by digit; s_k the mass of keys >= it
    m1 = tl.zeros([_LO, _HI], dtype=tl.float32)
    m2 = tl.zeros([_LO, _HI], dtype=tl.float32)
    kd0 = -1
    kd1 = -1
    t_k = 0.0
    s_k = s_all
    if k_on:
        rem = k.to(tl.float32)
        kd0, above, s_k, m_at = pick(c0, m0, rem)
        rem -= above
        c1, m1, kept_min = _level_pass(base, V, m, temp, min_p, kd0.to(tl.uint32), 10, 11, BLOCK, HBLOCK, True)
        kd1, above, m_above, m_at = pick(c1, m1, rem)
        rem -= above
        s_k += m_above
        prefix = (kd0.to(tl.uint32) << 11) | kd1.to(tl.uint32)
        c2, m2, kept_min = _level_pass(base, V, m, temp, min_p, prefix, 0, 10, BLOCK, HBLOCK, True)
        kd2, above, m_above, m_at = pick(c2, m2, rem)
        s_k += m_above + m_at
        key = (prefix << 10) | kd2.to(tl.uint32)
        t_k = weights(key_value(key), m, temp)
        passes += 2.0
        have_min = True

    # top-p over the survivors: the largest key whose {key >= x} mass reaches top_p * s_k
    t_p = 0.0
    s_p = s_k
    if p_on:
        want = tl.maximum(top_p * s_k, TINY)
        pd0, m_above, m_dup, m_at = pick(m0, m0, want)
        s_p = m_above
        if pd0 >= 0:
            want = tl.maximum(want - m_above, TINY)
            h1 = m1
            if (pd0 != kd0) | (k >= V):
                c1p, h1, kept_min = _level_pass(base, V, m, temp, min_p, pd0.to(tl.uint32), 10, 11, BLOCK, HBLOCK,
                                                False)
                passes += 1.0
                have_min = True
            pd1, m_above, m_dup, m_at = pick(h1, h1, want)
            s_p += m_above
            if pd1 >= 0:
                want = tl.maximum(want - m_above, TINY)
                prefix = (pd0.to(tl.uint32) << 11) | pd1.to(tl.uint32)
                h2 = m2
                if (pd0 != kd0) | (pd1 != kd1) | (k >= V):
                    c2p, h2, kept_min = _level_pass(base, V, m, temp, min_p, prefix, 0, 10, BLOCK, HBLOCK, False)
                    passes += 1.0
                    have_min = True
                pd2, m_above, m_dup, m_at = pick(h2, h2, want)
                if pd2 >= 0:
                    s_p += m_above + m_at
                    t_p = weights(key_value((prefix << 10) | pd2.to(tl.uint32)), m, temp)
        if t_p == 0.0:  # rounding left no digit: top-p keeps every survivor
            s_p = s_k

    # the kept set e >= thr and its mass
    thr = tl.maximum(tl.maximum(t_k, t_p), min_p)
    total = tl.where(t_p >= t_k, s_p, s_k)
    if (min_p > 0.0) & (min_p > t_k) & (min_p > t_p):
        if not have_min:
            offs = tl.arange(0, BLOCK)
            for start in range(0, V, BLOCK):
                x = tl.load(base + start + offs, mask=start + offs < V, other=-float("inf")).to(tl.float32)
                e = weights(x, m, temp)
                kept_min += tl.sum(tl.where(e >= min_p, e, 0.0), 0)
            passes += 1.0
        total = kept_min
    return thr, total, passes
