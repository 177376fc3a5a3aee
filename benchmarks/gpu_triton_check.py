"""GPU check (one device, nothing fetched, < 3 minutes): the Triton kernels (ddtree_serve/kernels/triton_moe.py,
ddtree_serve/kernels/triton_mla.py, the split-K ddtree_serve/kernels/triton_mla_split.py at batch 1 and 32k context) against the torch
reference on CUDA at Kimi K2.6 per-rank shapes (TP 8), with their times, the same kernels over an fp8 KV cache
(``--kv-cache-dtype fp8_e4m3``) against the reference over the dequantized cache, then the tiny Kimi INT4 model through the Engine with each backend: greedy tokens must agree between
backends (and DDTree must equal plain greedy; fp8 KV runs compare with the fp8 torch/torch run); prints
tokens/s of each.

    python benchmarks/gpu_triton_check.py [--out bench_out/gpu_triton.json] [--experts 64]

Exits 2 (skipped) without CUDA, 1 when a check fails. ``--device cpu --tiny`` runs the same script at tiny
shapes under Triton's interpreter (``TRITON_INTERPRET=1``; a smoke test of the script itself, times meaningless). Tolerances (bfloat16): MoE and MLA outputs within
atol 3e-2 / rtol 3e-2 of the reference (different summation order and rounding points).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_ms(fn, reps: int = 5) -> float:
    """Mean milliseconds of ``fn`` over ``reps`` calls after one warm-up call (device synchronised)."""
    fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    sync()
    return (time.perf_counter() - t0) / reps * 1e3


def _close(a: torch.Tensor, b: torch.Tensor) -> tuple[bool, float]:
    err = float((a.float() - b.float()).abs().max())
    return bool(torch.allclose(a.float(), b.float(), atol=3e-2, rtol=3e-2)), err


def check_moe(experts: int, results: dict, dev: str, tiny: bool) -> bool:
    """Kimi K2.6 at TP 8: hidden 7168, each expert's intermediate 2048 / 8 = 256, top-8, INT4 group 32."""
    from ddtree_serve.model_executor.layers.moe_experts import FusedExperts
    from ddtree_serve.model_executor.layers.moe_int4 import Int4Experts
    from ddtree_serve.model_executor.parallel_state import TPGroup
    from ddtree_serve.model_executor.quantization.int4_pack import pack_quantized

    hidden, inter, top_k = (96, 64, 2) if tiny else (7168, 256, 8)
    g = torch.Generator(device=dev).manual_seed(0)
    ok = True
    for int4 in (False, True):
        mods = {}
        for backend in ("torch", "triton"):
            m = (
                Int4Experts(experts, hidden, inter, TPGroup(), torch.bfloat16, 32, backend)
                if int4
                else FusedExperts(experts, hidden, inter, TPGroup(), torch.bfloat16, backend)
            ).to(dev)
            mods[backend] = m
        with torch.no_grad():
            w13 = (
                torch.randn(experts, 2 * inter, hidden, device=dev, generator=g, dtype=torch.bfloat16) * 0.02
            )
            w2 = torch.randn(experts, hidden, inter, device=dev, generator=g, dtype=torch.bfloat16) * 0.02
            for m in mods.values():
                if int4:
                    for e in range(experts):
                        a, b = pack_quantized(w13[e], 32), pack_quantized(w2[e], 32)
                        m.w13_packed[e], m.w13_scale[e] = a["weight_packed"], a["weight_scale"]
                        m.w2_packed[e], m.w2_scale[e] = b["weight_packed"], b["weight_scale"]
                else:
                    m.w13.copy_(w13)
                    m.w2.copy_(w2)
        for t in (1, 5) if tiny else (1, 16, 128):
            x = torch.randn(t, hidden, device=dev, generator=g, dtype=torch.bfloat16)
            ids = torch.stack([torch.randperm(experts, device=dev, generator=g)[:top_k] for _ in range(t)])
            w = torch.rand(t, top_k, device=dev, generator=g)
            with torch.no_grad():
                ref, got = mods["torch"](x, w, ids), mods["triton"](x, w, ids)
                good, err = _close(got, ref)
                ms = {b: time_ms(partial(m, x, w, ids)) for b, m in mods.items()}
            name = f"moe_{'int4' if int4 else 'bf16'}_T{t}"
            results[name] = {
                "ok": good,
                "max_abs_err": err,
                "torch_ms": ms["torch"],
                "triton_ms": ms["triton"],
            }
            print(
                f"{name:<18} ok={good} err={err:.2e} torch {ms['torch']:8.2f} ms  triton {ms['triton']:8.2f} ms"
            )
            ok &= good
    return ok


def check_mla(results: dict, dev: str, tiny: bool) -> bool:
    """Kimi K2.6 MLA at TP 8: 8 local heads, kv_lora 512, rope 64; decode, extend and a 17-node verify."""
    from ddtree_serve.kernels.attention import masked_paged_attention
    from ddtree_serve.kernels.triton_mla import MLA_KERNELS
    from ddtree_serve.model_executor.forward_batch import ForwardMode, build_forward_batch

    heads, lat, rope, bs = (4, 32, 8, 2) if tiny else (8, 512, 64, 8)
    g = torch.Generator(device=dev).manual_seed(1)
    cache = torch.randn(20000, 1, lat + rope, device=dev, generator=g, dtype=torch.bfloat16)
    ok = True
    for mode, q_len in ((ForwardMode.DECODE, 1), (ForwardMode.EXTEND, 64), (ForwardMode.TARGET_VERIFY, 17)):
        prefix = torch.tensor([(10 if tiny else 1000) + 97 * b for b in range(bs)])
        total = prefix + q_len
        table = torch.randperm(19999, device=dev, generator=g)[: bs * int(total.max())].view(bs, -1) + 1
        new = torch.cat([table[b, int(prefix[b]) : int(total[b])] for b in range(bs)])
        tree = None
        if mode == ForwardMode.TARGET_VERIFY:
            tree = torch.tril(torch.ones(q_len, q_len, dtype=torch.bool, device=dev))
            tree[1:, 1:] &= (
                torch.eye(q_len - 1, dtype=torch.bool, device=dev)
                | (torch.rand(q_len - 1, q_len - 1, device=dev, generator=g) < 0.3).tril()
            )
            tree = tree.expand(bs, q_len, q_len)
        t = bs * q_len
        fb = build_forward_batch(
            mode,
            torch.zeros(t, dtype=torch.long, device=dev),
            torch.zeros(t, dtype=torch.long, device=dev),
            new,
            table,
            torch.arange(bs, device=dev),
            prefix,
            torch.full((bs,), q_len),
            tree_mask=tree,
        )
        q = torch.randn(t, heads, lat + rope, device=dev, generator=g, dtype=torch.bfloat16)
        args = (q, cache, fb.kv_indices, fb.attn_mask, fb.q_index, fb.prefix_lens, fb.extend_lens, lat, 0.1)
        ref = masked_paged_attention(q, cache, cache[..., :lat], fb.kv_indices, fb.attn_mask, fb.q_index, 0.1)
        got = MLA_KERNELS[mode.value](*args)
        good, err = _close(got, ref)
        ms_ref = time_ms(
            partial(
                masked_paged_attention,
                q,
                cache,
                cache[..., :lat],
                fb.kv_indices,
                fb.attn_mask,
                fb.q_index,
                0.1,
            )
        )
        ms_tri = time_ms(partial(MLA_KERNELS[mode.value], *args))
        name = f"mla_{mode.value}"
        results[name] = {"ok": good, "max_abs_err": err, "torch_ms": ms_ref, "triton_ms": ms_tri}
        print(f"{name:<18} ok={good} err={err:.2e} torch {ms_ref:8.2f} ms  triton {ms_tri:8.2f} ms")
        ok &= good
    return ok


def check_mla_fp8(results: dict, dev: str, tiny: bool) -> bool:
    """The MLA kernels over an fp8 latent cache (``--kv-cache-dtype fp8_e4m3``, ddtree_serve/kernels/kv_quant.py) at Kimi
    K2.6 TP 8 shapes: decode, extend, a verify tree and split-K decode at 32k keys, against the reference over
    the same cache dequantized to bfloat16 (both read identical values)."""
    from ddtree_serve.kernels.attention import masked_paged_attention
    from ddtree_serve.kernels.kv_quant import dequantize_latent, quantize_latent
    from ddtree_serve.kernels.triton_mla import MLA_KERNELS
    from ddtree_serve.model_executor.forward_batch import ForwardMode, build_forward_batch

    heads, lat, rope = (4, 32, 8) if tiny else (8, 512, 64)
    g = torch.Generator(device=dev).manual_seed(5)
    n_slots = 2000 if tiny else 40000
    cache = torch.randn(n_slots, 1, lat + rope, device=dev, generator=g) * 3  # [slots, 1, L + R]
    cache8, scales = quantize_latent(cache, lat)
    deq = dequantize_latent(cache8, scales, lat, torch.bfloat16)
    ok = True
    base = 10 if tiny else 1000
    cases = ((ForwardMode.DECODE, 1, 8, base, None), (ForwardMode.EXTEND, 64, 4, base, None),
             (ForwardMode.TARGET_VERIFY, 17, 4, base, None),
             (ForwardMode.DECODE, 1, 1, 100 if tiny else 32000, 8))  # fmt: skip
    for mode, q_len, bs, pre, splits in cases:
        prefix = torch.tensor([pre + 31 * b for b in range(bs)])
        total = prefix + q_len
        table = torch.randperm(n_slots - 1, device=dev, generator=g)[: bs * int(total.max())].view(bs, -1) + 1
        new = torch.cat([table[b, int(prefix[b]) : int(total[b])] for b in range(bs)])
        tree = None
        if mode == ForwardMode.TARGET_VERIFY:
            tree = torch.tril(torch.ones(q_len, q_len, dtype=torch.bool, device=dev))
            tree[1:, 1:] &= torch.eye(q_len - 1, dtype=torch.bool, device=dev) | (
                torch.rand(q_len - 1, q_len - 1, device=dev, generator=g) < 0.3).tril()
            tree = tree.expand(bs, q_len, q_len)
        t = bs * q_len
        zeros = torch.zeros(t, dtype=torch.long, device=dev)
        fb = build_forward_batch(mode, zeros, zeros, new, table, torch.arange(bs, device=dev), prefix,
                                 torch.full((bs,), q_len), tree_mask=tree)
        q = torch.randn(t, heads, lat + rope, device=dev, generator=g, dtype=torch.bfloat16)
        ref = masked_paged_attention(q, deq, deq[..., :lat], fb.kv_indices, fb.attn_mask, fb.q_index, 0.1)
        args = (q, cache8, fb.kv_indices, fb.attn_mask, fb.q_index, fb.prefix_lens, fb.extend_lens, lat, 0.1)
        got = MLA_KERNELS[mode.value](*args, tree_mask=fb.tree_mask, num_splits=splits, k_scale=scales)
        good, err = _close(got, ref)
        ms_tri = time_ms(partial(MLA_KERNELS[mode.value], *args, tree_mask=fb.tree_mask, num_splits=splits,
                               k_scale=scales))
        name = f"mla_fp8_{mode.value}" + (f"_split{splits}" if splits else "")
        results[name] = {"ok": good, "max_abs_err": err, "triton_ms": ms_tri}
        print(f"{name:<26} ok={good} err={err:.2e} triton {ms_tri:8.2f} ms")
        ok &= good
    return ok


def check_mla_split(results: dict, dev: str, tiny: bool) -> bool:
    """Split-K MLA (ddtree_serve/kernels/triton_mla_split.py) at batch 1 and long context (Kimi TP 8 shapes, 32k keys;
    tiny: 300): decode and a 17-node verify, the launch's own choice (on CUDA it must split: fails loudly
    otherwise) and forced 4 splits against the reference; times of the single-pass kernel and the choice."""
    from ddtree_serve.kernels.attention import masked_paged_attention
    from ddtree_serve.kernels.triton_mla import MLA_KERNELS
    from ddtree_serve.kernels.triton_mla_plan import choose_kv_splits, device_sm_count, preferred_block_h
    from ddtree_serve.model_executor.forward_batch import ForwardMode, build_forward_batch

    heads, lat, rope, ctx = (4, 32, 8, 300) if tiny else (8, 512, 64, 32768)
    g = torch.Generator(device=dev).manual_seed(2)
    cache = torch.randn(ctx + 64, 1, lat + rope, device=dev, generator=g, dtype=torch.bfloat16)
    ok = True
    for mode, q_len in ((ForwardMode.DECODE, 1), (ForwardMode.TARGET_VERIFY, 17)):
        table = torch.randperm(ctx + 63, device=dev, generator=g)[: ctx + q_len].view(1, -1) + 1
        tree = None
        if mode == ForwardMode.TARGET_VERIFY:
            tree = torch.tril(torch.ones(q_len, q_len, dtype=torch.bool, device=dev))
            tree[1:, 1:] &= torch.eye(q_len - 1, dtype=torch.bool, device=dev) | (
                torch.rand(q_len - 1, q_len - 1, device=dev, generator=g) < 0.3
            ).tril()
            tree = tree.expand(1, q_len, q_len)
        fb = build_forward_batch(
            mode,
            torch.zeros(q_len, dtype=torch.long, device=dev),
            torch.zeros(q_len, dtype=torch.long, device=dev),
            table[0, ctx:],
            table,
            torch.zeros(1, dtype=torch.long, device=dev),
            torch.tensor([ctx]),
            torch.tensor([q_len]),
            tree_mask=tree,
        )
        q = torch.randn(q_len, heads, lat + rope, device=dev, generator=g, dtype=torch.bfloat16)
        args = (q, cache, fb.kv_indices, fb.attn_mask, fb.q_index, fb.prefix_lens, fb.extend_lens, lat, 0.1)
        ref = masked_paged_attention(q, cache, cache[..., :lat], fb.kv_indices, fb.attn_mask, fb.q_index, 0.1)
        kernel = MLA_KERNELS[mode.value]
        dev_t = torch.device(dev)
        programs = q_len * -(-heads // preferred_block_h(heads))
        splits = choose_kv_splits(programs, fb.kv_indices.shape[1], device_sm_count(dev_t.type, dev_t.index))
        good_auto, err = _close(kernel(*args), ref)
        good_forced, err4 = _close(kernel(*args, num_splits=4), ref)
        chose = splits > 1 or dev != "cuda"
        ms_one = time_ms(partial(kernel, *args, num_splits=1))
        ms_auto = time_ms(partial(kernel, *args))
        name = f"mla_split_{mode.value}"
        good = good_auto and good_forced and chose
        results[name] = {
            "ok": good,
            "splits": splits,
            "max_abs_err": max(err, err4),
            "single_pass_ms": ms_one,
            "chosen_ms": ms_auto,
        }
        print(
            f"{name:<24} ok={good} splits={splits} err={max(err, err4):.2e} single-pass {ms_one:8.3f} ms"
            f"  chosen {ms_auto:8.3f} ms" + ("" if chose else "  (FAIL: no split chosen on CUDA)")
        )
        ok &= good
    return ok


def check_engine(results: dict, max_tokens: int, dev: str) -> bool:
    """Tiny Kimi (INT4 experts resident) through the Engine: tokens/s per backend; tokens must agree."""
    from ddtree_serve.server.engine import Engine, SamplingParams
    from tests.model_executor.tiny_deepseek import write_tiny_deepseek
    from tests.speculative.drafter_utils import write_random_drafter

    tmp = Path(tempfile.mkdtemp(prefix="gpu_triton_"))
    path = write_tiny_deepseek(tmp / "kimi", int4=True, kimi=True, moe_intermediate_size=64).path
    drafter = write_random_drafter(path, tmp / "d", num_layers=1, block_size=4)
    prompts = [[3, 17, 42, 99, 7], [11, 200, 300, 12], [5, 6, 7], [400, 401, 402, 403, 404, 405]]
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs, ok = {}, True
    combos = [(a, m, "auto") for a, m in (("torch", "torch"), ("triton", "torch"), ("torch", "triton"),
                                          ("triton", "triton"))] + [("torch", "torch", "fp8_e4m3"),
                                                                     ("triton", "triton", "fp8_e4m3")]
    for attn, moe, kv in combos:  # fp8 KV: tokens compared with the fp8 reference (another cache, other tokens)
        for spec in ("none", "ddtree"):
            kw = (
                dict(speculative_algorithm="ddtree", draft_model_path=drafter, ddtree_budget=6)
                if spec != "none"
                else {}
            )
            eng = Engine(
                path,
                device=dev,
                dtype="float32",
                max_total_tokens=1024,
                int4_experts="packed",
                attention_backend=attn,
                moe_backend=moe,
                kv_cache_dtype=kv,
                **kw,
            )
            try:
                eng.generate(input_ids=prompts, sampling_params=SamplingParams(temperature=0, max_tokens=2))
                t0 = time.perf_counter()
                got = [o.token_ids for o in eng.generate(input_ids=prompts, sampling_params=sp)]
                tps = sum(map(len, got)) / (time.perf_counter() - t0)
            finally:
                eng.shutdown()
            kv_tag = "_kv-fp8" if kv != "auto" else ""
            key = f"engine_attn-{attn}_moe-{moe}{kv_tag}_{spec}"
            outs[key] = got
            same = got == outs[f"engine_attn-torch_moe-torch{kv_tag}_none"]
            results[key] = {"tok_s": tps, "same_tokens_as_reference": same}
            print(f"{key:<46} {tps:8.1f} tok/s  same tokens as torch/torch{kv_tag}/none: {same}")
            ok &= same
    return ok


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench_out/gpu_triton.json")
    ap.add_argument("--experts", type=int, default=64, help="local experts in the MoE check (Kimi TP 8: 384)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument(
        "--tiny", action="store_true", help="tiny shapes (with --device cpu: interpreter smoke test)"
    )
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("SKIP: CUDA not available")
        return 2
    results: dict = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu (interpreter)"}
    ok = check_moe(args.experts, results, args.device, args.tiny)
    ok &= check_mla(results, args.device, args.tiny)
    ok &= check_mla_split(results, args.device, args.tiny)
    ok &= check_mla_fp8(results, args.device, args.tiny)
    ok &= check_engine(results, args.max_tokens, args.device)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print("ALL OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
