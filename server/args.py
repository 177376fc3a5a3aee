"""Command-line flags of ``ddtree-serve serve`` (SGLang names), over an optional YAML preset.

Every field of ``ServerConfig`` has a flag; ``--config preset.yaml`` holds flat keys (the flags' dest names,
``ServerConfig.from_flat``), and flags given on the command line override the preset.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

from server.config import RADIX_EVICTION_POLICIES, ServerConfig

_DTYPES = ("auto", "float32", "bfloat16", "float16")
_DEVICES = ("auto", "cpu", "cuda")
_SPEC_ALGOS = ("none", "dflash", "ddtree")
_TOOL_PARSERS = ("kimi_k2", "hermes")
_REASONING_PARSERS = ("kimi_k2", "deepseek-r1")
_LOG_LEVELS = ("debug", "info", "warning", "error")
_KERNEL_BACKENDS = ("auto", "torch", "triton", "flashinfer")


def budget_value(text: str) -> int | str:
    """``--speculative-ddtree-budget``: "auto" or a positive integer."""
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be 'auto' or an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 'auto' or an integer >= 1, got {value}")
    return value


# (dest, type, help, choices); bool fields use --flag / --no-flag.
_FLAGS: tuple[tuple[str, Any, str, tuple | None], ...] = (
    ("model_path", str, "Hugging Face model directory, or 'default' (SmolLM2-135M-Instruct, prepared once).", None),
    ("dtype", str, "Weight and activation dtype; 'auto' = bfloat16 on CUDA, float32 on CPU.", _DTYPES),
    ("device", str, "Device to run on; 'auto' = CUDA when available.", _DEVICES),
    ("context_length", int, "Maximum prompt + completion length in tokens (default: the model's).", None),
    ("trust_remote_code", bool, "Allow the model's own tokenizer/config code (Kimi needs it).", None),
    ("int4_experts", str, "INT4 MoE experts: packed (INT4 in memory), dequant (dense at load); auto = packed on "
     "CUDA, dequant on CPU.", ("auto", "packed", "dequant")),
    ("attention_backend", str, "Attention kernels: torch (reference), triton (MLA models), flashinfer (MHA "
     "models); auto = the fast one on CUDA, torch on CPU.", _KERNEL_BACKENDS),
    ("moe_backend", str, "Routed-expert kernels: torch (reference) or triton (grouped GEMM, dense or INT4); "
     "auto = triton on CUDA, torch on CPU.", _KERNEL_BACKENDS),
    ("cuda_graph_max_bs", int, "Replay decode and verify forwards of up to this many requests from CUDA "
     "graphs (MLA models with the triton backends, CUDA only); 0 = off.", None),
    ("served_model_name", str, "Model name in the API (default: --model-path).", None),
    ("max_total_tokens", int, "KV cache size in tokens; overrides --kv-memory-gb and the memory probe.", None),
    ("kv_memory_gb", float, "KV cache size in GiB per rank (target + drafter) when --max-total-tokens is not "
     "set; overrides the memory probe (default: CUDA mem_fraction_static, CPU a capped share of free RAM).", None),
    ("mem_fraction_static", float, "Share of total GPU memory for weights + verify workspace + KV cache (CUDA).",
     None),
    ("verify_workspace_gb", float, "Memory per rank for one step's logits and probabilities, reserved before "
     "the KV cache; caps the tree nodes verified per step (default: enough for the full batch x budget).", None),
    ("disable_radix_cache", bool, "Turn the prefix cache off: every request prefills its whole prompt and "
     "frees its KV when it ends.", None),
    ("radix_eviction_policy", str, "Which cached prefixes are evicted first when the KV cache runs short "
     "(lru: least recently used).", RADIX_EVICTION_POLICIES),
    ("max_running_requests", int, "Most requests decoded at once.", None),
    ("chunked_prefill_size", int, "Prefill token budget per scheduler step (long prompts are chunked).", None),
    ("speculative_algorithm", str, "Speculative decoding: none, dflash (chain) or ddtree (tree).", _SPEC_ALGOS),
    ("speculative_draft_model_path", str, "DFlash drafter directory ('default' = the default model's).", None),
    ("speculative_ddtree_budget", budget_value, "DDTree: draft tree nodes per request and step (root excluded), "
     "or 'auto': chosen every step per request from measured step cost and calibrated expected acceptance "
     "(0 = a plain decode step).", None),
    ("speculative_ddtree_max_budget", int, "Upper bound of the auto tree budget.", None),
    ("speculative_block_size", int, "Drafter block size (default: from the drafter config).", None),
    ("speculative_accept_threshold_single", float, "Sampled verification: accept a draft token whose target "
     "probability reaches this (values below 1 are LOSSY: output no longer follows the target distribution).",
     None),
    ("speculative_accept_threshold_acc", float, "Sampled verification: accept a draft token once the "
     "accumulated target probability reaches this (values below 1 are LOSSY).", None),
    ("tp_size", int, "Tensor-parallel size (GPUs per model replica).", None),
    ("nnodes", int, "Number of nodes for tensor parallelism.", None),
    ("node_rank", int, "Rank of this node.", None),
    ("dist_init_addr", str, "host:port of node rank 0 (multi-node).", None),
    ("expert_parallel", bool, "MoE: give each TP rank whole experts (expert parallelism) instead of a slice "
     "of every expert.", None),
    ("host", str, "HTTP host to bind.", None),
    ("port", int, "HTTP port.", None),
    ("api_key", str, "Require 'Authorization: Bearer KEY' on /v1 routes.", None),
    ("tool_call_parser", str, "Parse tool calls from the output in this format.", _TOOL_PARSERS),
    ("reasoning_parser", str, "Split <think> reasoning into reasoning_content.", _REASONING_PARSERS),
    ("log_level", str, "Logging level.", _LOG_LEVELS),
    ("max_request_body_bytes", int, "Largest accepted HTTP request body in bytes (413 beyond).", None),
    ("max_prompt_tokens", int, "Longest accepted prompt in tokens (400 beyond; default: the context length).", None),
    ("max_waiting_requests", int, "Requests that may wait beyond --max-running-requests (503 with Retry-After "
     "beyond).", None),
)


def config_field_names() -> set[str]:
    """Flat names of every ServerConfig field (what --config YAML keys and flags map to)."""
    return set(_flat_defaults())


def flag_names() -> set[str]:
    return {dest for dest, *_ in _FLAGS}


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=str, default=None, metavar="YAML",
                        help="YAML preset of flat config keys (e.g. configs/kimi-k2.6-8xrtx6000.yaml); flags override it.")
    defaults = _flat_defaults()
    for dest, typ, help_text, choices in _FLAGS:
        flag = "--" + dest.replace("_", "-")
        shown = f"{help_text} (default: {defaults.get(dest)!r})"
        if typ is bool:
            parser.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction,
                                default=argparse.SUPPRESS, help=shown)
        else:
            parser.add_argument(flag, dest=dest, type=typ, choices=choices, default=argparse.SUPPRESS,
                                help=shown, metavar=None if choices else dest.split("_")[-1].upper())


def _flat_defaults() -> dict[str, Any]:
    cfg = ServerConfig()
    out = {}
    for area in dataclasses.fields(cfg):
        for f in dataclasses.fields(getattr(cfg, area.name)):
            key = f"speculative_{f.name}" if area.name == "speculative" else f.name
            out[key] = getattr(getattr(cfg, area.name), f.name)
    return out


def load_yaml(path: str) -> dict[str, Any]:
    import yaml

    data = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a config preset must be a mapping of flat keys")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    """YAML preset (if any), then the flags given on the command line, into one validated ServerConfig."""
    flat: dict[str, Any] = load_yaml(args.config) if getattr(args, "config", None) else {}
    known = {dest for dest, *_ in _FLAGS}
    for key, value in vars(args).items():
        if key in known:
            flat[key] = value
    apply_default_speculation(flat)
    config = ServerConfig.from_flat(flat)
    validate_config(config)
    return config


def apply_default_speculation(flat: dict[str, Any]) -> None:
    """The default model is served with DDTree and its shipped drafter unless the user chose an algorithm."""
    if flat.get("model_path", "default") not in (None, "", "default") or "speculative_algorithm" in flat:
        return
    from model_executor.default_drafter import default_drafter_path

    try:
        default_drafter_path()
    except FileNotFoundError:
        return
    flat["speculative_algorithm"] = "ddtree"
    flat.setdefault("speculative_draft_model_path", "default")


def validate_config(config: ServerConfig) -> None:
    """Choices and ranges that a YAML preset could get wrong (flags are checked by argparse already)."""
    checks = [
        ("dtype", config.model.dtype, _DTYPES), ("device", config.model.device, _DEVICES),
        ("speculative_algorithm", config.speculative.algorithm, _SPEC_ALGOS),
        ("log_level", config.server.log_level, _LOG_LEVELS),
        ("attention_backend", config.model.attention_backend, _KERNEL_BACKENDS),
        ("moe_backend", config.model.moe_backend, _KERNEL_BACKENDS),
        ("radix_eviction_policy", config.cache.radix_eviction_policy, RADIX_EVICTION_POLICIES),
    ]
    if config.server.tool_call_parser is not None:
        checks.append(("tool_call_parser", config.server.tool_call_parser, _TOOL_PARSERS))
    if config.server.reasoning_parser is not None:
        checks.append(("reasoning_parser", config.server.reasoning_parser, _REASONING_PARSERS))
    for name, value, allowed in checks:
        if value not in allowed:
            raise ValueError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")
    if not 0 < config.server.port < 65536:
        raise ValueError(f"port must be in 1..65535; got {config.server.port}")
    if config.model.cuda_graph_max_bs < 0:
        raise ValueError("cuda_graph_max_bs must be >= 0")
    if config.parallel.tp_size < 1:
        raise ValueError("tp_size must be >= 1")
    spec = config.speculative
    budget = spec.ddtree_budget
    if budget != "auto" and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
        raise ValueError(f"speculative_ddtree_budget must be 'auto' or an integer >= 1; got {budget!r}")
    if spec.ddtree_max_budget < 1:
        raise ValueError("speculative_ddtree_max_budget must be >= 1")
    for name in ("accept_threshold_single", "accept_threshold_acc"):
        if not 0.0 <= getattr(spec, name) <= 1.0:
            raise ValueError(f"speculative_{name} must be in [0, 1]; got {getattr(spec, name)}")
    srv, cache = config.server, config.cache
    if srv.max_request_body_bytes < 1024:
        raise ValueError("max_request_body_bytes must be >= 1024")
    if srv.max_prompt_tokens is not None and srv.max_prompt_tokens < 1:
        raise ValueError("max_prompt_tokens must be >= 1")
    if srv.max_waiting_requests < 0:
        raise ValueError("max_waiting_requests must be >= 0")
    if not 0 < cache.mem_fraction_static <= 1:
        raise ValueError("mem_fraction_static must be in (0, 1]")
    for name in ("kv_memory_gb", "verify_workspace_gb"):
        if getattr(cache, name) is not None and getattr(cache, name) <= 0:
            raise ValueError(f"{name} must be > 0")
