"""Per-call time of the kernels (PyTorch reference on CPU; sgl-kernel/flashinfer where dispatch picks them on
CUDA) over batch x tree nodes x vocab, against one forward of the default target (SmolLM2-135M) over the
same number of tokens (bs * (nodes + 1)).

Prints a table and writes JSON (``--out``, default bench_out/kernels.json). No timing asserts.
Configurations whose ``[bs * D, V]`` probability tensors exceed ``--max-elems`` are skipped (memory);
the forward column is skipped with a message when the default model is unavailable.

    python benchmarks/bench_kernels.py [--quick] [--device cpu|cuda] [--no-model-fetch]
    python benchmarks/bench_kernels.py --device cuda --mla-dcp [--mla-context 131072]

    python benchmarks/bench_kernels.py --sampler [--device cuda] [--sampler-rows 8]

``--sampler``: instead, the sampling kernel's passes per row (radix select against the bisection it replaced)
and on CUDA its rows/s, at V = 163,840 per filter combination (benchmarks/bench_sampler.py).
``--mla-dcp``: instead, the DCP Triton MLA decode (ddtree_serve/kernels/triton_mla_dcp.py) of one rank at batch 1 and
long context, split-K (the planner's split count) against the single pass; CUDA only (skipped with a
reason elsewhere: the interpreter at 128k keys would take hours).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from ddtree_serve.kernels.sampling import (  # noqa: E402
    min_p_renorm_prob,
    sampling_from_probs,
    top_k_renorm_prob,
    top_p_renorm_prob,
)
from ddtree_serve.kernels.speculative import tree_speculative_sampling_target_only, verify_tree_greedy  # noqa: E402

FULL = dict(bs=(1, 8, 32), nodes=(8, 32, 128), vocab=(49152, 163840))
QUICK = dict(bs=(1, 8), nodes=(8, 32), vocab=(49152,))
OPS = ("build_probs", "greedy", "sampling", "top_k", "top_p", "min_p", "sample")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(
    fn, device: torch.device, setup=None, min_time: float = 0.3, max_reps: int = 20, warmup: int = 1
) -> float:
    """Median milliseconds per call of ``fn`` (after ``warmup`` calls), ``setup`` run untimed before each."""
    times: list[float] = []
    for i in range(max_reps + warmup):
        if setup is not None:
            setup()
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
            if sum(times) >= min_time and len(times) >= 2:
                break
    return 1000 * sorted(times)[len(times) // 2]


def build_tree(nodes: int, vocab: int, seed: int) -> tuple[list[int], list[int], int]:
    """A DDTree-like tree: mostly deep first children plus siblings. Returns parents, tokens, max depth."""
    rng = random.Random(seed)
    parents, tokens, depth, kids = [-1], [rng.randrange(vocab)], [0], {0: 0}
    for i in range(1, nodes + 1):
        p = i - 1 if rng.random() < 0.5 else rng.randrange(i)
        parents.append(p)
        tokens.append((tokens[p] * 31 + 7 * kids[p] + 1) % vocab)  # distinct among siblings
        kids[p] += 1
        kids[i] = 0
        depth.append(depth[p] + 1)
    return parents, tokens, max(depth)


def tree_tensors(parents, tokens, bs: int, device: torch.device) -> dict:
    d = len(parents)
    nt, ns, last = [-1] * d, [-1] * d, {}
    for i in range(1, d):
        p = parents[i]
        if p in last:
            ns[last[p]] = i
        else:
            nt[p] = i
        last[p] = i
    row = lambda x: torch.tensor(x, device=device).expand(bs, d).contiguous()  # noqa: E731
    return dict(
        candidates=row(tokens),
        retrive_index=torch.arange(bs * d, device=device).view(bs, d),
        retrive_next_token=row(nt),
        retrive_next_sibling=row(ns),
    )


def make_logits(
    parents, tokens, bs: int, vocab: int, device: torch.device, g: torch.Generator
) -> torch.Tensor:
    """LM-like peaked logits [bs, D, V] that mostly agree with the tree's first children."""
    d = len(parents)
    logits = torch.randn(bs, d, vocab, device=device, generator=g) * 2  # [bs, D, V]
    hot = torch.randint(0, vocab, (bs, d, 16), device=device, generator=g)  # [bs, D, 16]
    logits.scatter_add_(2, hot, torch.full(hot.shape, 14.0, device=device))
    first = {}
    for c in range(1, d):
        first.setdefault(parents[c], c)
    for p, c in first.items():
        logits[:, p, tokens[c]] += 24.0  # dominates the hot tokens (14 + noise)
    return logits


def bench_config(bs: int, nodes: int, vocab: int, device: torch.device) -> dict:
    g = torch.Generator(device=device).manual_seed(bs * 1000 + nodes)
    parents, tokens, max_depth = build_tree(nodes, vocab, seed=nodes)
    d, s = nodes + 1, max_depth + 1
    tree = tree_tensors(parents, tokens, bs, device)
    holder = {"logits": make_logits(parents, tokens, bs, vocab, device, g)}  # big tensors, freed early
    out = dict(
        predicts=torch.empty(bs * d, dtype=torch.int32, device=device),
        accept_index=torch.empty(bs, s, dtype=torch.int32, device=device),
        accept_token_num=torch.empty(bs, dtype=torch.int32, device=device),
    )
    res: dict[str, float] = {}
    res["build_probs"] = timed(
        lambda: holder.__setitem__("p", torch.softmax(holder["logits"] / 0.8, -1)), device
    )
    probs = holder.pop("p")  # [bs, D, V]
    holder.pop("logits")
    target_predict = probs.argmax(-1)  # [bs, D]
    res["greedy"] = timed(lambda: verify_tree_greedy(**out, **tree, target_predict=target_predict), device)
    greedy_accepted = out["accept_token_num"].float().mean().item()
    holder["draft"] = torch.zeros_like(probs)  # [bs, D, V]
    coins = torch.rand(bs, d, device=device, generator=g)
    final = torch.rand(bs, device=device, generator=g)

    def sampling() -> None:
        tree_speculative_sampling_target_only(
            **out,
            **tree,
            uniform_samples=coins,
            uniform_samples_for_final_sampling=final,
            target_probs=probs,
            draft_probs=holder["draft"],
        )

    res["sampling"] = timed(sampling, device, setup=holder["draft"].zero_)
    sampled_accepted = out["accept_token_num"].float().mean().item()
    holder.pop("draft")
    flat = probs.view(bs * d, vocab)  # [bs*D, V]
    res["top_k"] = timed(lambda: top_k_renorm_prob(flat, 50), device)
    res["top_p"] = timed(lambda: top_p_renorm_prob(flat, 0.9), device)
    res["min_p"] = timed(lambda: min_p_renorm_prob(flat, 0.05), device)
    u = torch.rand(bs * d, device=device, generator=g)
    res["sample"] = timed(lambda: sampling_from_probs(flat, u), device)
    return dict(
        bs=bs,
        nodes=nodes,
        D=d,
        S=s,
        vocab=vocab,
        ms=res,
        mean_accepted=dict(greedy=greedy_accepted, sampling=sampled_accepted),
    )


def load_forward(device: torch.device, allow_fetch: bool):
    """A callable ``forward(n_requests, tokens_each) -> ms`` on the default model, or None with a reason."""
    try:
        from ddtree_serve.model_executor import default_model
    except ImportError as e:
        return None, f"ddtree_serve.model_executor.default_model not importable ({e})"
    if not hasattr(default_model, "ensure_default_model"):
        return None, "ddtree_serve.model_executor.default_model.ensure_default_model does not exist yet"
    if allow_fetch:
        path = default_model.ensure_default_model()
    else:
        path = str(default_model.default_model_dir())
        if not (Path(path) / "config.json").exists():
            return None, f"default model not present at {path} and fetching is disabled"
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(path, torch_dtype=torch.float32).to(device).eval()
    vocab = model.config.vocab_size

    with torch.inference_mode():  # warm the model up once on a small input
        model(input_ids=torch.zeros(1, 8, dtype=torch.long, device=device))

    def forward(bs: int, d: int) -> float:
        ids = torch.randint(0, vocab, (bs, d), device=device)
        with torch.inference_mode():
            return timed(lambda: model(input_ids=ids), device, min_time=1.0, max_reps=3, warmup=0)

    return forward, path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small subset of the grid")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--out", default="bench_out/kernels.json")
    ap.add_argument(
        "--max-elems",
        type=float,
        default=None,
        help="skip configs with bs*D*V above this (default 1e8 on cpu, 1.5e9 on cuda)",
    )
    ap.add_argument("--no-model-fetch", action="store_true", help="never download the default model")
    ap.add_argument("--no-forward", action="store_true", help="skip the model forward column")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--mla-dcp", action="store_true", help="DCP MLA decode: split-K vs single pass (CUDA)")
    ap.add_argument("--mla-context", type=int, default=131_072, help="keys per request for --mla-dcp")
    ap.add_argument("--sampler", action="store_true", help="sampling kernel: passes per row and rows/s")
    ap.add_argument("--sampler-rows", type=int, default=4, help="rows per configuration for --sampler")
    args = ap.parse_args()
    if args.sampler:
        from benchmarks.bench_sampler import bench_sampler

        rows = bench_sampler(torch.device(args.device), args.sampler_rows)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(dict(meta=dict(device=args.device), sampler=rows), indent=1))
        print(f"wrote {args.out}")
        return
    if args.mla_dcp:
        bench_mla_dcp_decode(torch.device(args.device), args.mla_context)
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but CUDA is not available")
    max_elems = args.max_elems or (1e8 if device.type == "cpu" else 1.5e9)
    grid = QUICK if args.quick else FULL
    torch.manual_seed(0)
    forward, info = (
        (None, "disabled by --no-forward")
        if args.no_forward
        else load_forward(device, allow_fetch=not args.no_model_fetch)
    )
    print(f"forward baseline: {'SmolLM2-135M at ' + info if forward else 'skipped: ' + info}", flush=True)
    rows, fwd_cache = [], {}
    for vocab in grid["vocab"]:
        for bs in grid["bs"]:
            for nodes in grid["nodes"]:
                if bs * (nodes + 1) * vocab > max_elems:
                    print(f"skip bs={bs} nodes={nodes} V={vocab}: bs*D*V > --max-elems {max_elems:.0e}")
                    rows.append(dict(bs=bs, nodes=nodes, vocab=vocab, skipped="max_elems"))
                    continue
                row = bench_config(bs, nodes, vocab, device)
                if forward is not None:
                    if (bs, nodes) not in fwd_cache:
                        fwd_cache[(bs, nodes)] = forward(bs, nodes + 1)
                    row["forward_ms"] = fwd_cache[(bs, nodes)]
                    row["ratio_to_forward"] = {k: v / row["forward_ms"] for k, v in row["ms"].items()}
                rows.append(row)
                print_row(row, header=len([r for r in rows if "ms" in r]) == 1)
    meta = dict(
        device=str(device),
        torch=torch.__version__,
        threads=torch.get_num_threads(),
        forward=info if forward else None,
        max_elems=max_elems,
        dispatch=_dispatch_info(device),
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    print(f"wrote {args.out}")


def bench_mla_dcp_decode(device: torch.device, context: int, dcp: int = 8, heads: int = 64) -> dict | None:
    """DCP decode of one rank (rank 0 of ``dcp``) at batch 1 over ``context`` keys placed on the rank of
    their position, Kimi K2.6 shapes (``heads`` gathered heads, latent 512 + rope 64, bfloat16): ms per call
    of the single pass and of split-K at ``choose_dcp_kv_splits``' count. None (printed reason) off CUDA."""
    if device.type != "cuda":
        print("skip DCP decode split-K vs single pass: needs CUDA (the Triton interpreter at long context is hours)")
        return None
    from ddtree_serve.kernels.triton_mla_dcp import MLA_DCP_KERNELS
    from ddtree_serve.kernels.triton_mla_plan import choose_dcp_kv_splits, device_sm_count

    lat, rope = 512, 64
    g = torch.Generator(device=device).manual_seed(0)
    kv_indices = (torch.arange(context, device=device) + dcp)[None]  # [1, K] global slot of position j on rank j % N
    cache = torch.randn(context // dcp + 2, 1, lat + rope, generator=g, device=device).bfloat16()  # rank 0's shard
    q = torch.randn(1, heads, lat + rope, generator=g, device=device).bfloat16()  # [1, H, W]
    one = torch.ones(1, dtype=torch.int64, device=device)
    mask = torch.ones((), dtype=torch.bool, device=device).expand(1, 1, 1)  # [bs, Q, 1] placeholder
    args = (q, cache, kv_indices, mask, torch.zeros(1, dtype=torch.int64, device=device), one * (context - 1), one,
            lat, 0.04)
    splits = choose_dcp_kv_splits(1, context, device_sm_count("cuda", device.index), dcp)
    row = dict(context=context, dcp=dcp, heads=heads, splits=splits)
    for name, n in (("single_ms", 1), ("split_ms", splits)):
        row[name] = timed(lambda n=n: MLA_DCP_KERNELS["decode"](*args, dcp_size=dcp, dcp_rank=0, num_splits=n),
                          device, min_time=0.5)
    print(f"DCP {dcp} decode, batch 1, {context} keys, {heads} heads: single pass {row['single_ms']:.3f} ms, "
          f"split-K x{splits} {row['split_ms']:.3f} ms ({row['single_ms'] / row['split_ms']:.1f}x)", flush=True)
    return row


def _dispatch_info(device: torch.device) -> dict:
    from ddtree_serve.kernels.dispatch import FLASHINFER, SGL_KERNEL, use_cuda_kernels

    t = torch.zeros(1, device=device)
    return {lib: use_cuda_kernels(t, library=lib) for lib in (SGL_KERNEL, FLASHINFER + ".sampling")}


def print_row(row: dict, header: bool) -> None:
    if header:
        cols = " ".join(f"{c:>11}" for c in OPS)
        print(
            f"{'bs':>3} {'nodes':>5} {'V':>6} | {cols} | {'forward':>9} {'samp/fwd':>8} {'all/fwd':>8}  (ms)"
        )
    ms = row["ms"]
    cells = " ".join(f"{ms[c]:11.3f}" for c in OPS)
    fwd = row.get("forward_ms")
    sampled_path = ms["build_probs"] + ms["top_k"] + ms["top_p"] + ms["sampling"]
    tail = (
        f"{fwd:9.1f} {ms['sampling'] / fwd:8.3f} {sampled_path / fwd:8.3f}"
        if fwd
        else f"{'-':>9} {'-':>8} {'-':>8}"
    )
    print(f"{row['bs']:>3} {row['nodes']:>5} {row['vocab']:>6} | {cells} | {tail}", flush=True)


if __name__ == "__main__":
    main()
