"""The previous sampling kernel, kept as the baseline of ``kernels/triton_sampling.py`` (the radix-select kernel that
``model_executor.sampler.draw_tokens`` runs on CUDA): benchmarks/bench_kernels.py compares their passes per row
and tests/kernels/test_triton_sampling.py their tokens. One Triton program per row: temperature softmax, top-k,
top-p and min-p, and the inverse-CDF draw at a given uniform, without ever writing a probability row.

Per row, over the logits in blocks of ``BLOCK``:
1. ``m = max(l)`` and the unnormalised weights ``e_i = exp((l_i - m) / T)`` in (0, 1] (max 1).
2. top-k: the k-th largest ``e`` exactly, by bisection over float32 bit patterns (non-negative floats order
   as their int32 bits): the largest ``x`` with ``#{e >= x} >= k`` is the k-th value (ties kept, as
   ``kernels.sampling.top_k_renorm_prob``).
3. top-p over the top-k survivors: the largest ``x`` with ``sum{e : e >= max(x, t_k)} >= top_p * S_k`` (S_k the
   survivors' mass): the value ending the shortest descending prefix reaching ``top_p``, ties extended (as
   ``top_p_renorm_prob``).
4. min-p: ``e >= min_p * max(e) = min_p`` (scale free, as ``min_p_renorm_prob`` after renormalisation).
5. Kept: ``e >= max(t_k, t_p, t_m)``; the token is the first index whose running kept mass exceeds
   ``u * S_kept`` (``kernels.sampling.inverse_cdf_sample``; if rounding leaves none, the last kept index).

Each filter's threshold is exact for its definition; the sums run in another order than the torch reference's
(block partial sums, not a sorted cumsum), so a draw whose uniform or a top-p mass falls within float32 rounding
of a boundary may pick the neighbouring token. Plain decoding and tree verification both call this kernel on
CUDA, so the two stay equal. Tested on CPU under ``TRITON_INTERPRET=1`` against the torch reference
(tests/kernels/test_triton_sampling.py). 1 (max) + 30 (top-k) + 1 + 30 (top-p) + 2 passes over the row at most (a
bisection over [0, 0x3F800001] takes 30 halvings; ``bisect_passes``); a filter that is off skips its passes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_ONE_BITS = 0x3F800000  # float32 1.0


@triton.jit
def _sample_rows(logits_ptr, stride, temp_ptr, topk_ptr, topp_ptr, minp_ptr, u_ptr, out_ptr, V,
                 BLOCK: tl.constexpr, ONE_BITS: tl.constexpr):
    row = tl.program_id(0)
    base = logits_ptr + row.to(tl.int64) * stride
    temp = tl.load(temp_ptr + row)
    k = tl.load(topk_ptr + row)
    top_p = tl.load(topp_ptr + row)
    min_p = tl.load(minp_ptr + row)
    u = tl.load(u_ptr + row)
    offs = tl.arange(0, BLOCK)

    m = -float("inf")
    for start in range(0, V, BLOCK):
        x = tl.load(base + start + offs, mask=start + offs < V, other=-float("inf")).to(tl.float32)
        m = tl.maximum(m, tl.max(x, 0))

    t_k = 0.0
    if k < V:  # bisection on bit patterns: lo holds, hi fails (#{e >= x} >= k)
        lo = 0
        hi = ONE_BITS + 1
        while hi - lo > 1:
            mid = (lo + hi) // 2
            xm = mid.to(tl.float32, bitcast=True)
            cnt = 0
            for start in range(0, V, BLOCK):
                x = tl.load(base + start + offs, mask=start + offs < V, other=-float("inf")).to(tl.float32)
                e = tl.exp((x - m) / temp)
                cnt += tl.sum(((e >= xm) & (start + offs < V)).to(tl.int32), 0)
            if cnt >= k:
                lo = mid
            else:
                hi = mid
        t_k = lo.to(tl.float32, bitcast=True)

    t_p = 0.0
    if top_p < 1.0:
        s_k = 0.0
        for start in range(0, V, BLOCK):
            x = tl.load(base + start + offs, mask=start + offs < V, other=-float("inf")).to(tl.float32)
            e = tl.exp((x - m) / temp)
            s_k += tl.sum(tl.where(e >= t_k, e, 0.0), 0)
        need = top_p * s_k
        lo = 0
        hi = ONE_BITS + 1
        while hi - lo > 1:
            mid = (lo + hi) // 2
            xm = tl.maximum(mid.to(tl.float32, bitcast=True), t_k)
            mass = 0.0
            for start in range(0, V, BLOCK):
                x = tl.load(base + start + offs, mask=start + offs < V, other=-float("inf")).to(tl.float32)
                e = tl.exp((x - m) / temp)
                mass += tl.sum(tl.where(e >= xm, e, 0.0), 0)
            if mass >= need:
                lo = mid
            else:
                hi = mid
        t_p = lo.to(tl.float32, bitcast=True)

    thr = tl.maximum(tl.maximum(t_k, t_p), min_p)
    total = 0.0
    for start in range(0, V, BLOCK):
        x = tl.load(base + start + offs, mask=start + offs < V, other=-float("inf")).to(tl.float32)
        e = tl.exp((x - m) / temp)
        total += tl.sum(tl.where((e >= thr) & (e > 0), e, 0.0), 0)
    target = u * total
    run = 0.0
    token = -1
    last = 0
    for start in range(0, V, BLOCK):
        x = tl.load(base + start + offs, mask=start + offs < V, other=-float("inf")).to(tl.float32)
        e = tl.exp((x - m) / temp)
        w = tl.where((e >= thr) & (e > 0), e, 0.0)
        cum = run + tl.cumsum(w, 0)
        hit = (cum > target) & (w > 0)
        first = tl.min(tl.where(hit, start + offs, V), 0)
        if (token < 0) & (first < V):
            token = first
        last = tl.maximum(last, tl.max(tl.where(w > 0, start + offs, 0), 0))
        run += tl.sum(w, 0)
    if token < 0:
        token = last
    tl.store(out_ptr + row, token.to(tl.int64))


def bisect_passes(top_k_on: bool, top_p_on: bool) -> int:
    """Full reads of a row by ``_sample_rows``, from its loop structure: the max, 30 bisection steps for top-k, the
    survivors' mass and 30 steps for top-p, the kept total and the draw."""
    return 1 + 30 * top_k_on + 31 * top_p_on + 2


def triton_draw_sampled_bisect(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                        min_p: torch.Tensor, uniforms: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """Tokens ``[n]`` int64 for sampled rows: logits ``[n, V]`` (any float dtype, contiguous rows), per row
    temperature (> 0), top_k (>= V: off), top_p (>= 1: off), min_p (<= 0: off) and uniforms in [0, 1)."""
    n, vocab = logits.shape
    out = torch.empty(n, dtype=torch.int64, device=logits.device)
    if n == 0:
        return out
    logits = logits.contiguous()
    dev = logits.device
    _sample_rows[(n,)](
        logits, logits.stride(0), temperature.to(dev, torch.float32).contiguous(),
        top_k.to(dev, torch.int64).clamp(max=vocab).contiguous(), top_p.to(dev, torch.float32).contiguous(),
        min_p.to(dev, torch.float32).contiguous(), uniforms.to(dev, torch.float32).contiguous(), out, vocab,
        BLOCK=min(block, triton.next_power_of_2(vocab)), ONE_BITS=_ONE_BITS,
    )
    return out
