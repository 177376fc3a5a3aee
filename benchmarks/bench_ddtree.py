"""DDTree builder cost (arXiv 2604.12989, Algorithm 1) per speculative step.

Grid: batch {1, 8, 32, 128} x budget {4, 16, 64, 256}, vocab 49152 (SmolLM2), L = 15 (block size 16).
Columns: ``topk_ms`` (batched top-K + logsumexp over the vocabulary and the copy to host), ``heap_ms``
(Algorithm 1's per-request heap, ``reference_pops``), ``pops_ms`` (the batched pops the engine runs,
``batched_pops``: the same nodes), ``total_ms`` (``build_ddtree`` end to end, index tensors and mask
included), ``heap_us_per_node`` / ``pops_us_per_node``. Median over repeats. Prints a table, writes bench_out/ddtree.json.

    python -m benchmarks.bench_ddtree [--repeats 5] [--device cpu] [--out bench_out/ddtree.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from ddtree_serve.speculative.ddtree import build_ddtree, draft_topk
from ddtree_serve.speculative.ddtree_pop import batched_pops, reference_pops

BATCHES = (1, 8, 32, 128)
BUDGETS = (4, 16, 64, 256)
VOCAB = 49152
DEPTH = 15


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_ms(fn, repeats: int, device: torch.device) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _cell(logits: torch.Tensor, budget: int, repeats: int, device: torch.device) -> dict:
    """Time one (batch, budget) cell."""
    bs = logits.shape[0]
    roots = torch.zeros(bs, dtype=torch.int64, device=device)
    seq_lens = torch.full((bs,), 100, dtype=torch.int64, device=device)
    budgets = torch.full((bs,), budget, dtype=torch.int64)
    k = min(budget, VOCAB)
    lp, ids = draft_topk(logits, k)
    lp_lists = [(lp[b].tolist(), ids[b].tolist()) for b in range(bs)]
    topk_ms = _median_ms(lambda: draft_topk(logits, k), repeats, device)
    heap_ms = _median_ms(lambda: [reference_pops(a, t, budget, k) for a, t in lp_lists], repeats, device)
    full, depth = np.full(bs, budget), np.full(bs, DEPTH)
    pops_ms = _median_ms(lambda: batched_pops(lp, ids, full, depth), repeats, device)
    total_ms = _median_ms(lambda: build_ddtree(logits, budgets, roots, seq_lens), repeats, device)
    chain_ms = _median_ms(lambda: build_ddtree(logits, budgets, roots, seq_lens, chain=True), repeats, device)
    return dict(
        batch=bs, budget=budget, vocab=VOCAB, depth=DEPTH, topk_ms=round(topk_ms, 3),
        heap_ms=round(heap_ms, 3), pops_ms=round(pops_ms, 3), total_ms=round(total_ms, 3), chain_total_ms=round(chain_ms, 3),
        heap_us_per_node=round(heap_ms * 1e3 / (bs * budget), 3),
        pops_us_per_node=round(pops_ms * 1e3 / (bs * budget), 3),
    )


def run(repeats: int, device: torch.device) -> list[dict]:
    rows = []
    gen = torch.Generator().manual_seed(0)
    for bs in BATCHES:
        # Peaked logits (like a trained drafter) make the heap walk deep rather than wide.
        logits = (torch.randn(bs, DEPTH, VOCAB, generator=gen) * 3.0).to(device)  # [bs, L, V]
        for budget in BUDGETS:
            r = _cell(logits, budget, repeats, device)
            rows.append(r)
            print(
                f"{bs:>5} {budget:>6} {r['topk_ms']:>9.2f} {r['heap_ms']:>9.2f} {r['pops_ms']:>9.2f} {r['total_ms']:>9.2f}"
                f" {r['chain_total_ms']:>9.2f} {r['heap_us_per_node']:>9.2f} {r['pops_us_per_node']:>9.2f}",
                flush=True,
            )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default="bench_out/ddtree.json")
    args = ap.parse_args()
    device = torch.device(args.device)
    print(f"DDTree builder, vocab {VOCAB}, L {DEPTH}, device {device}, torch threads {torch.get_num_threads()}")
    print(f"{'batch':>5} {'budget':>6} {'topk_ms':>9} {'heap_ms':>9} {'pops_ms':>9} {'total_ms':>9} {'chain_ms':>9} {'heap/node':>9} {'pops/node':>9}")
    rows = run(args.repeats, device)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = dict(device=str(device), torch=torch.__version__, threads=torch.get_num_threads(),
                machine=platform.processor() or platform.machine(), repeats=args.repeats)
    out.write_text(json.dumps(dict(meta=meta, rows=rows), indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
