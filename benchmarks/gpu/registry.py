"""The GPU check's parts, in the order they run (benchmarks/gpu_check.py), ordered by value: the comparisons against
a reference first (the seeded sampler and the DCP MLA kernel, which only tests/gpu compares; the Triton kernels;
then, on the checkpoint, model logits, CUDA graphs and lossless DDTree), then the other checks, compiles, speed
last. The timeouts of the parts one GPU runs add up, with the probe's, to at most the check's deadline
(``DEADLINE_S``, under the lent machine's 9 minutes), so no part is cut for time by the parts before it; each
part's work is sized to its timeout (estimates: no GPU has timed them yet). The multi-GPU parts come after (NOT
AVAILABLE on one GPU, outside that budget)."""

from __future__ import annotations

from dataclasses import dataclass

ENGINE_LIBS = ("triton", "safetensors", "numpy", "tqdm")  # what the engine imports on the paths used
DEADLINE_S = 525  # the whole check, probe included: 8 3/4 minutes
PROBE_TIMEOUT_S = 30
GROUPS = ("reference", "check", "compile", "speed", "multi-gpu")  # the order the parts run in


@dataclass(frozen=True)
class PartSpec:
    """``target``: ``module:function`` under benchmarks/gpu; ``group``: one of ``GROUPS``; ``requires``: modules
    that must import (else NOT AVAILABLE, naming them); ``needs``: parts that must have passed first;
    ``min_gpus``: GPUs it needs; ``min_start_s``: not started with less time left before the deadline."""

    name: str
    title: str
    target: str
    timeout_s: int
    group: str
    requires: tuple[str, ...] = ()
    needs: tuple[str, ...] = ()
    min_gpus: int = 1
    min_start_s: int = 10


PYTEST_LIBS = ("pytest", "triton", "safetensors", "transformers", "tokenizers", "numpy", "tqdm")

PARTS: tuple[PartSpec, ...] = (
    PartSpec("pytest_reference", "tests/gpu comparisons nothing else makes: the seeded sampling kernel at V 163,840, "
             "tree verify / sampling, the coin rule, DCP 8 MLA decode / extend / verify, mixed batches, vs the torch "
             "reference", "checks_pytest:part_pytest_reference", 110, "reference", PYTEST_LIBS),
    PartSpec("triton_kernels", "Triton MoE (bf16, INT4) / MLA (decode, extend, verify, split-K 32k, fp8 KV) "
             "kernels vs the torch reference at Kimi TP 8 shapes", "checks_misc:part_triton_kernels", 50,
             "reference", ("triton",)),
    PartSpec("checkpoint", "Kimi K2.6-shaped random checkpoint (TP 8 rank shapes, INT4 experts) + a drafter, "
             "written on the device", "checks_model:part_checkpoint", 50, "reference",
             ("safetensors", "numpy", "tqdm")),
    PartSpec("model_logits", "checkpoint logits: Triton MLA + MoE vs the torch reference (prefill, decode, "
             "verify)", "checks_model:part_model_logits", 40, "reference", ENGINE_LIBS, ("checkpoint",)),
    PartSpec("cuda_graphs", "eager == CUDA graphs bitwise (decode, verify; a second batch size captured with "
             "live KV in the pool)", "checks_model:part_cuda_graphs", 40, "reference", ENGINE_LIBS,
             ("checkpoint",)),
    PartSpec("ddtree_lossless", "DDTree with scripted drafts: greedy tokens == plain, depth >= 2 paths "
             "accepted, eager and CUDA graphs (float32)", "checks_engine:part_ddtree_lossless", 50, "reference",
             ENGINE_LIBS, ("checkpoint",)),
    PartSpec("fp8_kv", "bf16 vs fp8_e4m3 KV cache: logits closeness", "checks_model:part_fp8_kv", 20, "reference",
             ENGINE_LIBS, ("checkpoint",)),
    PartSpec("pytest_rest", "the other tests/gpu tests (pytest -m gpu, fallbacks allowed: the backend of each "
             "listed)", "checks_pytest:part_pytest_rest", 20, "check", PYTEST_LIBS),
    PartSpec("moonvit_16k", "MoonViT (Kimi K2.6 sizes, random) on a 16,384-patch image: activation peak vs "
             "the encoder reserve", "checks_misc:part_moonvit", 10, "check"),
    PartSpec("dcp_graph", "DCP's all_gather / reduce_scatter captured in a CUDA graph (NCCL, world size 1)",
             "checks_misc:part_dcp_graph", 10, "check", min_start_s=5),
    PartSpec("triton_compiles", "zero Triton compiles (and CUDA graph captures) after warm-up under mixed "
             "traffic, plain and ddtree", "checks_engine:part_triton_compiles", 25, "compile", ENGINE_LIBS,
             ("checkpoint",)),
    PartSpec("speed_sampler", "sampling kernel rows/s at V 163,840: radix select vs the bisection kernel "
             "(baseline; FAIL when slower)", "checks_speed:part_speed_sampler", 25, "speed", ("triton",)),
    PartSpec("dcp_vs_split_k", "MLA decode at 128k keys: the DCP kernel vs the split-K kernel, times",
             "checks_speed:part_dcp_vs_split_k", 10, "speed", ("triton",)),
    PartSpec("speed", "tokens/s: plain eager (baseline) vs plain and ddtree with CUDA graphs, batch 1 / 8, "
             "context 4k (FAIL when graphs are slower than eager)", "checks_speed:part_speed", 30, "speed",
             ENGINE_LIBS, ("checkpoint",), min_start_s=30),
    PartSpec("tp_allreduce", "TP collectives over NCCL across the local GPUs (benchmarks/allreduce_check.py)",
             "checks_misc:part_tp_allreduce", 120, "multi-gpu", min_gpus=2),
    PartSpec("peer_access", "GPU peer access matrix", "checks_misc:part_peer_access", 30, "multi-gpu", min_gpus=2),
)

PROBED = sorted({m for p in PARTS for m in p.requires} | {"flashinfer", "sgl_kernel", "fastapi", "pydantic", "zmq",
                                                          "PIL", "xgrammar"})


def part(name: str) -> PartSpec:
    for p in PARTS:
        if p.name == name:
            return p
    raise KeyError(f"no GPU check part {name!r}; parts: {', '.join(p.name for p in PARTS)}")
