"""GPU check speed parts, each against a stated baseline: tokens/s of plain and DDTree decoding on the
Kimi-shaped checkpoint (baseline: plain eager decoding), the sampling kernel's rows/s (baseline: the bisection
kernel it replaced) and MLA decode at 128k keys with the DCP kernel against the split-K kernel.

Speed, per engine (plain eager, plain and ddtree with CUDA graphs; bfloat16, Triton MLA + MoE) and cell (batch
1 / 8 at context 4k, random prompts): ``generate(max_tokens=1)`` prefills (its time gives prefill tokens/s and
fills the prefix cache), then ``generate(max_tokens=1 + N)`` on the same prompts re-uses the cached prompt,
so its time is decoding: tokens/s = generated tokens / that time. FAIL when plain decoding with CUDA graphs is
slower than eager (less than ``GRAPH_MIN_RATIO`` of it) at a batch both measured. DDTree's drafts are scripted
around the plain engine's greedy tokens (tests/speculative/scripted_drafts.py ``greedy_script``: every step's
tree holds accepted and rejected nodes), so tau is the script's, not a drafter's; its ratio to plain is
reported, not judged (on this 2-layer checkpoint the drafter's share of a step is far above Kimi's 61 layers');
``same`` is the share of requests whose tokens equal plain's (bfloat16: verify and decode may round
differently, a near-tie may flip).
"""

from __future__ import annotations

import gc
import inspect
import time
from typing import Any

import torch

from benchmarks.gpu.parts import (
    NotAvailable,
    PartContext,
    checkpoint_vocab,
    compare,
    engine,
    engine_backends,
    random_prompts,
    time_ms,
)

CONTEXTS = (4096,)
BATCHES = (1, 8)
DECODE_TOKENS = 32
GRAPH_MIN_RATIO = 0.95  # plain decoding with CUDA graphs against eager: at least this share of eager's tokens/s
SAMPLER_ROWS = 64  # rows of the sampling kernel timed (a batch of 64 sampled tree nodes)
SAMPLER_MIN_RATIO = 1.0  # the radix kernel's rows/s against the bisection kernel's, with top-k and top-p on


def _cell(eng: Any, prompts: list[list[int]], n: int) -> dict[str, Any]:  # noqa: ANN401
    from ddtree_serve.model_executor.sampling_params import SamplingParams

    t0 = time.perf_counter()
    eng.generate(input_ids=prompts, sampling_params=SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    outs = eng.generate(input_ids=prompts,
                        sampling_params=SamplingParams(temperature=0, max_tokens=1 + n, ignore_eos=True))
    dt = time.perf_counter() - t0
    toks = sum(len(o.token_ids) for o in outs)
    steps = sum(o.spec_verify_steps for o in outs)
    return {"tok_s": round(toks / dt, 1), "tau": round(toks / steps, 2) if steps else None,
            "prefill_tok_s": round(sum(map(len, prompts)) / prefill), "tokens": [o.token_ids for o in outs]}


def part_speed(ctx: PartContext) -> bool:
    """Every cell of the module docstring's table, written as it is measured; FAIL when graphs lose to eager."""
    from tests.speculative.scripted_drafts import greedy_script, install

    vocab = checkpoint_vocab(ctx.checkpoint)
    cells = {(bs, c): random_prompts([c] * bs, vocab, 1000 * bs + c // 1024) for bs in BATCHES for c in CONTEXTS}
    refs: dict[tuple[int, ...], list[int]] = {}
    ctx.numbers |= {"decode_tokens": DECODE_TOKENS, "cells": {},
                    "baseline": f"plain eager decoding; FAIL when plain graphs < {GRAPH_MIN_RATIO} x eager"}
    for graphs, spec in ((0, False), (8, False), (8, True)):
        tag = f"{'ddtree' if spec else 'plain'}_{'graphs' if graphs else 'eager'}"
        if ctx.left() < 15:
            ctx.numbers["cells"][tag] = "not measured: time"
            continue
        t0 = time.perf_counter()
        eng = engine(ctx, ddtree=spec, ddtree_budget=16, cuda_graph_max_bs=graphs,
                     context_length=max(CONTEXTS) + 512, max_total_tokens=max(BATCHES) * (max(CONTEXTS) + 512),
                     chunked_prefill_size=8192, max_running_requests=max(BATCHES))
        ctx.numbers[f"{tag}_startup_s"] = round(time.perf_counter() - t0, 1)
        try:
            ctx.backend[tag] = str(engine_backends(eng))
            if spec:
                install(eng, greedy_script(refs, vocab))
            for (bs, c), prompts in cells.items():
                if ctx.left() < 8:
                    break
                r = _cell(eng, prompts, DECODE_TOKENS)
                toks = r.pop("tokens")
                if not spec and not graphs:
                    refs |= {tuple(p): t for p, t in zip(prompts, toks, strict=True)}
                r["same"] = sum(refs.get(tuple(p)) == t for p, t in zip(prompts, toks, strict=True)) / bs
                ctx.numbers["cells"][f"{tag}_bs{bs}_ctx{c}"] = r
                ctx.flush()
        finally:
            eng.shutdown()
            del eng
            gc.collect()
            torch.cuda.empty_cache()
    return _judge_speed(ctx)


def _judge_speed(ctx: PartContext) -> bool:
    """Plain graphs against plain eager at each batch both measured (and DDTree's ratio to plain, reported)."""
    cells, ok, compared = ctx.numbers["cells"], True, 0
    for bs in BATCHES:
        for c in CONTEXTS:
            eager, graphs = (cells.get(f"plain_{m}_bs{bs}_ctx{c}") for m in ("eager", "graphs"))
            tree = cells.get(f"ddtree_graphs_bs{bs}_ctx{c}")
            if isinstance(eager, dict) and isinstance(graphs, dict):
                ratio = graphs["tok_s"] / max(eager["tok_s"], 1e-9)
                ctx.numbers[f"graphs_over_eager_bs{bs}_ctx{c}"] = round(ratio, 2)
                ok &= ratio >= GRAPH_MIN_RATIO
                compared += 1
                if isinstance(tree, dict):
                    ctx.numbers[f"ddtree_over_plain_graphs_bs{bs}_ctx{c}"] = round(tree["tok_s"] / graphs["tok_s"], 2)
    if not compared:
        ctx.numbers["failure"] = "no batch measured both eager and graphs"
    elif not ok:
        ctx.numbers["failure"] = f"plain decoding with CUDA graphs below {GRAPH_MIN_RATIO} x eager"
    return ok and compared > 0


def part_speed_sampler(ctx: PartContext) -> bool:
    """The sampling kernel (ddtree_serve/kernels/triton_sampling.py, radix select) against the bisection kernel
    it replaced (triton_sampling_bisect.py) at V = 163,840 over ``SAMPLER_ROWS`` rows: rows/s and passes per row
    per filter combination (benchmarks/bench_sampler.py); FAIL when the radix kernel's rows/s with top-k and
    top-p on is below ``SAMPLER_MIN_RATIO`` x the bisection kernel's."""
    from benchmarks.bench_sampler import bench_sampler

    rows = bench_sampler(torch.device("cuda"), SAMPLER_ROWS)
    ctx.numbers |= {"baseline": f"the bisection kernel; FAIL when radix < {SAMPLER_MIN_RATIO} x its rows/s "
                                "with top-k and top-p", "configs": rows}
    ok = True
    for r in rows:
        if "top-k" in r["config"] and "top-p" in r["config"]:
            ratio = r["radix_rows_per_s"] / r["bisect_rows_per_s"]
            ctx.numbers[f"speedup {r['config']}"] = round(ratio, 2)
            ok &= ratio >= SAMPLER_MIN_RATIO
    if not ok:
        ctx.numbers["failure"] = "the radix sampling kernel is slower than the bisection kernel"
    ctx.backend["sampler"] = "triton (kernels/triton_sampling.py vs kernels/triton_sampling_bisect.py)"
    return ok


def _decode_batch(ctx_len: int, seed: int) -> tuple[Any, torch.Tensor]:  # noqa: ANN401
    """A batch-1 decode forward over ``ctx_len`` cached keys at random global slots, and the slot table."""
    from ddtree_serve.model_executor.forward_batch import ForwardMode, build_forward_batch

    g = torch.Generator(device="cuda").manual_seed(seed)
    table = torch.randperm(ctx_len + 63, device="cuda", generator=g)[: ctx_len + 1].view(1, -1) + 1
    z = torch.zeros(1, dtype=torch.long, device="cuda")
    fb = build_forward_batch(ForwardMode.DECODE, z, z, table[0, ctx_len:], table, z, torch.tensor([ctx_len]),
                             torch.tensor([1]))
    return fb, table


def part_dcp_vs_split_k(ctx: PartContext) -> bool:
    """Batch 1 decode at 131,072 keys, Kimi TP 8 shapes (8 heads, latent 512 + rope 64, bf16 cache): the
    split-K MLA kernel (auto and forced single-pass) against the reference; the DCP kernel at DCP 1 over the
    same keys (equal to the reference too); and one DCP 8 rank (64 gathered heads, its shard of every 8th
    slot), whatever launch options triton_mla_dcp.py offers (``num_splits`` when it has one)."""
    try:
        from ddtree_serve.kernels.triton_mla_dcp import MLA_DCP_KERNELS
    except ImportError as e:
        raise NotAvailable(f"ddtree_serve.kernels.triton_mla_dcp does not import: {e}") from e
    from ddtree_serve.kernels.attention import masked_paged_attention, merge_attention_partials
    from ddtree_serve.kernels.triton_mla import MLA_KERNELS

    lat, rope, heads, ctx_len, n = 512, 64, 8, 131072, 8
    fb, _ = _decode_batch(ctx_len, 0)
    g = torch.Generator(device="cuda").manual_seed(1)
    cache = torch.randn(ctx_len + 64, 1, lat + rope, device="cuda", generator=g, dtype=torch.bfloat16)
    q = torch.randn(1, heads, lat + rope, device="cuda", generator=g, dtype=torch.bfloat16)
    meta = (fb.kv_indices, fb.attn_mask, fb.q_index, fb.prefix_lens, fb.extend_lens, lat, 0.04)
    ref = masked_paged_attention(q.float(), cache.float(), cache[..., :lat].float(), fb.kv_indices, fb.attn_mask,
                                 fb.q_index, 0.04)
    dcp = MLA_DCP_KERNELS["decode"]
    has_splits = "num_splits" in inspect.signature(dcp).parameters
    ctx.numbers["dcp_kernel_has_num_splits"] = has_splits
    ok = True
    runs: dict[str, Any] = {
        "split_k_auto": lambda: MLA_KERNELS["decode"](q, cache, *meta),
        "split_k_single_pass": lambda: MLA_KERNELS["decode"](q, cache, *meta, num_splits=1),
        "dcp1_auto": lambda: dcp(q, cache, *meta, dcp_size=1, dcp_rank=0)[0],
    }
    if has_splits:
        runs["dcp1_single_pass"] = lambda: dcp(q, cache, *meta, dcp_size=1, dcp_rank=0, num_splits=1)[0]
    for name, fn in runs.items():
        c = compare(fn(), ref)
        good = c["rel_fro"] <= 2e-2
        ctx.numbers[name] = {"ms": round(time_ms(fn, 20), 4), "rel_fro": c["rel_fro"], "ok": good}
        ctx.flush()
        ok &= good
    # one DCP 8 rank: 64 heads (8 local x 8 ranks), the keys of every 8th global slot
    q64 = torch.randn(1, heads * n, lat + rope, device="cuda", generator=g, dtype=torch.bfloat16)
    shards = [cache[r::n].contiguous() for r in range(n)]
    outs = [dcp(q64, shards[r], *meta, dcp_size=n, dcp_rank=r) for r in range(n)]
    merged = merge_attention_partials(torch.stack([o for o, _ in outs]), torch.stack([s for _, s in outs]))
    ref64 = masked_paged_attention(q64.float(), cache.float(), cache[..., :lat].float(), fb.kv_indices,
                                   fb.attn_mask, fb.q_index, 0.04)
    c = compare(merged, ref64)
    ctx.numbers["dcp8_merged_vs_reference"] = {"rel_fro": c["rel_fro"], "ok": c["rel_fro"] <= 2e-2}
    ok &= c["rel_fro"] <= 2e-2
    ctx.numbers["dcp8_rank0_auto_ms"] = round(time_ms(lambda: dcp(q64, shards[0], *meta, dcp_size=n, dcp_rank=0), 10),
                                              4)
    if has_splits:
        ctx.numbers["dcp8_rank0_single_pass_ms"] = round(
            time_ms(lambda: dcp(q64, shards[0], *meta, dcp_size=n, dcp_rank=0, num_splits=1), 10), 4)
    return ok
