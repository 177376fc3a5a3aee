"""GPU check parts on the model runner: write the Kimi-shaped checkpoint; its logits with the Triton MLA / MoE
kernels against the torch reference; eager against CUDA graphs (bitwise); a bf16 against an fp8 KV cache.

Tolerances (bfloat16 weights and activations, random weights, logits of std ~3): Triton vs torch relative
Frobenius error <= 0.1 and the same argmax on >= 90% of rows (different summation orders and rounding
points: the reference prefills with the non-absorbed attention; a row whose top two logits are closer than
the error may flip; on CPU at tiny sizes the interpreter gave 0.05 / 98% for prefill, 0.01 / 100% for decode
and verify); fp8 vs bf16 KV <= 0.2 and >= 80% (an e4m3 latent carries 3 mantissa bits; 0.09 / 94% there).
CUDA graphs must equal bitwise the padded static batch run eagerly, and keep every argmax of the plain eager
forward.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.gpu.parts import NotAvailable, PartContext, compare, random_prompts, runner

LOGIT_TOL = (0.10, 0.90)  # (relative Frobenius error, argmax agreement): Triton vs the torch reference
FP8_TOL = (0.20, 0.80)  # the same, fp8 KV vs bf16 KV


def part_checkpoint(ctx: PartContext) -> bool:
    """Write the TP 8-rank-shaped Kimi checkpoint and its drafter into the work directory (reused when one
    of the same shape is already there)."""
    from dataclasses import asdict

    from benchmarks.gpu.kimi_checkpoint import KimiShape, write_drafter, write_kimi_checkpoint

    if not torch.cuda.is_available():
        raise NotAvailable("CUDA not available")
    shape = KimiShape.tp8()
    done = Path(ctx.checkpoint) / "done.json"
    if done.exists() and json.loads(done.read_text()).get("shape") == asdict(shape) \
            and (Path(ctx.drafter) / "config.json").exists():
        ctx.numbers |= json.loads(done.read_text()) | {"reused": True}
        return True
    t0 = time.perf_counter()
    facts = write_kimi_checkpoint(ctx.checkpoint, shape, "cuda")
    ctx.numbers |= facts | {"write_s": round(time.perf_counter() - t0, 1)}
    ctx.flush()
    t0 = time.perf_counter()
    write_drafter(ctx.checkpoint, ctx.drafter)
    ctx.numbers["drafter_s"] = round(time.perf_counter() - t0, 1)
    done.write_text(json.dumps(facts))
    return True


def _prefill(r: Any, prompts: list[list[int]], rows: list[int]) -> torch.Tensor:  # noqa: ANN401
    """Prefill ``prompts`` into ``rows`` in one EXTEND forward; [tokens, vocab] float32 logits."""
    ids = [t for p in prompts for t in p]
    fb = r.prepare_prefill(rows, [0] * len(rows), [len(p) for p in prompts], ids)
    return r.logits(r.forward(fb).hidden).float()


def _step(r: Any, mode: Any, q: int, rows: list[int], lens: list[int], seed: int) -> Any:  # noqa: ANN401
    """A decode (q 1) or tree-verify (q nodes, a random tree) forward batch of ``rows`` on fresh slots."""
    from ddtree_serve.model_executor.forward_batch import ForwardMode, build_forward_batch

    g = torch.Generator().manual_seed(seed)
    dev = r.device
    bs = len(rows)
    idx, pre = torch.tensor(rows, device=dev), torch.tensor(lens, device=dev)
    slots = r.slots.place_block(idx, pre, q)  # [bs, q]
    tree = None
    if mode == ForwardMode.TARGET_VERIFY:
        parent = [0] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, q)]  # node i's parent < i
        t = torch.eye(q, dtype=torch.bool)
        for i in range(1, q):
            t[i] |= t[parent[i]]
        tree = t.expand(bs, q, q).contiguous().to(dev)
    ids = torch.randint(1, r.config.vocab_size - 2, (bs * q,), generator=g).to(dev)
    pos = (pre[:, None] + torch.arange(q, device=dev)).reshape(-1)
    return build_forward_batch(mode, ids, pos, slots.reshape(-1), r.slots.table, idx, pre, torch.full((bs,), q),
                               tree_mask=tree, dense_mask=r.dense_mask)


def _backends(r: Any) -> str:  # noqa: ANN401 - a ModelRunner
    """The MLA attention, MoE and expert-format backends a runner's model runs."""
    c = r.config
    return f"MLA attention {c.attention_backend}, MoE {c.moe_backend}, INT4 experts {c.int4_experts}"


def _within(c: dict[str, float], tol: tuple[float, float]) -> bool:
    return c["rel_fro"] <= tol[0] and c["top1_agree"] >= tol[1]


def part_model_logits(ctx: PartContext) -> bool:
    """Prefill (3 requests, 37 / 256 / 1000 tokens), a decode step and a 9-node tree verify, with the torch
    reference backends and with Triton MLA + Triton MoE (INT4 resident) on the same weights."""
    from ddtree_serve.model_executor.forward_batch import ForwardMode

    runners = {"torch": runner(ctx, attention="torch", moe="torch"),
               "triton": runner(ctx, attention="triton", moe="triton")}
    ctx.backend = {k: _backends(r) for k, r in runners.items()}
    lens = [37, 256, 1000]
    prompts = random_prompts(lens, runners["torch"].config.vocab_size, 1)
    logits: dict[str, list[torch.Tensor]] = {}
    for name, r in runners.items():
        with torch.inference_mode():
            outs = [_prefill(r, prompts, [0, 1, 2])]
            for mode, q, seed in ((ForwardMode.DECODE, 1, 2), (ForwardMode.TARGET_VERIFY, 9, 3)):
                fb = _step(r, mode, q, [0, 1, 2], lens, seed)
                outs.append(r.logits(r.forward(fb).hidden).float())
        logits[name] = outs
    ok = True
    for what, got, want in zip(("prefill", "decode", "verify"), logits["triton"], logits["torch"], strict=True):
        c = compare(got, want)
        ctx.numbers[what] = c
        ok &= _within(c, LOGIT_TOL)
    ctx.numbers["tolerance"] = {"rel_fro_max": LOGIT_TOL[0], "top1_min": LOGIT_TOL[1]}
    return ok


def _pool(r: Any) -> list[torch.Tensor]:  # noqa: ANN401
    return [k.clone() for k in r.kv.k]


def _restore(r: Any, pool: list[torch.Tensor]) -> None:  # noqa: ANN401
    for k, saved in zip(r.kv.k, pool, strict=True):
        k.copy_(saved)


def _outside(n: int, slots: torch.Tensor) -> torch.Tensor:
    keep = torch.ones(n, dtype=torch.bool, device=slots.device)
    keep[slots] = False
    keep[0] = False  # the padding slot
    return keep


def _graph_vs_eager(r: Any, static: Any, fb: Any) -> dict[str, Any]:  # noqa: ANN401
    """``fb`` from the same pool three ways: the plain eager forward, the padded static batch run eagerly
    (``static``: a CudaGraphRunner with ``capture=False``, the graph's exact shapes) and the CUDA graph;
    logits and the KV written compared."""
    base = _pool(r)
    with torch.inference_mode():
        plain = r.model(fb, r.kv, r.backend).hidden
        _restore(r, base)
        want = static.forward(fb).hidden
        eager_kv = _pool(r)
        _restore(r, base)
        for _ in range(2):  # the first call captures when the size is new, the second replays
            got = r.graphs.forward(fb).hidden
        graph_kv = _pool(r)
        c = compare(r.logits(got).float(), r.logits(want).float())
        vs_plain = compare(r.logits(got).float(), r.logits(plain).float())
    own = fb.out_cache_loc
    c["hidden_bitwise"] = bool(torch.equal(got, want))
    c["kv_bitwise"] = all(torch.equal(g[own], e[own]) for g, e in zip(graph_kv, eager_kv, strict=True))
    c["kv_elsewhere_untouched"] = all(torch.equal(g[_outside(g.shape[0], own)], b[_outside(b.shape[0], own)])
                                      for g, b in zip(graph_kv, base, strict=True))
    c["vs_plain_eager"] = vs_plain
    return c


def part_cuda_graphs(ctx: PartContext) -> bool:
    """Triton backends, graphs up to batch 8: decode and a 9-node verify at batch 4 (a captured size), 3
    requests padded into the size-4 graph, then batch 2 captured while the pool holds live KV. Each must
    equal the same padded static batch run eagerly bitwise (hidden states and KV) and write nothing outside
    its own slots and the padding slot; against the plain (unpadded, narrower key table) eager forward, whose
    kernels may split the keys differently, the logits must agree within 2% with every argmax kept
    (``vs_plain_eager`` also says whether they are bitwise equal)."""
    from ddtree_serve.model_executor.cuda_graph_runner import CudaGraphRunner
    from ddtree_serve.model_executor.forward_batch import ForwardMode

    r = runner(ctx, graphs=8, max_context=2048)
    static = CudaGraphRunner(r.model, r.kv, r.backend, r.graph_batch_sizes, r.max_context, r.device, capture=False)
    ctx.backend = {"model": _backends(r)}
    lens = [300, 17, 64, 1000, 5, 129]
    with torch.inference_mode():
        _prefill(r, random_prompts(lens, r.config.vocab_size, 4), list(range(len(lens))))
    ok = True
    for mode, q in ((ForwardMode.DECODE, 1), (ForwardMode.TARGET_VERIFY, 9)):
        cases = (("exact_bs4", [0, 1, 2, 3]), ("padded_bs3", [0, 1, 2]), ("new_bs2_live_kv", [4, 5]))
        for i, (case, rows) in enumerate(cases):
            fb = _step(r, mode, q, rows, [lens[b] for b in rows], 10 * i + q)
            if case == "new_bs2_live_kv":  # the earlier steps' slots hold KV other requests may own: make it live
                g = torch.Generator(device="cuda").manual_seed(i)
                for k in r.kv.k:
                    k[1:].copy_(torch.randn(k[1:].shape, generator=g, device="cuda").to(k.dtype))
            c = _graph_vs_eager(r, static, fb)
            ctx.numbers[f"{mode.value}_{case}"] = c
            ctx.flush()
            vp = c["vs_plain_eager"]
            ok &= c["hidden_bitwise"] and c["kv_bitwise"] and c["kv_elsewhere_untouched"] \
                and vp["rel_fro"] <= 0.02 and vp["top1_agree"] == 1.0
    ctx.numbers["captures"] = int(getattr(r.graphs, "captures", -1))
    return ok


def part_fp8_kv(ctx: PartContext) -> bool:
    """Triton backends with a bf16 and with an fp8_e4m3 latent cache: prefill 4 requests (512 / 100 / 2000
    / 33 tokens), then 8 decode steps fed the bf16 run's greedy tokens; logits compared per step."""
    from ddtree_serve.kernels.kv_quant import FP8_KV_DTYPE

    runners = {"bf16": runner(ctx, kv="auto"), "fp8": runner(ctx, kv="fp8_e4m3")}
    if runners["fp8"].kv.k[0].dtype != FP8_KV_DTYPE:
        ctx.numbers["failure"] = f"the fp8 cache is {runners['fp8'].kv.k[0].dtype}"
        return False
    ctx.backend = {"model": _backends(runners["fp8"]), "kv_dtype": str(FP8_KV_DTYPE)}
    lens = [512, 100, 2000, 33]
    rows = list(range(len(lens)))
    prompts = random_prompts(lens, runners["bf16"].config.vocab_size, 5)
    steps: dict[str, list[torch.Tensor]] = {"bf16": [], "fp8": []}
    with torch.inference_mode():
        for name, r in runners.items():
            steps[name].append(_prefill(r, prompts, rows))
        ends = torch.tensor(lens).cumsum(0) - 1
        nxt = steps["bf16"][0][ends].argmax(-1).tolist()
        for s in range(8):
            for name, r in runners.items():
                fb = r.prepare_decode(rows, [n + s for n in lens], nxt)
                steps[name].append(r.logits(r.forward(fb).hidden).float())
            nxt = steps["bf16"][-1].argmax(-1).tolist()
    pre = compare(steps["fp8"][0], steps["bf16"][0])
    dec = compare(torch.cat(steps["fp8"][1:]), torch.cat(steps["bf16"][1:]))
    ctx.numbers |= {"prefill": pre, "decode": dec,
                    "tolerance": {"rel_fro_max": FP8_TOL[0], "top1_min": FP8_TOL[1]}}
    return _within(pre, FP8_TOL) and _within(dec, FP8_TOL)
