"""Seeded sampled decoding with and without speculation: tokens/s, acceptance, and whether the tokens are the
same (docs/DESIGN.md 4.16: position-keyed sampling makes a seeded request's tokens independent of speculation).

Configurations on the default model, each its own engine in one run: ``plain`` (no speculation), ``ddtree16``
(shipped drafter + suffix drafts, fixed budget 16) and ``auto`` (the default serve configuration: auto budget,
dflash + suffix, prefix cache on). Every call serves ``common.CHAT_PROMPTS`` (cycled to a multiple of the batch)
at temperature ``--temperature`` with seed 1000 + i, in ``--rounds`` interleaved rounds (each configuration per
call in turn, the order rotated). Reported per (dtype, batch, config): tokens/s (generated tokens / wall
seconds of whole calls), ``vs_plain`` (median paired ratio over rounds), ``tau`` (tokens per verify step) and
``same``: the share of requests whose tokens equal plain's exactly, with ``first_diff``: the mean output
position of the first differing token over the requests that differ (float32 must give same 1.000; in
bfloat16 a draw within rounding of a CDF boundary may move).

``--deterministic off,on`` runs every cell with and without ``enable_deterministic_inference`` (batch-invariant
kernels, docs/DESIGN.md 4.18): ``det`` in the table; the mode's cost is tok_s on vs off in the same cell.

    python benchmarks/bench_seeded.py [--dtypes float32,bfloat16] [--batch-sizes 1,8] [--rounds 3]
        [--max-tokens 64] [--temperature 0.8] [--configs plain,ddtree16,auto] [--deterministic off,on]
        [--out bench_out/seeded.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import CHAT_PROMPTS, chat_ids, machine, print_table, write_json  # noqa: E402

CONFIGS = {"plain": {}, "ddtree16": {"speculative_algorithm": "ddtree", "draft_model_path": "default",
                                     "ddtree_budget": 16},
           "auto": {"speculative_algorithm": "ddtree", "draft_model_path": "default", "ddtree_budget": "auto"}}


def _first_diff(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def run_cell(engines: dict, ids: list[list[int]], batch: int, rounds: int, params) -> list[dict]:
    prompts = [ids[i % len(ids)] for i in range(max(batch, len(ids) // batch * batch))]
    calls = [list(range(s, s + batch)) for s in range(0, len(prompts), batch)]
    stats = {n: {"tok": 0, "sec": 0.0, "acc": 0, "steps": 0, "same": [], "diff": [], "ratios": []} for n in engines}
    names = list(engines)
    for r in range(rounds):
        per_round = {n: [0, 0.0] for n in names}
        for c, call in enumerate(calls):
            order = names[(r + c) % len(names):] + names[:(r + c) % len(names)]
            outs = {}
            for n in order:
                t0 = time.perf_counter()
                outs[n] = engines[n].generate(input_ids=[prompts[i] for i in call],
                                              sampling_params=[params(i) for i in call])
                dt = time.perf_counter() - t0
                tok = sum(len(o.token_ids) for o in outs[n])
                per_round[n][0] += tok
                per_round[n][1] += dt
                s = stats[n]
                s["tok"], s["sec"] = s["tok"] + tok, s["sec"] + dt
                s["acc"] += sum(o.spec_accepted_tokens for o in outs[n])
                s["steps"] += sum(o.spec_verify_steps for o in outs[n])
            for n in names:
                for o, p in zip(outs[n], outs["plain"], strict=True):
                    d = _first_diff(o.token_ids, p.token_ids)
                    stats[n]["same"].append(d is None)
                    if d is not None:
                        stats[n]["diff"].append(d)
        base = per_round["plain"][0] / per_round["plain"][1]
        for n in names:
            stats[n]["ratios"].append(per_round[n][0] / per_round[n][1] / base)
        print(f"  round {r + 1}: " + ", ".join(f"{n} {per_round[n][0] / per_round[n][1]:.1f}" for n in names),
              flush=True)
    return [{"config": n, "tok_s": s["tok"] / s["sec"], "vs_plain": statistics.median(s["ratios"]),
             "tau": (s["acc"] + s["steps"]) / s["steps"] if s["steps"] else None,
             "same": sum(s["same"]) / len(s["same"]),
             "first_diff": statistics.mean(s["diff"]) if s["diff"] else None} for n, s in stats.items()]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--configs", default="plain,ddtree16,auto")
    ap.add_argument("--kv-tokens", type=int, default=16384)
    ap.add_argument("--deterministic", default="off", help="comma list of off/on: enable_deterministic_inference")
    ap.add_argument("--out", default="bench_out/seeded.json")
    args = ap.parse_args(argv)
    from ddtree_serve.model_executor.default_model import ensure_default_model
    from ddtree_serve.server.engine import Engine, SamplingParams

    m = machine()
    print(f"machine: {m}")
    names = ["plain", *[c for c in args.configs.split(",") if c != "plain"]]
    rows = []
    cells = [(d, m) for d in args.dtypes.split(",") for m in args.deterministic.split(",")]
    for dtype, det in cells:
        engines = {n: Engine(ensure_default_model(), dtype=dtype, max_total_tokens=args.kv_tokens,
                             enable_deterministic_inference=det == "on", **CONFIGS[n])
                   for n in names}
        try:
            ids = chat_ids(engines["plain"].tokenizer, CHAT_PROMPTS)

            def params(i: int) -> SamplingParams:
                return SamplingParams(temperature=args.temperature, seed=1000 + i, max_tokens=args.max_tokens)

            for e in engines.values():  # warm-up (and the auto budget's start-up probe)
                e.generate(input_ids=ids[:1], sampling_params=params(0))
            for batch in (int(b) for b in args.batch_sizes.split(",")):
                print(f"{dtype} det {det} batch {batch}:", flush=True)
                for row in run_cell(engines, ids, batch, args.rounds, params):
                    rows.append({"dtype": dtype, "det": det, "batch": batch, **row})
        finally:
            for e in engines.values():
                e.shutdown()
    print_table(rows, ["dtype", "det", "batch", "config", "tok_s", "vs_plain", "tau", "same", "first_diff"])
    payload = {"machine": m, "args": vars(args), "rows": rows}
    write_json(args.out, payload)
    return payload


if __name__ == "__main__":
    main()
