"""TP collectives check (benchmarks/gpu_check.sh): every local GPU as one TP rank over NCCL, through the server's
own TP group (``ddtree_serve.model_executor.parallel_state.init_tp`` / ``TPGroup``), at the sizes the model's collectives
use; on CPU two gloo processes run the same code (how tests/benchmarks/test_allreduce_check.py runs it).

    python benchmarks/allreduce_check.py [--world-size N] [--device auto|cuda|cpu] [--model-path DIR]
        [--hidden 7168] [--vocab 163840] [--dtype bfloat16] [--tokens 1,8,64,...] [--out bench_out/allreduce.json]

What the model sends per forward (ddtree_serve/model_executor/layers): an all-reduce of ``[tokens, hidden]`` in the model's
dtype after every row-parallel projection (attention output, MLP / MoE down projection, vocab-parallel
embedding), and an all-gather of the float32 logits ``[rows, vocab / N]`` (the rows that need logits).
Token counts: decode batches, verify trees (batch x (budget + 1)) and prefill chunks; the defaults are
Kimi K2.6's (hidden 7168, vocab 163840, bfloat16) from 1 to a 16,384-token chunk.

Per size, on every rank:
- correctness: rank ``r`` all-reduces ``(r + 1) * p`` with ``p`` in {0, 1} (every partial sum an integer at
  most N (N + 1) / 2, exact in bfloat16), which must equal ``p * N (N + 1) / 2`` exactly; the all-gather
  of ``rank + 1`` blocks must come back in rank order;
- bandwidth: ``--iters`` timed collectives after ``--warmup`` untimed ones: the mean time, the algorithm
  bandwidth (bytes / time) and the bus bandwidth (all-reduce: x 2 (N - 1) / N; all-gather: x (N - 1) / N;
  the conventions of NVIDIA's nccl-tests), as rank 0 measures them.

Exit status 0 only when every size was exact on every rank; 1 on a wrong result; 2 when a rank failed (it did
not start, raised, or timed out) or ``--device cuda`` finds no CUDA; 3 when there are fewer than 2 ranks to
run (one GPU has no all-reduce to check). Prints one row per size and writes ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue as queue_mod
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

DEFAULT_TOKENS = "1,8,64,512,4096,16384"
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True)
class CheckSpec:
    world: int
    device: str  # cuda | cpu
    hidden: int
    vocab: int
    dtype: str
    tokens: tuple[int, ...]
    iters: int
    warmup: int


@dataclass(frozen=True)
class SizeResult:
    op: str  # all_reduce | all_gather
    tokens: int
    shape: tuple[int, ...]  # this rank's tensor
    bytes: int
    exact: bool
    mean_us: float
    algbw_gbps: float
    busbw_gbps: float


def _time(fn, iters: int, warmup: int, cuda: bool) -> float:  # noqa: ANN001
    """Mean seconds of ``fn()`` over ``iters`` calls after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / max(iters, 1)


def _rank_main(rank: int, spec: CheckSpec, addr: str, out) -> None:  # noqa: ANN001 - an mp.Queue
    """One TP rank: every size's check; puts ``(rank, [SizeResult...] | None, error | None)``."""
    try:
        from ddtree_serve.model_executor.parallel_state import destroy_tp, init_tp
        from ddtree_serve.server.config import ParallelArgs

        tp = init_tp(ParallelArgs(tp_size=spec.world), rank, spec.device, addr)
        dev = torch.device(f"cuda:{torch.cuda.current_device()}") if spec.device == "cuda" else torch.device("cpu")
        cuda, n, dtype = dev.type == "cuda", spec.world, _DTYPES[spec.dtype]
        results = []
        try:
            for t in spec.tokens:
                # all-reduce of [t, hidden]: (rank + 1) * p sums to p * n (n + 1) / 2, exact
                p = (torch.arange(t * spec.hidden, device=dev) % 2).view(t, spec.hidden).to(dtype)  # [t, H]
                x = p * (rank + 1)
                tp.all_reduce(x)
                exact = bool(torch.equal(x, p * (n * (n + 1) // 2)))
                buf = torch.zeros(t, spec.hidden, dtype=dtype, device=dev)  # stays zero: timing only
                s = _time(lambda b=buf: tp.all_reduce(b), spec.iters, spec.warmup, cuda)
                nbytes = buf.numel() * buf.element_size()
                alg = nbytes / s / 1e9
                results.append(SizeResult("all_reduce", t, (t, spec.hidden), nbytes, exact, s * 1e6, alg,
                                          alg * 2 * (n - 1) / n))
                # all-gather of the float32 logits [t, vocab / n] (the LM head's padded shard)
                shard = -(-spec.vocab // n)
                part = torch.full((t, shard), float(rank + 1), dtype=torch.float32, device=dev)  # [t, V/n]
                got = tp.all_gather_last_dim(part)  # [t, n * V/n]
                want = torch.arange(1, n + 1, dtype=torch.float32, device=dev).repeat_interleave(shard)
                exact = bool(torch.equal(got, want.expand(t, -1)))
                s = _time(lambda q=part: tp.all_gather_last_dim(q), spec.iters, spec.warmup, cuda)
                nbytes = got.numel() * got.element_size()
                alg = nbytes / s / 1e9
                results.append(SizeResult("all_gather", t, (t, shard), nbytes, exact, s * 1e6, alg,
                                          alg * (n - 1) / n))
        finally:
            destroy_tp(tp)
        out.put((rank, results, None))
    except BaseException:  # every failure reaches the parent, which reports it and exits 2
        out.put((rank, None, traceback.format_exc()))


def run_check(spec: CheckSpec, timeout_s: float = 600.0) -> tuple[list[SizeResult], list[str], dict[int, bool]]:
    """Spawn ``spec.world`` ranks; returns rank 0's results, the errors (rank failures, timeouts) and each
    rank's verdict (True: every size exact on that rank)."""
    from ddtree_serve.model_executor.parallel_state import free_local_addr

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    addr = free_local_addr()
    procs = [ctx.Process(target=_rank_main, args=(r, spec, addr, queue), daemon=True) for r in range(spec.world)]
    for p in procs:
        p.start()
    results: list[SizeResult] = []
    errors: list[str] = []
    verdicts: dict[int, bool] = {}
    deadline = time.monotonic() + timeout_s
    while len(verdicts) + len(errors) < spec.world and time.monotonic() < deadline:
        try:
            rank, res, err = queue.get(timeout=1.0)
        except queue_mod.Empty:  # a rank that died without a word is caught here
            if any(p.exitcode not in (None, 0) for p in procs):
                dead = [f"rank {r} exited with status {p.exitcode}" for r, p in enumerate(procs)
                        if p.exitcode not in (None, 0)]
                errors.extend(dead)
                break
            continue
        if err is not None:
            errors.append(f"rank {rank}: {err}")
        else:
            verdicts[rank] = all(r.exact for r in res)
            if rank == 0:
                results = res
    if len(verdicts) + len(errors) < spec.world and not errors:
        errors.append(f"timed out after {timeout_s:.0f} s waiting for the ranks")
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
    return results, errors, verdicts


def _model_dims(path: str) -> tuple[int, int, str]:
    """(hidden, vocab, dtype) of a checkpoint's config.json (a multimodal wrapper's ``text_config``)."""
    cfg = json.loads((Path(path) / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
    return int(cfg["hidden_size"]), int(cfg["vocab_size"]), dtype if dtype in _DTYPES else "bfloat16"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"),
                    help="auto: cuda (NCCL) when available, else cpu (gloo)")
    ap.add_argument("--world-size", type=int, default=None,
                    help="ranks (default: every local GPU on cuda, 2 on cpu)")
    ap.add_argument("--model-path", default=None, help="read hidden / vocab / dtype from this checkpoint")
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--vocab", type=int, default=163840)
    ap.add_argument("--dtype", default="bfloat16", choices=tuple(_DTYPES))
    ap.add_argument("--tokens", default=DEFAULT_TOKENS, help="token counts (rows) per collective")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--out", default="bench_out/allreduce.json")
    args = ap.parse_args(argv)
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        print("NOT RUN: --device cuda but CUDA is not available")
        return 2
    world = args.world_size or (torch.cuda.device_count() if device == "cuda" else 2)
    if world < 2:
        print(f"NOT RUN: the TP all-reduce check needs >= 2 ranks ({device}: {world}); one GPU has no "
              "collective to check")
        return 3
    if device == "cuda" and world > torch.cuda.device_count():
        print(f"NOT RUN: --world-size {world} > {torch.cuda.device_count()} local GPUs")
        return 3
    hidden, vocab, dtype = (_model_dims(args.model_path) if args.model_path else
                            (args.hidden, args.vocab, args.dtype))
    tokens = tuple(int(t) for t in args.tokens.split(",") if t.strip())
    spec = CheckSpec(world, device, hidden, vocab, dtype, tokens, args.iters, args.warmup)
    backend = "nccl" if device == "cuda" else "gloo"
    print(f"TP collectives over {world} ranks ({backend}, {device}): hidden {hidden}, vocab {vocab}, {dtype}; "
          f"NCCL settings: {' '.join(f'{k}={v}' for k, v in os.environ.items() if k.startswith('NCCL_')) or 'none'}")
    results, errors, verdicts = run_check(spec, args.timeout)
    for r in results:
        print(f"{r.op:10} tokens {r.tokens:6}  {r.bytes / 2**20:9.2f} MiB  {r.mean_us:10.1f} us  "
              f"algbw {r.algbw_gbps:8.2f} GB/s  busbw {r.busbw_gbps:8.2f} GB/s  {'exact' if r.exact else 'WRONG'}")
    wrong = sorted(rank for rank, ok in verdicts.items() if not ok)
    for e in errors:
        print(f"ERROR: {e}")
    if wrong:
        print(f"FAIL: wrong all-reduce / all-gather results on rank(s) {wrong}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"spec": asdict(spec), "backend": backend,
                                          "results": [asdict(r) for r in results], "errors": errors,
                                          "wrong_ranks": wrong}, indent=1))
    if errors:
        return 2
    if wrong:
        return 1
    print("TP collectives exact on every rank")
    return 0


if __name__ == "__main__":
    sys.exit(main())
