"""GPU check (one device, nothing fetched): the default model with CUDA kernels, DDTree on, greedy output
equal to no speculation token for token; prints tokens/s of both, tau (accepted length per verify
step), the start-up cost (load + kernel warm-up), the first request's latency, and which backend ran
each part (sgl-kernel / flashinfer call counts, attention classes).

    python benchmarks/gpu_ddtree_check.py [--model-path DIR] [--max-tokens 64] [--out bench_out/gpu_ddtree.json]

Needs the default model already prepared (``ensure_default_model``; benchmarks/gpu_check.sh does not run
this script: it checks a Kimi-shaped checkpoint it writes itself) and the shipped drafter. Exit 2 (skipped) when either is missing or CUDA is not
available, except under DDTREE_REQUIRE_CUDA_KERNELS=1 (the GPU check), where that and a library that
did not run are failures (exit 1).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

PROMPTS = ["Explain how a hash map works.", "Write a haiku about the sea.", "List three prime numbers.",
           "What is the capital of France?"]
# (library, attribute) whose calls are counted: the parts the check expects on CUDA.
PARTS = (("sgl_kernel", "verify_tree_greedy"), ("flashinfer", "BatchPrefillWithPagedKVCacheWrapper.run"),
         ("flashinfer", "BatchDecodeWithPagedKVCacheWrapper.run"))


def _count_calls(counts: dict[str, int]) -> None:
    """Wrap each PARTS function (the real one still runs) to count its calls into ``counts``."""
    from ddtree_serve.kernels.dispatch import import_cuda_library

    for lib, attr in PARTS:
        mod = import_cuda_library(lib)
        if mod is None:
            continue
        owner, name = (getattr(mod, attr.split(".")[0]), attr.split(".")[1]) if "." in attr else (mod, attr)
        real = getattr(owner, name)
        key = f"{lib}.{attr}"
        counts[key] = 0

        def counted(*a, _real=real, _key=key, **kw):
            counts[_key] += 1
            return _real(*a, **kw)

        setattr(owner, name, functools.wraps(real)(counted))


def _run(engine, params) -> tuple[list[list[int]], float, float]:
    t0 = time.perf_counter()
    outs = engine.generate(PROMPTS, params)
    dt = time.perf_counter() - t0
    steps = sum(o.spec_verify_steps for o in outs)
    toks = sum(len(o.token_ids) for o in outs)
    return [o.token_ids for o in outs], toks / dt, (toks / steps if steps else 0.0)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-path", default=None, help="default: the prepared default model")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--budget", type=int, default=16)
    ap.add_argument("--out", default="bench_out/gpu_ddtree.json")
    args = ap.parse_args()
    import torch

    from ddtree_serve.kernels.dispatch import cuda_kernels_required

    missing = 1 if cuda_kernels_required() else 2
    if not torch.cuda.is_available():
        print("FAIL: CUDA not available" if missing == 1 else "SKIP: CUDA not available")
        return missing
    from ddtree_serve.model_executor.default_drafter import default_drafter_path
    from ddtree_serve.model_executor.default_model import default_model_dir
    from ddtree_serve.server.engine import Engine, SamplingParams

    model = args.model_path or str(default_model_dir())
    try:
        drafter = default_drafter_path()
    except FileNotFoundError as e:
        print(f"{'FAIL' if missing == 1 else 'SKIP'}: {e}")
        return missing
    if not (Path(model) / "config.json").exists():
        print(f"{'FAIL' if missing == 1 else 'SKIP'}: default model not prepared ({model}); nothing is fetched here")
        return missing
    counts: dict[str, int] = {}
    _count_calls(counts)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    common = dict(device="cuda", dtype="bfloat16", max_total_tokens=8192)
    t0 = time.perf_counter()
    base = Engine(model, **common)
    startup_s = time.perf_counter() - t0  # load + attention kernel warm-up (JIT on a cold cache)
    t0 = time.perf_counter()
    _run(base, SamplingParams(temperature=0, max_tokens=4))
    first_request_s = time.perf_counter() - t0
    ref, base_tps, _ = _run(base, params)
    attn = type(base.scheduler.runner.backend).__name__
    base.shutdown()
    spec = Engine(model, speculative_algorithm="ddtree", draft_model_path=drafter, ddtree_budget=args.budget,
                  **common)
    draft_attn = type(spec.scheduler.spec.draft_backend).__name__
    _run(spec, SamplingParams(temperature=0, max_tokens=4))
    got, spec_tps, tau = _run(spec, params)
    spec.shutdown()
    lossless = got == ref
    print(f"{'mode':<10}{'tok/s':>10}{'tau':>8}")
    print(f"{'none':<10}{base_tps:>10.1f}{'-':>8}")
    print(f"{'ddtree':<10}{spec_tps:>10.1f}{tau:>8.2f}")
    print(f"greedy lossless (ddtree == none): {lossless}")
    print(f"start-up (load + warm-up) {startup_s:.1f}s; first request (4 tokens x 4) {first_request_s:.2f}s")
    print(f"attention: target {attn}, drafter {draft_attn}")
    for key, n in counts.items():
        print(f"backend call count {key}: {n}")
    not_run = [k for k, n in counts.items() if n == 0] + [f"{lib}.{a}" for lib, a in PARTS
                                                          if f"{lib}.{a}" not in counts]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"none_tok_s": base_tps, "ddtree_tok_s": spec_tps, "tau": tau,
                                          "budget": args.budget, "lossless": lossless, "startup_s": startup_s,
                                          "first_request_s": first_request_s, "attention": attn,
                                          "draft_attention": draft_attn, "calls": counts}, indent=2))
    if cuda_kernels_required() and (not_run or attn != "FlashInferAttentionBackend"):
        print(f"FAIL: expected CUDA kernels did not run: {not_run or attn}")
        return 1
    return 0 if lossless else 1


if __name__ == "__main__":
    sys.exit(main())
