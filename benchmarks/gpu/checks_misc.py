"""GPU check parts beside the checkpoint: the Triton kernels at Kimi shapes (benchmarks/gpu_triton_check.py's
checks), MoonViT's activation peak on a 16k-patch image against the encoder reserve, DCP's collectives inside
a CUDA graph and the multi-GPU checks (NOT AVAILABLE on one GPU); the tests/gpu pytest files run from
benchmarks/gpu/checks_pytest.py."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.gpu.parts import NotAvailable, PartContext, time_ms

ROOT = Path(__file__).resolve().parents[2]


def part_triton_kernels(ctx: PartContext) -> bool:
    """MoE (bf16 and INT4 experts, 384 local experts, 1 / 16 / 128 tokens), MLA (decode, extend, verify),
    split-K MLA at 32k keys (it must choose to split on CUDA) and the fp8-cache MLA kernels, each against the
    torch reference (atol = rtol = 3e-2), with both times."""
    from benchmarks.gpu_triton_check import check_mla, check_mla_fp8, check_mla_split, check_moe

    ok = True
    for name, fn in (("mla", lambda r: check_mla(r, "cuda", tiny=False)),
                     ("mla_split", lambda r: check_mla_split(r, "cuda", tiny=False)),
                     ("mla_fp8", lambda r: check_mla_fp8(r, "cuda", tiny=False)),
                     ("moe", lambda r: check_moe(384, r, "cuda", tiny=False))):
        results: dict[str, Any] = {}
        try:
            good = fn(results)
        finally:
            ctx.numbers |= results
            ctx.flush()
        ctx.numbers[f"{name}_ok"] = good
        ok &= good
        torch.cuda.empty_cache()
    ctx.backend["kernels"] = "triton (ddtree_serve/kernels/triton_moe.py, triton_mla*.py) vs torch reference"
    return ok


def part_moonvit(ctx: PartContext) -> bool:
    """Kimi K2.6's MoonViT (hidden 1152, 27 layers, 16 heads; random bf16 weights) and projector on one image
    of 128 x 128 = 16,384 patches (the published in_patch_limit): the activation peak (peak allocated less
    weights and input) must stay within the reserve start-up sizing keeps for the encoder
    (ddtree_serve/model_executor/models/moonvit.py ``encoder_peak_bytes`` at ``max_image_patches``)."""
    from ddtree_serve.model_executor.models.moonvit import (
        KimiVision,
        MoonViTConfig,
        encoder_peak_bytes,
        fused_attention_available,
        max_image_patches,
    )

    cfg = MoonViTConfig()
    with torch.device("cuda"):
        model = KimiVision(cfg, torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g, device="cuda") * 0.02)
    h = w = 128
    pv = torch.randn(h * w, 3, cfg.patch_size, cfg.patch_size, device="cuda", generator=g, dtype=torch.bfloat16)
    fused = fused_attention_available("cuda")
    reserve = encoder_peak_bytes(cfg, max_image_patches(""), 2, fused=fused)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    out = model.embed_images([pv], [(1, h, w)])[0]
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() - base
    ms = time_ms(lambda: model.embed_images([pv], [(1, h, w)]), 3)
    finite = bool(torch.isfinite(out).all())
    ctx.numbers |= {"patches": h * w, "image_tokens": int(out.shape[0]), "activation_peak_mib": round(peak / 2**20),
                    "reserve_mib": round(reserve / 2**20), "peak_over_reserve": round(peak / reserve, 3),
                    "fused_attention": fused, "first_call_s": round(first, 2), "ms": round(ms, 1),
                    "weights_mib": round(sum(p.numel() * 2 for p in model.parameters()) / 2**20),
                    "output_finite": finite}
    ctx.backend["attention"] = "torch SDPA " + ("fused" if fused else "math")
    return peak <= reserve and finite


def part_dcp_graph(ctx: PartContext) -> bool:
    """NCCL at world size 1: the collectives DCP attention runs (``TPGroup.dcp_all_gather``: ``all_gather``
    into a list then a concatenation; ``dcp_reduce_scatter``: ``reduce_scatter_tensor``) captured in one CUDA
    graph with the merge arithmetic between them, then replayed on new inputs: the outputs must equal eager's
    bitwise (at world size 1 the gather is the input, the scatter the sum of one)."""
    import torch.distributed as dist

    from ddtree_serve.model_executor.parallel_state import free_local_addr

    if not dist.is_nccl_available():
        raise NotAvailable("this torch has no NCCL")
    dist.init_process_group("nccl", init_method=f"tcp://{free_local_addr()}", rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    try:
        pg = dist.group.WORLD
        t, heads, width = 17, 64, 512
        x = torch.randn(t, heads, width, device="cuda")  # static input: partial outputs [T, N*Hr, W]
        lse = torch.randn(t, heads, device="cuda")

        def step() -> tuple[torch.Tensor, torch.Tensor]:
            parts = [torch.empty_like(lse[None])]
            dist.all_gather(parts, lse[None].contiguous(), group=pg)  # [1, T, H] per rank
            every = torch.cat(parts, dim=0)  # [N, T, H]
            w = torch.softmax(every, dim=0)[0]  # this rank's merge weights
            y = (x * w[..., None]).movedim(1, 0).contiguous()  # [H, T, W]
            out = torch.empty_like(y)
            dist.reduce_scatter_tensor(out, y, group=pg)
            return every, out.movedim(0, 1)

        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):  # NCCL's communicator and the allocator settle before capture
                step()
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            every_g, out_g = step()
        ok = True
        for seed in (1, 2):
            g = torch.Generator(device="cuda").manual_seed(seed)
            x.copy_(torch.randn(x.shape, generator=g, device="cuda"))
            lse.copy_(torch.randn(lse.shape, generator=g, device="cuda"))
            graph.replay()
            torch.cuda.synchronize()
            every_e, out_e = step()
            ok &= bool(torch.equal(every_g, every_e) and torch.equal(out_g, out_e))
        ctx.numbers |= {"replays_equal_eager": ok, "graph_ms": round(time_ms(graph.replay, 20), 4),
                        "eager_ms": round(time_ms(step, 20), 4),
                        "nccl": ".".join(map(str, torch.cuda.nccl.version()))}
        ctx.backend["collectives"] = "NCCL (world size 1) inside torch.cuda.graph"
        return ok
    finally:
        dist.destroy_process_group()


def part_tp_allreduce(ctx: PartContext) -> bool:
    """benchmarks/allreduce_check.py over every local GPU (exit 3: fewer than 2 GPUs)."""
    out = ctx.work / "allreduce.json"
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "allreduce_check.py"), "--device", "cuda",
                        "--timeout", str(max(10, int(ctx.left()) - 20)), "--out", str(out)], capture_output=True,
                       text=True, timeout=max(15, ctx.left() - 5), cwd=ROOT)
    if p.returncode == 3:
        raise NotAvailable("fewer than 2 GPUs")
    ctx.numbers |= {"exit": p.returncode, "output_tail": p.stdout[-3000:] + p.stderr[-1500:]}
    if out.exists():
        ctx.numbers["result"] = out.read_text()[:20000]
    return p.returncode == 0


def part_peer_access(ctx: PartContext) -> bool:
    """Which local GPU pairs have peer access (informational: every pair listed)."""
    n = torch.cuda.device_count()
    if n < 2:
        raise NotAvailable(f"needs 2 GPUs, this machine has {n}")
    ctx.numbers["matrix"] = [" ".join("X" if i == j else ("P2P" if torch.cuda.can_device_access_peer(i, j) else "-")
                                      for j in range(n)) for i in range(n)]
    return True
