"""Speculative decoding on the default model: tau and decode tokens/s for none, DDTree at fixed budgets and
the adaptive budget ("auto", issue 15), optionally dflash (chain), at several batch sizes, greedy and T=1,
all in one run, plus a per-step time breakdown (draft, tree build, verify forward, verify, commit,
scheduler). For auto it prints the budgets it chose (mean and the most frequent) and a summary: auto
against none and against the best of none and every fixed budget, per batch size and temperature (the
issue's bar: >= 0.95x the best, never below none). Table + JSON.

    python benchmarks/bench_spec.py [--budgets 4,16,64] [--auto] [--dflash] [--batch-sizes 1,4,16,32]
        [--max-tokens 64] [--draft-model-path default] [--dtype float32] [--out bench_out/spec.json]
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
    ctl = spec.controller if spec is not None else None
    if spec is not None:
        spec.timer.totals.clear()
        spec.timer.steps = 0
    if ctl is not None:
        ctl.chosen.clear()
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
        row["mean_budget"] = sum(o.spec_budget_sum for o in outs) / max(steps, 1)
    if ctl is not None:
        top = ctl.chosen.most_common(4)
        row["budgets_chosen"] = " ".join(f"{b}:{n}" for b, n in top)  # budget:request-steps, most frequent
        row["budget_counts"] = dict(ctl.chosen)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budgets", default="4,16,64", help="fixed DDTree budgets ('' for none)")
    ap.add_argument("--no-auto", dest="auto", action="store_false", help="skip the adaptive budget")
    ap.add_argument("--max-budget", type=int, default=64, help="upper bound of the auto budget")
    ap.add_argument("--dflash", action="store_true", help="also run dflash (chain)")
    ap.add_argument("--batch-sizes", default="1,4,16,32")
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--draft-model-path", default="default")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", default="bench_out/spec.json")
    args = ap.parse_args()
    configs = [("none", 0)] + ([("dflash", 0)] if args.dflash else [])
    configs += [("ddtree", int(b)) for b in args.budgets.split(",") if b] + ([("ddtree", "auto")] if args.auto else [])
    rows = []
    base = None
    for alg, budget in configs:
        kw = {} if alg == "none" else {"speculative_algorithm": alg, "draft_model_path": args.draft_model_path,
                                       "ddtree_budget": budget or 1, "ddtree_max_budget": args.max_budget}
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
    cols = ["algorithm", "budget", "batch", "temperature", "tau", "tok_s", "speedup", "mean_budget", "draft_ms",
            "build_ms", "verify_forward_ms", "verify_ms", "commit_ms", "sched_ms", "overhead_share", "budgets_chosen"]
    print_table(rows, cols)
    summary = auto_summary(rows)
    if summary:
        print("\nauto vs none and vs the best of {none, fixed budgets}:")
        print_table(summary, ["batch", "temperature", "auto_tok_s", "best", "best_tok_s", "vs_best", "vs_none", "ok"])
    write_json(args.out, {"machine": machine(), "args": vars(args), "rows": rows, "auto_summary": summary})


def auto_summary(rows: list[dict]) -> list[dict]:
    """Per (batch, temperature): auto's tokens/s against none and the best non-auto configuration."""
    out = []
    for auto in (r for r in rows if r["budget"] == "auto"):
        key = (auto["batch"], auto["temperature"])
        others = [r for r in rows if (r["batch"], r["temperature"]) == key and r["budget"] != "auto"]
        if not others:
            continue
        best = max(others, key=lambda r: r["tok_s"])
        none = next((r for r in others if r["algorithm"] == "none"), best)
        vs_best, vs_none = auto["tok_s"] / best["tok_s"], auto["tok_s"] / none["tok_s"]
        out.append({"batch": key[0], "temperature": key[1], "auto_tok_s": auto["tok_s"],
                    "best": f"{best['algorithm']}@{best['budget']}" if best["budget"] else best["algorithm"],
                    "best_tok_s": best["tok_s"], "vs_best": vs_best, "vs_none": vs_none,
                    "ok": vs_best >= 0.95 and vs_none >= 1.0})
    return out


if __name__ == "__main__":
    main()
