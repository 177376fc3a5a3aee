"""One Triton program per row (8 warps, blocks of 1,024 logits; a grid of at most 512 programs, each taking
rows in turn): temperature softmax, top-k, top-p and min-p, and the inverse-CDF draw at a given uniform, with the
top-k and top-p thresholds found by radix select and candidate sets (the GPU path of
``model_executor.sampler.draw_tokens``). No probability row is ever written.

Passes over the row (``passes_out``: logits read from memory, in rows; a draw that stops early counts its blocks):
1. the max ``m``, the row's mass ``S`` and each block's mass (online, rescaled as flash attention's softmax), with
   the first radix digit's count and mass histograms when top-k or top-p is on
   (``triton_sampling_radix.first_pass``);
2. with any filter on: the candidates (``triton_sampling_candidates``: every logit the filters could keep, from
   the first digit's bins or ``e >= min_p``) written to a buffer of ``CAP`` entries; the thresholds and the draw
   then read the buffer, not the row;
3. the draw: the first index whose running kept mass exceeds ``u`` times the kept total (if rounding leaves none,
   the last kept index, ``kernels.sampling.inverse_cdf_sample``). Unfiltered rows start it at the block whose
   running block mass crosses (one block of 160 read); filtered rows draw from the buffer.
So 2 passes with any filter on and the candidates fitting (the bisection kernel ``triton_sampling_bisect``: 64
with top-k and top-p, 33-34 with one, 3 with min-p or none), 1 and a block with none. Rows whose candidates do
not fit (a flat row under a large top-k or top-p) take the row-wide radix search of ``triton_sampling_radix``
(2-4 more passes) and a row-wide draw.

Each threshold is exact for its definition (``triton_sampling_radix``: keys, ties); the masses are summed in
another order than the torch reference's (blocks, buffer chunks, not a sorted cumsum), so a uniform or a top-p
mass within float32 rounding of a boundary may pick the neighbouring token. Plain decoding and tree verification
both call this kernel on CUDA, so the two stay equal. Tested on CPU under ``TRITON_INTERPRET=1`` against the torch
reference and the bisection kernel (tests/kernels/test_triton_sampling.py). Radix select for top-k / top-p as in
flashinfer's and vLLM's radix top-k sampling kernels (an idea, not their code: theirs histogram with
shared-memory atomics).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ddtree_serve.kernels.triton_sampling_candidates import cand_draw, cand_thresholds, collect, row_draw
from ddtree_serve.kernels.triton_sampling_radix import (
    HIST_BLOCK,
    TINY,
    bins_from,
    first_pass,
    pick,
    radix_thresholds,
)

CAP = 4096  # buffer entries per program (32 KB): top-p 0.9 of randn x 3 logits at V 163,840 needs 1,550-3,700
_PROGRAMS = 512  # programs at most, each taking rows pid, pid + grid, ... with its own buffer (16 MB in all);
# an H100 holds one of these 8-warp programs (224 registers a thread) per SM, 132 at once


@triton.jit
def _sample_rows(logits_ptr, stride, params_ptr, out_ptr, passes_ptr, cand_ptr, n_rows, V, BLOCK: tl.constexpr,
                 HBLOCK: tl.constexpr, NB: tl.constexpr, CAP: tl.constexpr):
    """``params_ptr`` [n, 5] float32 per row: temperature, top_k (float: exact below 2^24), top_p, min_p, the
    uniform; ``cand_ptr`` [grid, 2 * CAP] float32: each program's buffer, logits then indices (float: exact)."""
    for row in tl.range(tl.program_id(0), n_rows, tl.num_programs(0), num_stages=1):
        base = logits_ptr + (tl.full([], 0, tl.int64) + row) * stride  # int64 offsets (interpreted: row an int)
        temp = tl.load(params_ptr + row * 5)
        k = tl.load(params_ptr + row * 5 + 1)
        top_p = tl.load(params_ptr + row * 5 + 2)
        min_p = tl.load(params_ptr + row * 5 + 3)
        u = tl.load(params_ptr + row * 5 + 4)
        filt = (k < V) | (top_p < 1.0)

        m, s_all, bm, c0, m0 = first_pass(base, V, temp, filt, BLOCK, HBLOCK, NB)  # bm [NB] block masses
        passes = 1.0
        # the candidates' lowest first digit: top-k's (exact counts), else top-p's for 1.001 x its target
        lo_digit = tl.full([], -1, tl.int32)
        if k < V:
            lo_digit, c_above, m_above, m_at = pick(c0, m0, k)
        elif top_p < 1.0:
            lo_digit, c_above, m_above, m_at = pick(m0, m0, tl.maximum(top_p * s_all * 1.001, TINY))
        fits = (lo_digit >= 0) & (bins_from(c0, lo_digit) <= CAP)
        try_cand = tl.where(filt, fits, min_p > 0.0)
        lo_key = tl.maximum(lo_digit, 0).to(tl.uint32) << 21
        done = False
        token = -1
        n = 0
        kept_min = 0.0
        if try_cand:
            cand_x = cand_ptr + tl.program_id(0).to(tl.int64) * (2 * CAP)  # this program's buffer [CAP]: logits
            cand_i = cand_x + CAP  # [CAP] their indices
            tl.debug_barrier()  # the previous row's reads of the buffer are done
            n, kept_min = collect(base, V, m, temp, min_p, lo_key, tl.where(filt, -1.0, min_p), cand_x, cand_i, CAP,
                                  BLOCK)
            tl.debug_barrier()  # the buffer is visible to every warp
            passes += 1.0
            if n <= CAP:
                thr, ok = cand_thresholds(cand_x, n, m, s_all, temp, k, top_p, min_p, V, lo_key, BLOCK)
                if ok:
                    token = cand_draw(cand_x, cand_i, n, m, temp, thr, u, V, BLOCK)
                    done = True
        if not done:
            thr = 0.0
            total = s_all
            start = 0
            run = 0.0
            if filt:
                thr, total, more = radix_thresholds(base, V, m, s_all, c0, m0, temp, k, top_p, min_p, BLOCK, HBLOCK)
                passes += more
            elif min_p > 0.0:  # min-p alone with too many candidates: pass 2 summed its kept mass
                thr = min_p
                total = kept_min
            else:  # no filter: start at the block whose running block mass crosses u * S
                bidx = tl.arange(0, NB)
                cum = tl.cumsum(bm, 0)  # [NB]
                b = tl.min(tl.where((cum > u * s_all) & (bm > 0), bidx, NB), 0)
                b = tl.where(b < NB, b, tl.max(tl.where(bm > 0, bidx, 0), 0))
                start = b * BLOCK
                run = tl.sum(tl.where(bidx < b, bm, 0.0), 0)
            token, blocks = row_draw(base, V, m, temp, thr, u * total, start, run, BLOCK)
            passes += blocks / tl.cdiv(V, BLOCK)
        tl.store(out_ptr + row, token.to(tl.int64))
        tl.store(passes_ptr + row, passes)


def triton_draw_sampled(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                        min_p: torch.Tensor, uniforms: torch.Tensor, block: int = 1024,
                        passes_out: torch.Tensor | None = None, cap: int = CAP) -> torch.Tensor:
    """Tokens ``[n]`` int64 for sampled rows: logits ``[n, V]`` (any float dtype, contiguous rows), per row
    temperature (> 0), top_k (>= V: off), top_p (>= 1: off), min_p (<= 0: off) and uniforms in [0, 1).
    ``passes_out`` (float32 ``[n]``, optional) receives each row's reads of its logits from memory, in rows (a
    draw that stops early counts the blocks it read; the candidate buffer's re-reads are not row reads).
    ``cap``: candidate buffer entries per program (tests shrink it to take the row-wide path)."""
    n, vocab = logits.shape
    if vocab >= 1 << 24:
        raise ValueError(f"vocabulary {vocab} >= 2^24: top_k and the buffered indices travel as exact float32")
    out = torch.empty(n, dtype=torch.int64, device=logits.device)
    if n == 0:
        return out
    logits = logits.contiguous()
    dev = logits.device
    passes = passes_out if passes_out is not None else torch.empty(n, dtype=torch.float32, device=dev)
    bk = max(16, min(block, triton.next_power_of_2(vocab)))  # logits per block (a power of 2)
    grid = min(n, _PROGRAMS)
    params = torch.stack([temperature.to(dev, torch.float32), top_k.to(dev).clamp(max=vocab).to(torch.float32),
                          top_p.to(dev, torch.float32), min_p.to(dev, torch.float32),
                          uniforms.to(dev, torch.float32)], 1)  # [n, 5]
    cand = torch.empty(grid, 2 * cap, dtype=torch.float32, device=dev)  # [grid, 2 * cap] per-program buffers
    _sample_rows[(grid,)](
        logits, logits.stride(0), params, out, passes, cand, n, vocab, BLOCK=bk, HBLOCK=min(bk, HIST_BLOCK),
        NB=triton.next_power_of_2(triton.cdiv(vocab, bk)), CAP=cap, num_warps=8,
    )
    return out
