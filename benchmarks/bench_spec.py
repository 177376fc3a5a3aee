"""Speculative decoding on the default model: tau and decode tokens/s for none / dflash (chain) / ddtree at
several budgets, batch 1 and 8, greedy and T=1, all in one run, plus a per-step time breakdown (draft,
tree build, verify forward, verify, commit, scheduler). Table + JSON. The non-forward share of a step
(build + verify + commit + scheduler) is the engine's own overhead.

    python benchmarks/bench_spec.py [--budgets 4,8,16,32,64] [--batch-sizes 1,8] [--max-tokens 64]
        [--draft-model-path default] [--dtype float32] [--out bench_out/spec.json]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import CHAT_PROMPTS, chat_ids, machine, print_table, write_json  # noqa: E402
from server.engine import Engine, SamplingParams  # noqa: E402


def run(engine: Engine, ids: list[list[int]], params: SamplingParams) -> dict:
    sch = engine.scheduler
    spec = sch.spec
    if spec is not None:
        spec.timer.totals.clear()
        spec.timer.steps = 0
    t = time.perf_counter()
    outs = engine.generate(input_ids=ids, sampling_params=params)
    wall = time.perf_counter() - t
    gen = sum(len(o.token_ids) for o in outs)
    row = {"tok_s": gen / wall, "generated": gen}
    if spec is not None:
        steps = sum(o.spec_verify_steps for o in outs)
        row["tau"] = sum(len(o.token_ids) - 1 for o in outs) / max(steps, 1)  # first token comes from prefill
        phases = dict(spec.timer.totals)
        spec_time = sum(phases.values())
        row.update({f"{k}_ms": 1000 * v / max(spec.timer.steps, 1) for k, v in phases.items()})
        fwd = phases.get("draft", 0) + phases.get("verify_forward", 0)
        sched = max(wall - spec_time, 0.0)
        overhead = phases.get("build", 0) + phases.get("verify", 0) + phases.get("commit", 0) + sched
        row["sched_ms"] = 1000 * sched / max(spec.timer.steps, 1)
        row["overhead_share"] = overhead / max(fwd + overhead, 1e-9)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budgets", default="4,8,16,32,64")
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--draft-model-path", default="default")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", default="bench_out/spec.json")
    args = ap.parse_args()
    configs = [("none", 0), ("dflash", 0)] + [("ddtree", int(b)) for b in args.budgets.split(",")]
    rows = []
    base = None
    for alg, budget in configs:
        kw = {} if alg == "none" else {"speculative_algorithm": alg, "draft_model_path": args.draft_model_path,
                                       "ddtree_budget": max(budget, 1)}
        engine = Engine("default", dtype=args.dtype, max_total_tokens=16384, **kw)
        ids_all = chat_ids(engine.tokenizer, CHAT_PROMPTS)
        run(engine, ids_all[:1], SamplingParams(temperature=0, max_tokens=4))  # warm-up
        for bs in (int(b) for b in args.batch_sizes.split(",")):
            ids = (ids_all * ((bs + len(ids_all) - 1) // len(ids_all)))[:bs]
            for temp in (float(t) for t in args.temperatures.split(",")):
                print(f"[bench] {alg} budget={budget} batch={bs} T={temp} ...", flush=True)
                params = SamplingParams(temperature=temp, max_tokens=args.max_tokens, seed=0, ignore_eos=True)
                row = {"algorithm": alg, "budget": budget or None, "batch": bs, "temperature": temp}
                row.update(run(engine, ids, params))
                if alg == "none":
                    base = base or {}
                    base[(bs, temp)] = row["tok_s"]
                row["speedup"] = row["tok_s"] / base[(bs, temp)] if base and (bs, temp) in base else None
                rows.append(row)
        engine.shutdown()
    cols = ["algorithm", "budget", "batch", "temperature", "tau", "tok_s", "speedup", "draft_ms", "build_ms",
            "verify_forward_ms", "verify_ms", "commit_ms", "sched_ms", "overhead_share"]
    print_table(rows, cols)
    write_json(args.out, {"machine": machine(), "args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
