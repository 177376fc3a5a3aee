"""The sampling kernel's passes over a row and its rows per second: the radix-select kernel
(ddtree_serve/kernels/triton_sampling.py) against the bisection kernel it replaced
(ddtree_serve/kernels/triton_sampling_bisect.py), at Kimi K2.6's vocabulary (163,840), per filter combination.

Passes: the radix kernel counts its own reads of the row from memory, in rows (``passes_out``: a draw that
stops early counts the blocks it read; the candidate buffer's re-reads are not row reads; on CPU it runs in
Triton's interpreter, blocks of 1,024); the bisection kernel's are read off its loop structure
(``bisect_passes``: 1 + 30 per top-k + 31 per top-p + 2, every pass a full one). Rows per second only on CUDA (the
interpreter's time says nothing). Called by ``benchmarks/bench_kernels.py --sampler``; no timing asserts.

    python benchmarks/bench_kernels.py --sampler [--device cuda] [--sampler-rows 8]
"""

from __future__ import annotations

import os
import time

import torch

VOCAB = 163_840
# (name, temperature, top_k (0 off), top_p, min_p)
CONFIGS = (
    ("temperature only", 0.8, 0, 1.0, 0.0),
    ("min-p 0.05", 0.8, 0, 1.0, 0.05),
    ("top-k 40", 0.8, 40, 1.0, 0.0),
    ("top-p 0.9", 0.8, 0, 0.9, 0.0),
    ("top-k 40 + top-p 0.9", 0.8, 40, 0.9, 0.0),
    ("top-k 1000 + top-p 0.5", 1.0, 1000, 0.5, 0.0),
    ("top-k 40 + top-p 0.9 + min-p 0.05", 0.8, 40, 0.9, 0.05),
)


def _rows_per_s(fn, device: torch.device, n: int, reps: int = 20) -> float:
    fn()
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize(device)
    return n * reps / (time.perf_counter() - t0)


def bench_sampler(device: torch.device, rows: int = 4, vocab: int = VOCAB) -> list[dict]:
    """One row of results per ``CONFIGS`` entry: passes per row (max over ``rows`` rows of randn * 3 logits) of
    both kernels, their ratio, and on CUDA rows/s of both at ``rows`` rows."""
    if device.type != "cuda":
        os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are defined: before their import
    from ddtree_serve.kernels.triton_sampling import triton_draw_sampled
    from ddtree_serve.kernels.triton_sampling_bisect import bisect_passes, triton_draw_sampled_bisect

    gen = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(rows, vocab, generator=gen, device=device) * 3  # [n, V]
    u = torch.rand(rows, generator=gen, device=device)
    block = 1024  # the kernel's default
    out = []
    for name, temp, k, p, mp in CONFIGS:
        args = (torch.full((rows,), temp, device=device), torch.full((rows,), k if k > 0 else vocab, device=device),
                torch.full((rows,), p, device=device), torch.full((rows,), mp, device=device))
        passes = torch.zeros(rows, dtype=torch.float32, device=device)
        triton_draw_sampled(logits, *args, u, block=block, passes_out=passes)
        radix = float(passes.max())
        bisect = bisect_passes(k > 0, p < 1.0)
        row = dict(config=name, radix_passes=radix, bisect_passes=bisect, ratio=bisect / radix)
        if device.type == "cuda":
            row["radix_rows_per_s"] = _rows_per_s(lambda a=args: triton_draw_sampled(logits, *a, u), device, rows)
            row["bisect_rows_per_s"] = _rows_per_s(lambda a=args: triton_draw_sampled_bisect(logits, *a, u),
                                                   device, rows)
        out.append(row)
        speed = (f", {row['radix_rows_per_s']:,.0f} vs {row['bisect_rows_per_s']:,.0f} rows/s"
                 if "radix_rows_per_s" in row else "")
        print(f"V={vocab} {name:34}: radix {radix:.3f} passes/row (counted), bisection {bisect} (loop structure), "
              f"{row['ratio']:.1f}x fewer{speed}", flush=True)
    return out
