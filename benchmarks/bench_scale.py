"""The decode step at GPU scale on the simulated device (ddtree_serve/sim/): tokens/s against the device-bound
ideal, what the host does to the device each step, and the host's milliseconds per step by phase, plain decoding
vs DDTree at fixed budgets and the adaptive budget, per machine model.

The target and drafter are the simulated ones (ddtree_serve/model_executor/models/simulated.py): their forwards cost
the modelled device time of Kimi K2.6 on a machine of ddtree_serve/sim/machines.py (default: the presets' machines,
8x RTX PRO 6000 over PCIe and 8x B300 over NVLink) on a timeline off the host thread, and the host runs the real
scheduler, tree build, verification and commit (at a small vocabulary; the full vocabulary's work is device time).
The tracker (ddtree_serve/sim/device_tracker.py) charges the host what a GPU host pays: a launch per eager kernel
(a forward's ~8,500 unless it replays a graph), a blocking round trip per host read of a device tensor, value-
dependent shape or blocking copy. Each cell prefills ``batch`` requests, then measures ``--steps`` decode steps:

- ``tok_s``: generated tokens per second of the host's clock (wall time corrected by the charges and refunds,
  ddtree_serve/sim/device_clock.py); ``ideal_tok_s``: per modelled device second (a host that costs nothing and
  overlaps perfectly); ``of_ideal``: their ratio (never above 1); ``tau``: tokens per request per step;
- ``syncs``: synchronising host acts per step; ``in_window``: those made while a modelled forward was in flight
  (each closes the overlap window); ``launches``: eager kernels and graph replays per step; ``eager``: forwards
  per step launched kernel by kernel (a shape no graph was captured for: 0 where every forward replays);
  ``sync_sites``: where they are (file:line, count);
- ``host_ms``: host milliseconds per step (the clock less the time blocked on the device), ``host_share`` its ratio
  to device time, by phase: ``schedule`` (admission and batching), ``draft`` (drafter launch), ``build`` (top-K,
  pops, tree), ``verify_input`` (tree slots, forward inputs, launch), ``window`` (the overlap window's work),
  ``verify`` (the verification and the commit's device half), ``ahead`` (the next step's draft, top-K and tree
  queued before this step's read: DESIGN 4.17), ``commit`` (the commit's host half after the read: stops, frees),
  ``plain`` (a plain step's launch and sampling),
  ``process`` (stops, outputs); detokenising and streaming run in the detokenizer process and are not counted.

    python benchmarks/bench_scale.py [--machines rtx-pro-6000,b300] [--batches 1,32,128] [--budgets 8,16,auto]
        [--accept-prob 0.8] [--steps 8] [--prompt-len 128] [--vocab 128] [--cuda-graph-max-bs N] [--threads 1]
        [--gathered-logits] [--out bench_out/scale.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import machine  # noqa: E402
from ddtree_serve.model_executor.cuda_graph_runner import DEFAULT_GRAPH_MAX_BS  # noqa: E402
from ddtree_serve.model_executor.sampling_params import SamplingParams  # noqa: E402
from ddtree_serve.server.engine import Engine  # noqa: E402
from ddtree_serve.server.io_struct import GenerateReq  # noqa: E402
from ddtree_serve.sim.checkpoint import write_simulated_pair  # noqa: E402
from ddtree_serve.sim.machines import MACHINES  # noqa: E402

PHASES = ("schedule", "draft", "build", "verify_input", "window", "verify", "ahead", "commit", "plain", "process")
SPEC_LAPS = {"draft": "draft", "build": "build", "verify_forward": "verify_input", "window": "window",
             "verify": "verify", "ahead": "ahead", "commit": "commit", "plain": "plain"}  # SpecWorker.timer laps -> phases


def _engine(target: str, drafter: str, batch: int, budget: int | str | None, tokens: int, graphs: int,
            vocab_parallel: bool = True, sources: str = "dflash") -> Engine:
    spec = dict(speculative_algorithm="ddtree", speculative_draft_model_path=drafter, ddtree_budget=budget,
                speculative_draft_sources=sources) if budget else {}
    return Engine(target, device="cpu", dtype="float32", max_running_requests=batch, disable_radix_cache=True,
                  max_total_tokens=batch * tokens + 4096, chunked_prefill_size=8192, cuda_graph_max_bs=graphs,
                  vocab_parallel_logits=vocab_parallel, **spec)


def run_cell(target: str, drafter: str, batch: int, budget: int | str | None, steps: int, prompt_len: int,
             graphs: int = 0, vocab_parallel: bool = True, temperature: float = 0.0, sources: str = "dflash") -> dict:
    """Prefill ``batch`` requests, then time ``steps`` decode steps; returns the cell's row. ``sources``: the
    draft sources (``dflash``; ``dflash,suffix`` as the presets' ``auto`` resolves with a drafter)."""
    max_tokens = steps * 20 + 8  # never finishes within the measured steps
    eng = _engine(target, drafter, batch, budget, prompt_len + max_tokens + 80, graphs, vocab_parallel, sources)
    sched = eng.scheduler
    runner = sched.runner
    clock = runner.model.clock
    params = SamplingParams(temperature=temperature, seed=0, max_tokens=max_tokens, ignore_eos=True)
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
        clock.wait()  # nothing queued when the timing starts
        clock.reset_counters()
        device0, waited0 = clock.device_s, clock.waited_s
        out0 = sum(len(q.output_ids) for q in sched.running)
        t_start = clock.now()
        for _ in range(steps):
            with runner.device_session():  # as Scheduler.step
                t0 = clock.now()
                batch_ = sched.schedule()
                t1 = clock.now()
                w1 = clock.waited_s
                results = sched.run(batch_)
                t2 = clock.now()
                w2 = clock.waited_s
                sched.process(batch_, results)
                sched.outbox.clear()
                host["schedule"] += t1 - t0
                host["process"] += clock.now() - t2
                if timer is None:  # plain decoding: the whole run is launch + sampling, less the wait
                    host["plain"] += t2 - t1 - (w2 - w1)
        clock.wait()  # the device's last work belongs to the measured steps
        wall = clock.now() - t_start
        counters = clock.reset_counters()
        waited, device = clock.waited_s - waited0, clock.device_s - device0
        if timer is not None:
            for lap, phase in SPEC_LAPS.items():
                host[phase] += timer.totals.get(lap, 0.0)
        tokens = sum(len(q.output_ids) for q in sched.running) - out0
    finally:
        eng.shutdown()
    sites: dict[str, int] = {}
    for e in counters.syncs:
        key = f"{e.kind} {e.op.rsplit('.', 1)[-1]} {e.where}" + (" [window]" if e.in_window else "")
        sites[key] = sites.get(key, 0) + 1
    return dict(batch=batch, mode="plain" if budget is None else f"ddtree@{budget}", budget=budget, steps=steps,
                tokens=tokens, tau=round(tokens / (steps * batch), 3), tok_s=round(tokens / wall, 1),
                ideal_tok_s=round(tokens / device, 1), of_ideal=round(device / wall, 3),
                syncs=round(len(counters.syncs) / steps, 2), in_window=round(counters.in_window / steps, 2),
                launches=round(counters.launches / steps, 1), eager=round(counters.eager_forwards / steps, 2),
                device_ms=round(1e3 * device / steps, 2),
                wall_ms=round(1e3 * wall / steps, 2), host_ms=round(1e3 * (wall - waited) / steps, 2),
                host_share=round((wall - waited) / device, 3),
                phases_ms={p: round(1e3 * v / steps, 2) for p, v in host.items()},
                sync_sites={k: round(v / steps, 2) for k, v in sorted(sites.items(), key=lambda kv: -kv[1])})


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--machines", default=",".join(MACHINES), help="machine models (ddtree_serve/sim/machines.py)")
    ap.add_argument("--batches", default="1,32,128")
    ap.add_argument("--budgets", default="8,16,auto", help="fixed DDTree budgets, and auto (the adaptive budget)")
    ap.add_argument("--accept-prob", type=float, default=0.8, help="the drafter's per-depth chance of being right")
    ap.add_argument("--draft-top-prob", type=float, default=None, help="the probability the drafter claims for its "
                    "first token (default: --accept-prob, a calibrated drafter; higher: overconfident)")
    ap.add_argument("--steps", type=int, default=8, help="decode steps measured per cell")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=128, help="the synthetic vocabulary the host's tensors hold (the "
                    "full vocabulary's work is modelled device time)")
    ap.add_argument("--cuda-graph-max-bs", type=int, default=None, help="forwards of up to this many requests "
                    "replay a graph (one launch); 0: eager; default: the largest batch (at most 256), as the presets "
                    "run (a server captures up to --max-running-requests)")
    ap.add_argument("--threads", type=int, default=1, help="torch host threads (the host side is one thread)")
    ap.add_argument("--sites", action="store_true", help="print each cell's sync sites")
    ap.add_argument("--gathered-logits", action="store_true", help="all-gather every logits row under TP "
                    "(vocab_parallel_logits off); default: vocabulary-parallel, O(1) bytes a row")
    ap.add_argument("--temperature", type=float, default=0.0, help="sample every request (seeded): the sharded "
                    "draw's exchange")
    ap.add_argument("--draft-sources", default="dflash", help="DDTree's draft sources: dflash, or dflash,suffix (what "
                    "the presets' auto resolves to with a drafter)")
    ap.add_argument("--out", default="bench_out/scale.json")
    args = ap.parse_args(argv)
    if args.cuda_graph_max_bs is None:
        args.cuda_graph_max_bs = min(max(int(x) for x in args.batches.split(",")), DEFAULT_GRAPH_MAX_BS)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    info = machine()
    print(f"machine: {info}")
    cols = ("batch", "mode", "tau", "tok_s", "ideal_tok_s", "of_ideal", "syncs", "in_window", "launches", "eager",
            "device_ms", "host_ms")
    rows = []
    for name in args.machines.split(","):
        cost = replace(MACHINES[name], vocab_parallel=not args.gathered_logits)
        per_row = {k: cost.logits_bytes_per_row(k) for k in ("greedy", "seeded", "draft", "logprobs")}
        print(f"simulated device: Kimi K2.6 on 8x {name} (ddtree_serve/sim/machines.py), drafter accept_prob "
              f"{args.accept_prob}, graphs up to batch {args.cuda_graph_max_bs}")
        print(f"logits exchanged per row and rank ({'gathered' if args.gathered_logits else 'vocabulary-parallel'}):"
              + ", ".join(f" {k} {v:,.0f} B" for k, v in per_row.items()))
        print(" ".join(f"{c:>11}" for c in cols) + "  host ms by phase")
        with tempfile.TemporaryDirectory() as tmp:
            target, drafter = write_simulated_pair(tmp, vocab=args.vocab, accept_prob=args.accept_prob,
                                                    draft_top_prob=args.draft_top_prob, cost=cost)
            for batch in (int(x) for x in args.batches.split(",")):
                for budget in (None, *(x if x == "auto" else int(x) for x in args.budgets.split(","))):
                    row = run_cell(target, drafter, batch, budget, args.steps, args.prompt_len,
                                   args.cuda_graph_max_bs, not args.gathered_logits, args.temperature,
                                   args.draft_sources)
                    row["machine"], row["logits_bytes_per_row"] = name, per_row
                    rows.append(row)
                    phases = " ".join(f"{k}={v:.2f}" for k, v in row["phases_ms"].items() if v >= 0.005)
                    print(" ".join(f"{row[c]!s:>11}" for c in cols) + f"  {phases}", flush=True)
                    if args.sites:
                        for site, n in row["sync_sites"].items():
                            print(f"{'':>24}{n:>6} {site}")
    torch.set_num_threads(threads)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = dict(machine=info, accept_prob=args.accept_prob, draft_top_prob=args.draft_top_prob, vocab=args.vocab,
                  cuda_graph_max_bs=args.cuda_graph_max_bs, rows=rows)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
