"""What the adaptive budget costs when it decodes plainly: a plain engine (none) against an auto engine held to
plain decode steps (its controller's ``plan_draft`` answers False), in interleaved calls on the same
prompts, so the difference is auto's plain-step overhead (the target-layer capture, the drafter-context
writes of prefill and plain steps, the controller's bookkeeping, the worker's step prologue). Per batch size
it reports the median per-call time ratio auto / none and, for one more call of the auto engine, the time
spent in each of those parts.

    python benchmarks/bench_plain_overhead.py [--batch-sizes 16,32] [--calls 8] [--max-tokens 32]
        [--kv-tokens 8192] [--out bench_out/plain_overhead.json]

Measurement only: the worker's and controller's methods are wrapped with timers for the last call.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import CHAT_PROMPTS, chat_ids, machine, print_table, write_json  # noqa: E402
from ddtree_serve.server.engine import Engine, SamplingParams  # noqa: E402

PARTS = (  # (owner of the method, given the worker; method; label)
    (lambda w: w.drafter, "write_context", "context writes"),
    (lambda w: w.deferred, "write", "of which deferred"),
    (lambda w: w.controller, "record", "controller record"),
    (lambda w: w, "decode", "worker decode"),
    (lambda w: w, "_plain_step", "of which plain step"),
)


def timed_parts(engine: Engine, params: SamplingParams, ids: list[list[int]]) -> dict[str, float]:
    """Milliseconds spent in each part of PARTS during one call (the methods are restored afterwards)."""
    worker = engine.scheduler.spec
    spent: Counter[str] = Counter()
    saved = []
    for owner_of, name, label in PARTS:
        owner = owner_of(worker)
        saved.append((owner, name, owner.__dict__.get(name)))  # an instance attribute, or None: the class's
        inner = getattr(owner, name)

        def wrapper(*a, _inner=inner, _label=label, **k):
            t = time.perf_counter()
            try:
                return _inner(*a, **k)
            finally:
                spent[_label] += time.perf_counter() - t

        setattr(owner, name, wrapper)
    try:
        engine.generate(input_ids=ids, sampling_params=params)
    finally:
        for owner, name, own in saved:
            if own is None:
                delattr(owner, name)
            else:
                setattr(owner, name, own)
    return {label: 1000 * spent[label] for _, _, label in PARTS}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch-sizes", default="16,32")
    ap.add_argument("--calls", type=int, default=8, help="interleaved calls per engine and batch size")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--kv-tokens", type=int, default=8192, help="KV pool per engine (two are alive at once)")
    ap.add_argument("--out", default="bench_out/plain_overhead.json")
    args = ap.parse_args()
    none = Engine("default", max_total_tokens=args.kv_tokens)
    auto = Engine("default", speculative_algorithm="ddtree", ddtree_budget="auto", max_total_tokens=args.kv_tokens)
    auto.scheduler.spec.controller.plan_draft = lambda sampled, fits=True: False  # plain steps only
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    prompts = chat_ids(none.tokenizer, CHAT_PROMPTS)
    rows = []
    for bs in (int(b) for b in args.batch_sizes.split(",")):
        ids = (prompts * (bs // len(prompts) + 1))[:bs]
        for e in (none, auto):  # warm-up
            e.generate(input_ids=ids, sampling_params=params)
        times: dict[str, list[float]] = {"none": [], "auto": []}
        for k in range(args.calls):
            order = (("none", none), ("auto", auto)) if k % 2 == 0 else (("auto", auto), ("none", none))
            for label, e in order:
                t = time.perf_counter()
                e.generate(input_ids=ids, sampling_params=params)
                times[label].append(time.perf_counter() - t)
            print(f"[bench] batch {bs} call {k + 1}/{args.calls}: none {times['none'][-1]:.3f} s  "
                  f"auto {times['auto'][-1]:.3f} s", flush=True)
        ratio = statistics.median(a / n for a, n in zip(times["auto"], times["none"], strict=True))
        row = {"batch": bs, "none_s": statistics.median(times["none"]), "auto_s": statistics.median(times["auto"]),
               "auto_over_none": ratio}
        row.update({f"{label} ms": v for label, v in timed_parts(auto, params, ids).items()})
        rows.append(row)
    print_table(rows, list(rows[0]))
    write_json(args.out, {"machine": machine(), "args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
