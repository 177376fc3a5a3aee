"""Speculative decoding on the default model: decode tokens/s and tau of none, DDTree at fixed budgets and the
adaptive budget ("auto", issue 15), optionally dflash (chain), at several batch sizes, greedy and T=1, all in
one run, with INTERLEAVED repetitions: every configuration has its own engine, and each (batch size,
temperature) cell runs the configurations in rounds, the order rotated every round, so that the machine's
drift (2-3x between runs minutes apart on a shared CPU) hits all of them alike. The engines of none, of an
A/A control (a second plain engine, ``none-aa``: its paired ratio to none measures the noise) and of auto
live through the whole run; each fixed budget (and dflash) gets its engine in turn (memory), and runs
``--fixed-rounds`` rounds of (none, none-aa, auto, it) per cell, and ``--contender-rounds`` more in a cell
where it reached ``--contender-within`` x none (a contender for the best); then ``--rounds`` rounds of (none,
none-aa, auto). A round serves at least ``--round-prompts`` requests (a smaller batch runs several calls, every
engine in turn call by call), so a batch-1 round does not hang on one prompt's acceptance. Every engine is warmed up alike by
one request of ``--max-tokens``. Per cell and configuration it
reports the median tokens/s over the rounds and the median of the per-round ratios to none (paired: the same
round), plus the budgets auto chose (mean, share of plain steps, most frequent) and a per-step time
breakdown; then a summary of auto against none and against the best of {none, every fixed budget} (the
issue's bar: >= 0.95x the best, never below none, the latter to the resolution ``tol`` that the A/A control
gives). Table + JSON.

    python benchmarks/bench_spec.py [--budgets 4,16,64] [--no-auto] [--no-control] [--dflash] [--batch-sizes 1,4,16,32]
        [--temperatures 0,1] [--max-tokens 64] [--round-prompts 4] [--rounds 3] [--fixed-rounds N]
        [--contender-rounds 6] [--contender-within 0.9] [--threads 1] [--deterministic] [--out bench_out/spec.json]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.common import CHAT_PROMPTS, chat_ids, machine, print_table, write_json  # noqa: E402
from ddtree_serve.server.engine import Engine, SamplingParams  # noqa: E402

PHASES = ("draft", "build", "verify_forward", "verify", "commit", "plain")
CONTROL = "none-aa"  # a second plain engine: its paired ratio to none is the measurement's noise floor


def run(engine: Engine, ids: list[list[int]], params: SamplingParams) -> dict:
    """One generate call: its raw counters (``merge`` sums those of several calls, ``finish`` reads them)."""
    spec = engine.scheduler.spec
    ctl = spec.controller if spec is not None else None
    if spec is not None:
        spec.timer.totals.clear()
        spec.timer.steps = 0
    if ctl is not None:
        ctl.chosen.clear()
    t = time.perf_counter()
    outs = engine.generate(input_ids=ids, sampling_params=params)
    raw: dict = {"generated": sum(len(o.token_ids) for o in outs), "wall_s": time.perf_counter() - t}
    if spec is not None:
        raw.update(spec_steps=sum(o.spec_verify_steps for o in outs),
                   # tokens of verify steps (accepted drafts + bonus); plain steps' tokens are not tau's
                   accepted=sum(o.spec_accepted_tokens + o.spec_verify_steps for o in outs),
                   budget_sum=sum(o.spec_budget_sum for o in outs), timer_steps=spec.timer.steps,
                   phase_s=dict(spec.timer.totals))
    if ctl is not None:
        raw["budget_counts"] = dict(ctl.chosen)
    return raw


def merge(a: dict | None, b: dict) -> dict:
    """Raw counters of two calls, summed (dicts key by key)."""
    if a is None:
        return b
    out = {}
    for k in a.keys() | b.keys():
        x, y = a.get(k), b.get(k)
        if isinstance(x, dict) or isinstance(y, dict):
            out[k] = dict(Counter(x or {}) + Counter(y or {}))
        else:
            out[k] = (x or 0) + (y or 0)
    return out


def finish(raw: dict) -> dict:
    """A row from raw counters: tokens/s, tau, per-step phase times (ms) and the budgets auto chose."""
    wall = raw["wall_s"]
    row: dict = {"tok_s": raw["generated"] / wall, "generated": raw["generated"], "wall_s": wall}
    if "spec_steps" in raw:
        steps, n = max(raw["spec_steps"], 1), max(raw["timer_steps"], 1)
        row["tau"] = raw["accepted"] / steps
        row.update({f"{k}_ms": 1000 * v / n for k, v in raw["phase_s"].items()})
        row["sched_ms"] = 1000 * max(wall - sum(raw["phase_s"].values()), 0.0) / n
        row["mean_budget"] = raw["budget_sum"] / steps
    if "budget_counts" in raw:
        row["budget_counts"] = raw["budget_counts"]
    return row


def configs_from(args) -> list[tuple[str, str, int | str]]:
    """(label, algorithm, budget) of every configuration; none first."""
    out = [("none", "none", 0)] + ([(CONTROL, "none", 0)] if args.control else [])
    out += [("dflash", "dflash", 0)] if args.dflash else []
    out += [(f"ddtree@{b}", "ddtree", int(b)) for b in args.budgets.split(",") if b]
    return out + ([("auto", "ddtree", "auto")] if args.auto else [])


def build_engine(alg: str, budget: int | str, args) -> Engine:
    kw = {} if alg == "none" else {"speculative_algorithm": alg, "draft_model_path": args.draft_model_path,
                                   "ddtree_budget": budget or 1}
    if budget == "auto":  # the bound of the auto budget (with a fixed budget it is a configuration error)
        kw["ddtree_max_budget"] = args.max_budget
    engine = Engine("default", dtype=args.dtype, max_total_tokens=args.kv_tokens,
                    enable_deterministic_inference=getattr(args, "deterministic", False), **kw)  # bench_drafter's args: off
    ids = chat_ids(engine.tokenizer, CHAT_PROMPTS)
    # warm-up, the same for every engine: one request of --max-tokens (first-call allocations; auto's
    # controller learns its first acceptance curve and corrects the start-up probe's costs here)
    run(engine, ids[:1], SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True))
    return engine


def run_rounds(engines: dict, ids_of: Callable[[int], list[list[int]]], params_of: Callable[[int], SamplingParams],
               bs: int, rounds: int, first_round: int, rows: dict[str, list]) -> int:
    """``rounds`` interleaved rounds over every engine in ``engines``, all of a round on the prompts
    ``ids_of(round)`` and the sampling parameters ``params_of(round)`` in calls of ``bs`` requests, each call
    run by every engine in turn, the order rotated every call (a batch smaller than the round interleaves
    request by request); the rows (tagged with a global round id, so that ratios pair rows of the same round)
    go to ``rows``. Returns the next round id. The seed changes with the round: under sampling, each
    configuration draws its own sample path (speculation consumes a request's random stream differently
    from plain decoding), and its acceptance depends on that path. With one seed for every round, a fixed
    budget whose paths happen to accept well is lucky in every round, and the A/A control cannot see it
    (its two plain engines draw the same path)."""
    labels = list(engines)
    for k in range(rounds):
        rid = first_round + k
        ids = ids_of(rid)
        raw: dict[str, dict | None] = dict.fromkeys(labels)
        for j, i in enumerate(range(0, len(ids), bs)):
            rot = (rid + j) % len(labels)
            for lab in labels[rot:] + labels[:rot]:
                raw[lab] = merge(raw[lab], run(engines[lab], ids[i:i + bs], params_of(rid)))
        for lab in labels:
            rows.setdefault(lab, []).append({**finish(raw[lab]), "round": rid})
    return first_round + rounds


def paired_ratio(rows: dict[str, list], label: str) -> float:
    """Median over ``label``'s rounds of its tokens/s over none's in the same round."""
    none = {r["round"]: r["tok_s"] for r in rows["none"]}
    return statistics.median(r["tok_s"] / none[r["round"]] for r in rows[label])


def summarise_cell(rows: dict[str, list], bs: int, temp: float) -> list[dict]:
    """Median tokens/s per label, median of the per-round ratios to none, phase medians, auto's budgets."""
    out = []
    for lab, rs in rows.items():
        s = {"config": lab, "batch": bs, "temperature": temp, "rounds": len(rs),
             "tok_s": statistics.median(r["tok_s"] for r in rs),
             "tok_s_all": [round(r["tok_s"], 2) for r in rs], "vs_none": paired_ratio(rows, lab)}
        for key in ("tau", "mean_budget", "sched_ms", *(f"{p}_ms" for p in PHASES)):
            vals = [r[key] for r in rs if key in r]
            if vals:
                s[key] = statistics.median(vals)
        counts: Counter[int] = Counter()
        for r in rs:
            counts.update(r.get("budget_counts", {}))
        if counts:
            total = sum(counts.values())
            s["budget_counts"] = {int(b): n for b, n in sorted(counts.items())}
            s["plain_share"] = counts[0] / total
            s["budgets_chosen"] = " ".join(f"{b}:{n}" for b, n in counts.most_common(4))
        out.append(s)
    return out


def cross_fitted_vs_best(rows: dict[str, list]) -> float:
    """auto / the best of {none, fixed budgets}, with the best chosen on some rounds and measured on others.
    Choosing and measuring on the same rounds picks the luckiest of several noisy estimates, so that ratio is
    biased against auto. Fold f (0, 1) holds the rounds at even / odd positions of each configuration's own
    rounds. On fold f the best is the configuration with the largest median paired ratio to none; on the
    other fold, auto's median paired ratio to that configuration is measured. The result is the mean of the
    two (nan where a fold lacks rounds)."""
    none = {r["round"]: r["tok_s"] for r in rows["none"]}
    auto = {r["round"]: r["tok_s"] for r in rows["auto"]}
    candidates = [lab for lab in rows if lab not in ("auto", CONTROL)]

    def fold(lab: str, f: int) -> list[dict]:
        return [r for i, r in enumerate(rows[lab]) if i % 2 == f and r["round"] in auto]

    measured = []
    for f in (0, 1):
        score = {lab: statistics.median(r["tok_s"] / none[r["round"]] for r in fold(lab, f))
                 for lab in candidates if fold(lab, f)}
        held_out = fold(max(score, key=score.__getitem__), 1 - f) if score else []
        if not held_out:
            return float("nan")
        measured.append(statistics.median(auto[r["round"]] / r["tok_s"] for r in held_out))
    return sum(measured) / 2


def auto_summary(summary: list[dict], rows_by_cell: dict) -> list[dict]:
    """Per cell: auto against none and against the best non-auto configuration (by its median paired ratio to
    none: the fixed budgets run in fewer rounds, so their median tokens/s come from other moments of the
    machine), both as the median of per-round ratios (paired rounds). With the A/A control (a second plain engine), ``aa`` is
    its median ratio to none and ``tol`` twice the standard error of a median of that many paired ratios
    (1.2533 x their standard deviation / sqrt(rounds)): the resolution of "never below none" in this run.
    ``ok``: vs_best >= 0.95 and vs_none >= 1 - tol (without a control, tol = 0). ``vs_best_cv``: the same
    ratio with the best chosen and measured on different rounds (``cross_fitted_vs_best``)."""
    out = []
    for (bs, temp), rows in rows_by_cell.items():
        if "auto" not in rows:
            continue
        cell = [s for s in summary
                if (s["batch"], s["temperature"]) == (bs, temp) and s["config"] not in ("auto", CONTROL)]
        best = max(cell, key=lambda s: s["vs_none"])  # paired: a fixed budget runs fewer rounds than none
        by_round = {r["round"]: r["tok_s"] for r in rows[best["config"]]}
        vs_best = statistics.median(r["tok_s"] / by_round[r["round"]] for r in rows["auto"] if r["round"] in by_round)
        auto = next(s for s in summary if (s["batch"], s["temperature"], s["config"]) == (bs, temp, "auto"))
        row = {"batch": bs, "temperature": temp, "auto_tok_s": auto["tok_s"], "best": best["config"],
               "best_tok_s": best["tok_s"], "vs_best": vs_best, "vs_best_cv": cross_fitted_vs_best(rows),
               "vs_none": auto["vs_none"],
               "plain_share": auto.get("plain_share"), "tol": 0.0}
        if CONTROL in rows:
            none_by_round = {r["round"]: r["tok_s"] for r in rows["none"]}
            aa = [r["tok_s"] / none_by_round[r["round"]] for r in rows[CONTROL]]
            row["aa"] = statistics.median(aa)
            row["tol"] = 2 * 1.2533 * statistics.stdev(aa) / len(aa) ** 0.5 if len(aa) > 1 else 0.0
        row["ok"] = vs_best >= 0.95 and auto["vs_none"] >= 1.0 - row["tol"]
        out.append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budgets", default="4,16,64", help="fixed DDTree budgets ('' for none)")
    ap.add_argument("--no-auto", dest="auto", action="store_false", help="skip the adaptive budget")
    ap.add_argument("--no-control", dest="control", action="store_false",
                    help="skip the A/A control (a second plain engine next to none: the noise floor)")
    ap.add_argument("--max-budget", type=int, default=64, help="upper bound of the auto budget")
    ap.add_argument("--dflash", action="store_true", help="also run dflash (chain)")
    ap.add_argument("--batch-sizes", default="1,4,16,32")
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--round-prompts", type=int, default=4,
                    help="requests per round at least (a batch smaller than this runs several calls per round)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of none and auto per cell, after the fixed ones")
    ap.add_argument("--fixed-rounds", type=int, default=None,
                    help="rounds per cell of each fixed budget / dflash next to none and auto (default --rounds)")
    ap.add_argument("--contender-rounds", type=int, default=6,
                    help="more rounds in a cell for a fixed configuration that reaches --contender-within x none")
    ap.add_argument("--contender-within", type=float, default=0.9,
                    help="paired median ratio to none (over its first rounds) that makes a fixed configuration a "
                         "contender for the best in a cell")
    ap.add_argument("--draft-model-path", default="default")
    ap.add_argument("--dtype", default="auto", help="auto: the engine's default (bfloat16 where the CPU has AMX)")
    ap.add_argument("--kv-tokens", type=int, default=8192, help="KV pool per engine (several are alive at once)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads (1 is far faster on a CPU shared with other jobs: no spinning)")
    ap.add_argument("--deterministic", action="store_true",
                    help="enable_deterministic_inference (batch-invariant kernels): run once with and once without "
                         "it for the mode's cost")
    ap.add_argument("--out", default="bench_out/spec.json")
    args = ap.parse_args()
    fixed_rounds = args.rounds if args.fixed_rounds is None else args.fixed_rounds
    if args.threads:
        torch.set_num_threads(args.threads)
    mach = machine()
    print(f"[bench] {mach}", flush=True)
    t0 = time.perf_counter()
    configs = configs_from(args)
    base = {lab: build_engine(alg, budget, args) for lab, alg, budget in configs if lab in ("none", CONTROL, "auto")}
    ids_all = chat_ids(base["none"].tokenizer, CHAT_PROMPTS)
    cells = [(int(b), float(t)) for b in args.batch_sizes.split(",") for t in args.temperatures.split(",")]
    rows_by_cell: dict = {c: {} for c in cells}
    next_round = dict.fromkeys(cells, 0)

    def phase(engines: dict, rounds: int, contender: str | None = None) -> None:
        """``rounds`` rounds of ``engines`` per cell; a fixed configuration (``contender``) that reaches
        ``--contender-within`` x none in them runs ``--contender-rounds`` more there: where a fixed budget may
        be the best, the bar's ratio rests on its rounds, and two of them are too few on a noisy machine."""
        for bs, temp in cells:
            def ids_of(rid: int, bs: int = bs) -> list[list[int]]:  # round k starts at prompt k, and serves
                n = max(bs, args.round_prompts)  # at least --round-prompts of them (small batches: several calls)
                rot = ids_all[rid % len(ids_all):] + ids_all[:rid % len(ids_all)]
                return (rot * ((n + len(rot) - 1) // len(rot)))[:n]

            def params_of(rid: int, temp: float = temp) -> SamplingParams:  # seed = round: see run_rounds
                return SamplingParams(temperature=temp, max_tokens=args.max_tokens, seed=rid, ignore_eos=True)

            cell = rows_by_cell[(bs, temp)]
            print(f"[bench] {'/'.join(engines)} batch={bs} T={temp}: {rounds} rounds", flush=True)
            next_round[(bs, temp)] = run_rounds(engines, ids_of, params_of, bs, rounds, next_round[(bs, temp)], cell)
            if contender and args.contender_rounds and paired_ratio(cell, contender) >= args.contender_within:
                print(f"[bench]   {contender} within {args.contender_within:g}x none: {args.contender_rounds} more "
                      "rounds", flush=True)
                next_round[(bs, temp)] = run_rounds(engines, ids_of, params_of, bs, args.contender_rounds,
                                                    next_round[(bs, temp)], cell)
            last = {lab: rows_by_cell[(bs, temp)][lab][-1]["tok_s"] for lab in engines}
            print("[bench]   last round tok/s: " + "  ".join(f"{k} {v:.1f}" for k, v in last.items())
                  + f"  [{time.perf_counter() - t0:.0f} s]", flush=True)

    for lab, alg, budget in configs:  # one extra engine at a time (memory), next to none's and auto's
        if lab not in base:
            extra = build_engine(alg, budget, args)
            phase({**base, lab: extra}, fixed_rounds, contender=lab)
            extra.shutdown()
            del extra
            gc.collect()
    phase(base, args.rounds)
    for e in base.values():
        e.shutdown()
    summary = []
    for (bs, temp), rows in rows_by_cell.items():
        cell = summarise_cell(rows, bs, temp)
        summary += cell
    cols = ["config", "batch", "temperature", "rounds", "tau", "tok_s", "vs_none", "mean_budget", "plain_share",
            "draft_ms", "build_ms", "verify_forward_ms", "verify_ms", "commit_ms", "plain_ms", "sched_ms",
            "budgets_chosen"]
    print_table(summary, cols)
    autos = auto_summary(summary, rows_by_cell)
    if autos:
        print("\nauto vs none and vs the best of {none, fixed budgets} (medians of per-round ratios):")
        print_table(autos, ["batch", "temperature", "auto_tok_s", "best", "best_tok_s", "vs_best", "vs_best_cv",
                            "vs_none", "aa", "tol", "plain_share", "ok"])
    print(f"[bench] {time.perf_counter() - t0:.0f} s")
    raw = {f"{bs},{temp}": rows for (bs, temp), rows in rows_by_cell.items()}
    write_json(args.out, {"machine": mach, "args": vars(args), "summary": summary, "auto_summary": autos,
                          "rounds": raw, "seconds": time.perf_counter() - t0})


if __name__ == "__main__":
    main()
