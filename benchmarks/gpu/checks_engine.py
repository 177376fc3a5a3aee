"""GPU check parts through the Engine on the Kimi-shaped checkpoint: DDTree is lossless and accepts (scripted
drafts, tests/speculative/scripted_drafts.py), and nothing compiles after warm-up under mixed traffic."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.gpu.parts import PartContext, checkpoint_vocab, engine, engine_backends, random_prompts


def _greedy(eng: Any, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], float, float]:  # noqa: ANN401
    """Greedy tokens (ignore_eos), tokens/s and tau (tokens per verify step; 0 without speculation)."""
    from ddtree_serve.model_executor.sampling_params import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = eng.generate(input_ids=prompts, sampling_params=sp)
    dt = time.perf_counter() - t0
    toks = sum(len(o.token_ids) for o in outs)
    steps = sum(o.spec_verify_steps for o in outs)
    return [o.token_ids for o in outs], toks / dt, (toks / steps if steps else 0.0)


def part_ddtree_lossless(ctx: PartContext) -> bool:
    """float32 (so verify and decode round alike): plain greedy tokens of 4 prompts (5 / 64 / 300 / 1200
    tokens), then DDTree (budget 8) with scripted drafts around them, eager and with CUDA graphs: the same
    tokens, depth >= 2 paths accepted, some node rejected."""
    from tests.speculative.scripted_drafts import greedy_script, install

    vocab = checkpoint_vocab(ctx.checkpoint)
    prompts = random_prompts([5, 64, 300, 1200], vocab, 7)
    n = 24
    eng = engine(ctx, dtype="float32")
    try:
        ref, tps, _ = _greedy(eng, prompts, n)
        ctx.backend["plain"] = str(engine_backends(eng))
    finally:
        eng.shutdown()
    ctx.numbers["plain_eager_tok_s"] = round(tps, 1)
    refs = {tuple(p): t for p, t in zip(prompts, ref, strict=True)}
    ok = True
    for graphs in (0, 8):
        tag = f"ddtree_{'graphs' if graphs else 'eager'}"
        eng = engine(ctx, ddtree=True, dtype="float32", cuda_graph_max_bs=graphs)
        try:
            log = install(eng, greedy_script(refs, vocab))
            got, tps, tau = _greedy(eng, prompts, n)
            ctx.backend[tag] = str(engine_backends(eng))
        finally:
            eng.shutdown()
        same = got == ref
        try:
            log.assert_accepted()
            accepted = "ok"
        except AssertionError as e:
            accepted = f"FAIL: {e}"
        ctx.numbers[tag] = {"same_tokens_as_plain": same, "tau": round(tau, 3), "tok_s": round(tps, 1),
                            "max_accepted_in_a_step": max(log.accepted, default=0), "acceptance": accepted}
        ctx.flush()
        ok &= same and accepted == "ok"
    return ok


class CompileCounter:
    """Counts Triton JIT compiles (in-memory cache misses) while installed: ``knobs.runtime.jit_cache_hook``
    (Triton >= 3.4), else ``JITFunction.cache_hook`` (older releases)."""

    def __init__(self) -> None:
        self.kernels: list[str] = []
        self._undo: Callable[[], None] | None = None

    def hook(self, *args: Any, **kw: Any) -> bool:  # noqa: ANN401
        fn = kw.get("fn")
        self.kernels.append(str(getattr(fn, "name", None) or kw.get("repr") or "?"))
        return False  # compile as usual

    def __enter__(self) -> CompileCounter:
        import triton

        knobs = getattr(triton, "knobs", None)
        if knobs is not None and hasattr(knobs.runtime, "jit_cache_hook"):
            old = knobs.runtime.jit_cache_hook
            knobs.runtime.jit_cache_hook = self.hook
            self.method = "triton.knobs.runtime.jit_cache_hook"

            def undo() -> None:
                knobs.runtime.jit_cache_hook = old
        else:
            from triton.runtime.jit import JITFunction

            old = JITFunction.cache_hook
            JITFunction.cache_hook = self.hook
            self.method = "JITFunction.cache_hook"

            def undo() -> None:
                JITFunction.cache_hook = old
        self._undo = undo
        return self

    def __exit__(self, *exc: object) -> None:
        if self._undo is not None:
            self._undo()


def _mixed_traffic(eng: Any, vocab: int) -> int:  # noqa: ANN401
    """Greedy and sampled requests of mixed lengths (a long prompt prefilled in chunks while others decode),
    batch 1, 3 and 8; returns the tokens generated."""
    from ddtree_serve.model_executor.sampling_params import SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    toks = 0
    for i, lengths in enumerate(([17], [5, 64, 333], [3000, 1, 16, 31, 129, 700, 48, 2049])):
        prompts = random_prompts(lengths, vocab, 100 + i)
        sampled = [SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=s, max_tokens=12, ignore_eos=True)
                   for s in range(len(prompts))]
        for params in (greedy, sampled if i else [greedy], [greedy if j % 2 else sampled[j] for j in
                                                             range(len(prompts))]):
            outs = eng.generate(input_ids=prompts, sampling_params=params)
            toks += sum(len(o.token_ids) for o in outs)
    return toks


def part_triton_compiles(ctx: PartContext) -> bool:
    """bf16, Triton MLA / MoE, CUDA graphs up to batch 8; a plain and a ddtree engine (budget 8): after each
    one's start-up warm-up, mixed traffic must compile no Triton kernel and capture no CUDA graph."""
    vocab = checkpoint_vocab(ctx.checkpoint)
    ok = True
    for tag, spec in (("plain", False), ("ddtree", True)):
        t0 = time.perf_counter()
        eng = engine(ctx, ddtree=spec, cuda_graph_max_bs=8)
        startup = time.perf_counter() - t0
        try:
            graphs = eng.scheduler.runner.graphs
            captures0 = int(getattr(graphs, "captures", 0)) if graphs is not None else 0
            with CompileCounter() as counter:
                t0 = time.perf_counter()
                toks = _mixed_traffic(eng, vocab)
                torch.cuda.synchronize()
                dt = time.perf_counter() - t0
            captures = (int(getattr(graphs, "captures", 0)) if graphs is not None else 0) - captures0
            ctx.backend[tag] = str(engine_backends(eng))
        finally:
            eng.shutdown()
        ctx.numbers[tag] = {"startup_s": round(startup, 1), "traffic_s": round(dt, 1), "tokens": toks,
                            "triton_compiles_after_warmup": len(counter.kernels),
                            "compiled": sorted(set(counter.kernels))[:20], "graph_captures_after_warmup": captures,
                            "graphs_frozen": bool(getattr(graphs, "frozen", False)), "counted_by": counter.method}
        ctx.flush()
        ok &= not counter.kernels and captures == 0
    return ok
