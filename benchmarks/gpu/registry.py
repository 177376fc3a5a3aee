"""The GPU check's parts, in the order they run (benchmarks/gpu_check.py). Their timeouts add up to more than
the check's deadline on purpose: the deadline cuts the run, the last parts are then "NOT RUN (time)", so the
order is the priority (the checkpoint first, then the correctness checks, speed, the pytest files last)."""

from __future__ import annotations

from dataclasses import dataclass

ENGINE_LIBS = ("triton", "safetensors", "numpy", "tqdm")  # what the engine imports on the paths used


@dataclass(frozen=True)
class PartSpec:
    """``target``: ``module:function`` under benchmarks/gpu; ``requires``: modules that must import (else NOT
    AVAILABLE, naming them); ``needs``: parts that must have passed first; ``min_gpus``: GPUs it needs;
    ``min_start_s``: not started with less time left before the deadline."""

    name: str
    title: str
    target: str
    timeout_s: int
    requires: tuple[str, ...] = ()
    needs: tuple[str, ...] = ()
    min_gpus: int = 1
    min_start_s: int = 20


PARTS: tuple[PartSpec, ...] = (
    PartSpec("checkpoint", "Kimi K2.6-shaped random checkpoint (TP 8 rank shapes, INT4 experts) + a drafter, "
             "written on the device", "checks_model:part_checkpoint", 150, ("safetensors", "numpy", "tqdm")),
    PartSpec("triton_kernels", "Triton MoE (bf16, INT4) / MLA (decode, extend, verify, split-K 32k, fp8 KV) "
             "kernels vs the torch reference at Kimi TP 8 shapes", "checks_misc:part_triton_kernels", 120,
             ("triton",)),
    PartSpec("model_logits", "checkpoint logits: Triton MLA + MoE vs the torch reference (prefill, decode, "
             "verify)", "checks_model:part_model_logits", 90, ENGINE_LIBS, ("checkpoint",)),
    PartSpec("cuda_graphs", "eager == CUDA graphs bitwise (decode, verify; a second batch size captured with "
             "live KV in the pool)", "checks_model:part_cuda_graphs", 90, ENGINE_LIBS, ("checkpoint",)),
    PartSpec("fp8_kv", "bf16 vs fp8_e4m3 KV cache: logits closeness", "checks_model:part_fp8_kv", 75,
             ENGINE_LIBS, ("checkpoint",)),
    PartSpec("ddtree_lossless", "DDTree with scripted drafts: greedy tokens == plain, depth >= 2 paths "
             "accepted, eager and CUDA graphs (float32)", "checks_engine:part_ddtree_lossless", 120, ENGINE_LIBS,
             ("checkpoint",)),
    PartSpec("triton_compiles", "zero Triton compiles (and CUDA graph captures) after warm-up under mixed "
             "traffic, plain and ddtree", "checks_engine:part_triton_compiles", 120, ENGINE_LIBS,
             ("checkpoint",)),
    PartSpec("moonvit_16k", "MoonViT (Kimi K2.6 sizes, random) on a 16,384-patch image: activation peak vs "
             "the encoder reserve", "checks_misc:part_moonvit", 60),
    PartSpec("dcp_graph", "DCP's all_gather / reduce_scatter captured in a CUDA graph (NCCL, world size 1)",
             "checks_misc:part_dcp_graph", 60),
    PartSpec("dcp_vs_split_k", "MLA decode at 128k keys: the DCP kernel vs the split-K kernel, times",
             "checks_speed:part_dcp_vs_split_k", 60, ("triton",)),
    PartSpec("speed", "tokens/s: plain vs ddtree (scripted acceptance), batch 1 / 8, context 4k / 32k, eager "
             "/ CUDA graphs", "checks_speed:part_speed", 240, ENGINE_LIBS, ("checkpoint",), min_start_s=60),
    PartSpec("tp_allreduce", "TP collectives over NCCL across the local GPUs (benchmarks/allreduce_check.py)",
             "checks_misc:part_tp_allreduce", 120, min_gpus=2),
    PartSpec("peer_access", "GPU peer access matrix", "checks_misc:part_peer_access", 30, min_gpus=2),
    PartSpec("pytest_gpu", "tests/gpu (pytest -m gpu, fallbacks allowed: the backend of each part listed)",
             "checks_misc:part_pytest_gpu", 240, ("pytest", "triton", "safetensors", "transformers", "tokenizers",
                                                  "numpy", "tqdm"), min_start_s=60),
)

PROBED = sorted({m for p in PARTS for m in p.requires} | {"flashinfer", "sgl_kernel", "fastapi", "pydantic", "zmq",
                                                          "PIL", "xgrammar"})


def part(name: str) -> PartSpec:
    for p in PARTS:
        if p.name == name:
            return p
    raise KeyError(f"no GPU check part {name!r}; parts: {', '.join(p.name for p in PARTS)}")
