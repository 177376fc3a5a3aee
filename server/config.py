"""Frozen configuration per area, composed once into ``ServerConfig``.

Built from CLI flags over an optional YAML preset (server/args.py); derived values are properties. No
module-level mutable configuration anywhere.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

RADIX_EVICTION_POLICIES = ("lru",)  # --radix-eviction-policy choices


@dataclass(frozen=True)
class ModelArgs:
    model_path: str = "default"  # "default" = SmolLM2-135M-Instruct, converted once into the cache
    dtype: str = "auto"  # "auto" | "float32" | "bfloat16"
    device: str = "auto"  # "auto" | "cpu" | "cuda"
    context_length: int | None = None  # None: the model's max_position_embeddings
    trust_remote_code: bool = True
    int4_experts: str = "auto"  # INT4 MoE experts: "auto" | "packed" (INT4-resident) | "dequant" (at load)
    attention_backend: str = "auto"  # "auto" | "torch" | "triton" (MLA) | "flashinfer" (MHA)
    moe_backend: str = "auto"  # routed experts: "auto" | "torch" | "triton"
    cuda_graph_max_bs: int = 0  # CUDA graphs for decode/verify up to this batch size; 0 = off
    served_model_name: str | None = None


@dataclass(frozen=True)
class CacheArgs:
    # KV pool precedence (model_executor/memory.py): max_total_tokens > kv_memory_gb > device memory
    # (CUDA: mem_fraction_static x total - in use after loading - workspace; CPU: a capped share of free RAM).
    max_total_tokens: int | None = None  # KV slots, target and drafter caches alike
    kv_memory_gb: float | None = None  # KV bytes (target + drafter) per rank, when max_total_tokens is None
    mem_fraction_static: float = 0.85  # share of GPU memory for weights + workspace + KV cache (CUDA)
    verify_workspace_gb: float | None = None  # per-step logits workspace; None: enough for the full batch x budget
    disable_radix_cache: bool = False  # the prefix cache (server/kv_manager.py) is on unless this is set
    radix_eviction_policy: str = "lru"  # which cached prefixes go first under KV pressure (only "lru")

    def __post_init__(self) -> None:
        if self.radix_eviction_policy not in RADIX_EVICTION_POLICIES:
            raise ValueError(f"radix_eviction_policy must be one of {', '.join(RADIX_EVICTION_POLICIES)}; "
                             f"got {self.radix_eviction_policy!r}")


@dataclass(frozen=True)
class SchedulerArgs:
    max_running_requests: int = 64
    chunked_prefill_size: int = 512  # per-step prefill token budget (summed over the batch's requests)


@dataclass(frozen=True)
class SpeculativeArgs:
    algorithm: str = "none"  # "none" | "dflash" | "ddtree"
    draft_model_path: str | None = None  # "default" = the shipped drafter of the default model
    ddtree_budget: int | str = "auto"  # non-root tree nodes per request, or "auto" (chosen per step)
    ddtree_max_budget: int = 64  # upper bound of the auto budget
    block_size: int | None = None  # None: from the draft config
    accept_threshold_single: float = 1.0  # < 1: lossy sampled verification (SGLang's flag)
    accept_threshold_acc: float = 1.0  # < 1: lossy sampled verification (SGLang's flag)

    @property
    def lossy(self) -> bool:
        return self.accept_threshold_single < 1.0 or self.accept_threshold_acc < 1.0

    @property
    def enabled(self) -> bool:
        return self.algorithm != "none"


@dataclass(frozen=True)
class ParallelArgs:
    tp_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None  # host:port of rank 0 (multi-node)
    expert_parallel: bool = False  # MoE experts partitioned over the TP ranks (EP size = tp_size)


@dataclass(frozen=True)
class ServerArgs:
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    tool_call_parser: str | None = None  # "kimi_k2" | "hermes"
    reasoning_parser: str | None = None  # "kimi_k2" | "deepseek-r1"
    log_level: str = "info"
    max_request_body_bytes: int = 16 << 20  # larger request bodies get 413
    max_prompt_tokens: int | None = None  # longer prompts get 400; None: only the context length limits them
    max_waiting_requests: int = 1024  # requests in flight beyond max_running_requests; more get 503 + Retry-After


@dataclass(frozen=True)
class ServerConfig:
    model: ModelArgs = field(default_factory=ModelArgs)
    cache: CacheArgs = field(default_factory=CacheArgs)
    scheduler: SchedulerArgs = field(default_factory=SchedulerArgs)
    speculative: SpeculativeArgs = field(default_factory=SpeculativeArgs)
    parallel: ParallelArgs = field(default_factory=ParallelArgs)
    server: ServerArgs = field(default_factory=ServerArgs)

    @classmethod
    def from_flat(cls, values: dict[str, Any]) -> ServerConfig:
        """Compose from a flat mapping of field names (CLI dest names / Engine kwargs / YAML keys).
        Unknown keys raise ValueError naming them."""
        areas = {f.name: f.type for f in dataclasses.fields(cls)}
        area_classes = {
            "model": ModelArgs,
            "cache": CacheArgs,
            "scheduler": SchedulerArgs,
            "speculative": SpeculativeArgs,
            "parallel": ParallelArgs,
            "server": ServerArgs,
        }
        assert set(areas) == set(area_classes)
        owner: dict[str, str] = {}
        for area, klass in area_classes.items():
            for f in dataclasses.fields(klass):
                owner[_flat_name(area, f.name)] = area
        per_area: dict[str, dict[str, Any]] = {a: {} for a in area_classes}
        unknown = []
        for key, value in values.items():
            key = key.replace("-", "_")
            if key not in owner:
                unknown.append(key)
                continue
            area = owner[key]
            per_area[area][_field_name(area, key)] = value
        if unknown:
            raise ValueError(f"unknown configuration keys: {', '.join(sorted(unknown))}")
        return cls(**{a: area_classes[a](**kw) for a, kw in per_area.items()})


def public_info(config: ServerConfig) -> dict[str, Any]:
    """Every setting by flat name, for ``GET /get_server_info`` (the API key is withheld), plus
    ``speculative_lossy``: whether accept thresholds below 1 make sampled verification lossy."""
    out: dict[str, Any] = {}
    for area in dataclasses.fields(config):
        for f in dataclasses.fields(getattr(config, area.name)):
            out[_flat_name(area.name, f.name)] = getattr(getattr(config, area.name), f.name)
    out["api_key"] = None if config.server.api_key is None else "(set)"
    out["speculative_lossy"] = config.speculative.lossy
    return out


# Flat names follow SGLang's flags: speculative fields are prefixed (--speculative-algorithm, ...).
def _flat_name(area: str, name: str) -> str:
    return f"speculative_{name}" if area == "speculative" else name


def _field_name(area: str, flat: str) -> str:
    return flat.removeprefix("speculative_") if area == "speculative" else flat
