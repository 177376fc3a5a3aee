"""The decode step at GPU scale on the simulated device (ddtree_serve/sim/): tokens/s, the device-bound ideal and
the host's milliseconds per step by phase, plain decoding vs DDTree at fixed budgets and the adaptive budget.

The target and drafter are the simulated ones (ddtree_serve/model_executor/models/simulated.py): their forwards cost
the modelled device time of Kimi K2.6 on 8 GPUs (``DeviceCostModel``) on a timeline off the host thread, and the
host runs the real scheduler, tree build, verification and commit (at a small vocabulary; the full vocabulary's
work is device time). Each cell prefills ``batch`` requests, then measures ``--steps`` decode steps:

- ``tok_s``: generated tokens per wall second; ``ideal_tok_s``: per modelled device second (a host that costs
  nothing and overlaps perfectly); ``tau``: tokens per request per step;
- ``device_ops_ms``: tensor work that is device work in deployment (vocabulary top-k, logits rows, sampling,
  verification), which the CPU runs here at the small vocabulary (``DeviceClock.on_device``): not host time (the
  modelled forwards include its full-size cost): ``tok_s`` counts the wall time less it, ``raw_tok_s`` all of it;
- ``host_ms``: host milliseconds per step (wall less the time blocked on the device and the device ops), by
  phase: ``schedule``
  (admission and batching), ``draft`` (drafter launch), ``build`` (top-K, pops, tree), ``verify_input`` (tree
  slots, forward inputs, launch), ``verify`` (the verification walk), ``commit`` (KV commit), ``plain`` (a plain
  step's launch and sampling), ``process`` (stops, outputs); detokenising and streaming run in the detokenizer
  process and are not counted.

    python benchmarks/bench_scale.py [--batches 1,32,128,256] [--budgets 8,16,64,auto] [--accept-prob 0.8]
        [--steps 8] [--prompt-len 128] [--vocab 128] [--threads 1] [--out bench_out/scale.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import machine  # noqa: E402
from ddtree_serve.model_executor.sampling_params import SamplingParams  # noqa: E402
from ddtree_serve.server.engine import Engine  # noqa: E402
from ddtree_serve.server.io_struct import GenerateReq  # noqa: E402
from ddtree_serve.sim.checkpoint import write_simulated_pair  # noqa: E402

PHASES = ("schedule", "draft", "build", "verify_input", "verify", "commit", "plain", "process")
SPEC_LAPS = {"draft": "draft", "build": "build", "verify_forward": "verify_input", "verify": "verify",
             "commit": "commit", "plain": "plain"}  # SpecWorker.timer laps -> phases


def _engine(target: str, drafter: str, batch: int, budget: int | str | None, tokens: int) -> Engine:
    spec = dict(speculative_algorithm="ddtree", speculative_draft_model_path=drafter, ddtree_budget=budget,
                speculative_draft_sources="dflash") if budget else {}
    return Engine(target, device="cpu", dtype="float32", max_running_requests=batch, disable_radix_cache=True,
                  max_total_tokens=batch * tokens + 4096, chunked_prefill_size=8192, **spec)


def run_cell(target: str, drafter: str, batch: int, budget: int | str | None, steps: int, prompt_len: int) -> dict:
    """Prefill ``batch`` requests, then time ``steps`` decode steps; returns the cell's row."""
    max_tokens = steps * 20 + 8  # never finishes within the measured steps
    eng = _engine(target, drafter, batch, budget, prompt_len + max_tokens + 80)
    sched = eng.scheduler
    clock = sched.runner.model.clock
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    try:
        for i in range(batch):
            sched.add_request(GenerateReq(f"r{i}", [(i * 31 + j * 7) % 100 + 1 for j in range(prompt_len)], params))
        while len(sched.running) < batch:  # prefill (and the first tokens): not measured
            sched.step()
        sched.step()  # one decode step of warm-up
        host = dict.fromkeys(PHASES, 0.0)
        timer = sched.spec.timer if sched.spec is not None else None
        if timer is not None:
            timer.totals.clear()
        device0, waited0, ops0 = clock.device_s, clock.waited_s, clock.device_ops_s
        out0 = sum(len(q.output_ids) for q in sched.running)
        t_start = time.perf_counter()
        for _ in range(steps):
            t0 = time.perf_counter()
            batch_ = sched.schedule()
            t1 = time.perf_counter()
            results = sched.run(batch_)
            t2 = time.perf_counter()
            sched.process(batch_, results)
            sched.outbox.clear()
            host["schedule"] += t1 - t0
            host["process"] += time.perf_counter() - t2
            if timer is None:  # plain decoding: the whole run is launch + sampling, less the wait
                host["plain"] += t2 - t1
        wall = time.perf_counter() - t_start
        waited, device, ops = clock.waited_s - waited0, clock.device_s - device0, clock.device_ops_s - ops0
        if timer is None:
            host["plain"] -= waited + ops
        else:
            for lap, phase in SPEC_LAPS.items():
                host[phase] += timer.totals.get(lap, 0.0)
        tokens = sum(len(q.output_ids) for q in sched.running) - out0
    finally:
        eng.shutdown()
    return dict(batch=batch, mode="plain" if budget is None else f"ddtree@{budget}", budget=budget, steps=steps,
                tokens=tokens, tau=round(tokens / (steps * batch), 3), tok_s=round(tokens / (wall - ops), 1),
                raw_tok_s=round(tokens / wall, 1),
                ideal_tok_s=round(tokens / device, 1), device_ms=round(1e3 * device / steps, 2),
                wall_ms=round(1e3 * wall / steps, 2), host_ms=round(1e3 * (wall - waited - ops) / steps, 2),
                device_ops_ms=round(1e3 * ops / steps, 2), host_share=round((wall - waited - ops) / device, 3),
                phases_ms={p: round(1e3 * v / steps, 2) for p, v in host.items()})


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,32,128,256")
    ap.add_argument("--budgets", default="8,16,64,auto", help="fixed DDTree budgets, and auto (the adaptive budget)")
    ap.add_argument("--accept-prob", type=float, default=0.8, help="the drafter's per-depth chance of being right")
    ap.add_argument("--draft-top-prob", type=float, default=None, help="the probability the drafter claims for its "
                    "first token (default: --accept-prob, a calibrated drafter; higher: overconfident)")
    ap.add_argument("--steps", type=int, default=8, help="decode steps measured per cell")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=128, help="the synthetic vocabulary the host's tensors hold (the "
                    "full vocabulary's work is modelled device time)")
    ap.add_argument("--threads", type=int, default=1, help="torch host threads (the host side is one thread)")
    ap.add_argument("--out", default="bench_out/scale.json")
    args = ap.parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    info = machine()
    print(f"machine: {info}")
    print(f"simulated device: Kimi K2.6 on 8 GPUs (ddtree_serve/sim/device_clock.py), drafter accept_prob "
          f"{args.accept_prob}")
    cols = ("batch", "mode", "tau", "tok_s", "ideal_tok_s", "device_ms", "host_ms", "host_share")
    print(" ".join(f"{c:>11}" for c in cols) + "  host ms by phase")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        target, drafter = write_simulated_pair(tmp, vocab=args.vocab, accept_prob=args.accept_prob,
                                                draft_top_prob=args.draft_top_prob)
        for batch in (int(x) for x in args.batches.split(",")):
            for budget in (None, *(x if x == "auto" else int(x) for x in args.budgets.split(","))):
                row = run_cell(target, drafter, batch, budget, args.steps, args.prompt_len)
                rows.append(row)
                phases = " ".join(f"{k}={v:.2f}" for k, v in row["phases_ms"].items() if v >= 0.005)
                print(" ".join(f"{row[c]!s:>11}" for c in cols) + f"  {phases}", flush=True)
    torch.set_num_threads(threads)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = dict(machine=info, accept_prob=args.accept_prob, draft_top_prob=args.draft_top_prob, vocab=args.vocab,
                  rows=rows)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
