"""GPU check (one device, nothing fetched): the default model with CUDA kernels, DDTree on, greedy output
equal to no speculation token for token; prints tokens/s of both and tau (accepted length per verify step).

    python benchmarks/gpu_ddtree_check.py [--model-path DIR] [--max-tokens 64] [--out bench_out/gpu_ddtree.json]

Needs the default model already in the cache (ensure_default_model converts it once from a local wheel)
and the shipped drafter; exits 2 (skipped) when either is missing or CUDA is not available.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

PROMPTS = ["Explain how a hash map works.", "Write a haiku about the sea.", "List three prime numbers.",
           "What is the capital of France?"]


def _run(engine, params) -> tuple[list[list[int]], float, float]:
    t0 = time.perf_counter()
    outs = engine.generate(PROMPTS, params)
    dt = time.perf_counter() - t0
    steps = sum(o.spec_verify_steps for o in outs)
    toks = sum(len(o.token_ids) for o in outs)
    return [o.token_ids for o in outs], toks / dt, (toks / steps if steps else 0.0)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-path", default=None, help="default: the cached default model")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--budget", type=int, default=16)
    ap.add_argument("--out", default="bench_out/gpu_ddtree.json")
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("SKIP: CUDA not available")
        return 2
    from model_executor.default_drafter import default_drafter_path
    from model_executor.default_model import default_model_dir
    from server.engine import Engine, SamplingParams

    model = args.model_path or str(default_model_dir())
    try:
        drafter = default_drafter_path()
    except FileNotFoundError as e:
        print(f"SKIP: {e}")
        return 2
    if not (Path(model) / "config.json").exists():
        print(f"SKIP: default model not in the cache ({model}); nothing is fetched here")
        return 2
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    common = dict(device="cuda", dtype="bfloat16", max_total_tokens=8192)
    base = Engine(model, **common)
    _run(base, SamplingParams(temperature=0, max_tokens=4))  # warm-up (flashinfer JIT, allocator)
    ref, base_tps, _ = _run(base, params)
    base.shutdown()
    spec = Engine(model, speculative_algorithm="ddtree", draft_model_path=drafter, ddtree_budget=args.budget,
                  **common)
    _run(spec, SamplingParams(temperature=0, max_tokens=4))
    got, spec_tps, tau = _run(spec, params)
    spec.shutdown()
    lossless = got == ref
    print(f"{'mode':<10}{'tok/s':>10}{'tau':>8}")
    print(f"{'none':<10}{base_tps:>10.1f}{'-':>8}")
    print(f"{'ddtree':<10}{spec_tps:>10.1f}{tau:>8.2f}")
    print(f"greedy lossless (ddtree == none): {lossless}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"none_tok_s": base_tps, "ddtree_tok_s": spec_tps, "tau": tau,
                                          "budget": args.budget, "lossless": lossless}, indent=2))
    return 0 if lossless else 1


if __name__ == "__main__":
    sys.exit(main())
