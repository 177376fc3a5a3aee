"""Start-up resolution, done once before anything is built: the model and drafter paths and the device.

``resolve_config`` turns the user's configuration into a resolved one (``model_path`` and, with
speculation, ``speculative_draft_model_path`` are existing directories, the drafter's checked to be a DFlash
drafter for the target (``check_drafter``, before any weights load), ``"default"`` replaced by the
shipped model / drafter; ``device`` is ``cpu`` or ``cuda``). Everything below it (``make_scheduler``,
``Scheduler``, ``SpecWorker.create``, the TP ranks) reads those fields as they are; the one thing resolved
later is the CUDA graph bound's default, which needs the loaded target's kernel backends
(``resolve_cuda_graphs``, called by the scheduler and by ``plan``).

``check_kimi_tokenizer`` guards the loaded tokenizer when a Kimi parser is selected: the markers the parsers
rely on must each be one token, with the id the checkpoint declares (transformers 5.4.0-5.5.3 load Kimi's
tiktoken tokenizer with shifted special-token ids: huggingface/transformers#45356).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

from ddtree_serve.model_executor.model_config import ModelConfig
from ddtree_serve.model_executor.models.dflash_keys import unimplemented_keys
from ddtree_serve.server.config import ServerConfig, SpeculativeArgs, flat_name, is_default_path

logger = logging.getLogger(__name__)


def resolve_device(device: str) -> str:
    """``"auto"`` -> ``"cuda"`` when CUDA is available, else ``"cpu"``; any other value as given."""
    if device == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def resolve_model_path(path: str | None) -> str:
    """A local Hugging Face directory; ``"default"`` = SmolLM2-135M-Instruct, converted once into the cache."""
    if is_default_path(path):
        from ddtree_serve.model_executor.default_model import ensure_default_model

        return ensure_default_model()
    if not Path(path).is_dir():
        raise ValueError(f"model_path {path!r} does not exist or is not a directory "
                         "(hub downloads are not supported: pass a local Hugging Face directory)")
    return str(path)


DRAFTER_HINT = ("the Kimi presets name /models/Kimi-K2.6-DFlash, z-lab/Kimi-K2.6-DFlash on Hugging Face "
                "(docs/DEPLOY.md); without a drafter, serve with suffix drafts alone: --speculative-draft-sources "
                "suffix --speculative-draft-model-path ''")


def resolve_draft_path(path: str | None) -> str:
    """A drafter directory; ``"default"`` or unset = the default model's shipped drafter."""
    if is_default_path(path):
        from ddtree_serve.model_executor.default_drafter import default_drafter_path

        return default_drafter_path()
    return str(path)


def check_drafter(path: str, target_path: str) -> None:
    """ValueError naming ``--speculative-draft-model-path`` unless ``path`` holds a DFlash drafter config
    (architectures ``DFlashDraftModel``, a ``dflash_config`` with ``mask_token_id``) whose hidden size is the
    target's: read from the two config.json files, before any weights load."""
    import json

    cfg_file = Path(path) / "config.json"
    problem = None
    if not Path(path).is_dir():
        problem = "does not exist or is not a directory"
    elif not cfg_file.is_file():
        problem = "holds no config.json"
    else:
        try:
            cfg = json.loads(cfg_file.read_text())
        except (OSError, ValueError) as e:
            cfg, problem = {}, f"has an unreadable config.json ({e})"
        drafters = ("DFlashDraftModel", "DDTreeSimulatedDrafter")  # the latter: the simulated device's (sim/)
        selector = {"selector_rank", "selector_top_k"} & {*cfg, *(cfg.get("dflash_config") or {})}  # dflash_conv.py
        if problem is None and (selector or "DFlash2DraftModel" in (cfg.get("architectures") or [])):
            problem = ("is a DFlash2 drafter with a candidate selector, which is not supported (DDTree needs "
                       "independent per-depth distributions)")
        elif problem is None and (bad := unimplemented_keys(cfg)):  # models/dflash_keys.py
            problem = f"declares {', '.join(bad)}, which change(s) the drafter's math and is not implemented"
        elif problem is None and not set(drafters) & set(cfg.get("architectures") or []):
            problem = f"is not a DFlash drafter (config.json architectures {cfg.get('architectures')})"
        elif problem is None and "mask_token_id" not in (cfg.get("dflash_config") or {}):
            problem = "is not a DFlash drafter (config.json has no dflash_config.mask_token_id)"
        elif problem is None:
            target = json.loads((Path(target_path) / "config.json").read_text())
            target = target.get("text_config") or target
            if cfg.get("hidden_size") != target.get("hidden_size"):
                problem = (f"is a drafter for another target (hidden size {cfg.get('hidden_size')}, the target's "
                           f"{target.get('hidden_size')})")
    if problem:
        raise ValueError(f"--speculative-draft-model-path {path!r} {problem}; {DRAFTER_HINT}")


def check_source_settings(spec: SpeculativeArgs) -> None:
    """A setting of a draft source that the resolved sources leave out would be accepted and do nothing:
    ValueError naming it (a drafter path, block size or ``dflash_*`` setting without DFlash, a suffix bound without suffix drafts;
    ``default``, the shipped drafter's name, is the default model's implicit value and passes)."""
    sources = spec.draft_sources.split(",")
    unused = []
    if "dflash" not in sources:
        unused += ["speculative_draft_model_path"] * (not is_default_path(spec.draft_model_path))
        unused += ["speculative_block_size"] * (spec.block_size is not None)
        unused += [flat_name(SpeculativeArgs, f.name) for f in dataclasses.fields(spec)
                   if f.name.startswith("dflash_") and getattr(spec, f.name) is not None]
    if "suffix" not in sources:
        unused += [flat_name(SpeculativeArgs, f.name) for f in dataclasses.fields(spec)
                   if f.name.startswith("suffix_") and getattr(spec, f.name) != f.default]
    if unused:
        raise ValueError(f"{', '.join(unused)} set, but speculative_draft_sources is {spec.draft_sources!r}: "
                         "the setting would have no effect")


def is_resolved(config: ServerConfig) -> bool:
    """Whether ``resolve_config`` has nothing left to do (a concrete device and model path)."""
    spec = config.speculative
    return (config.model.device != "auto" and not is_default_path(config.model.model_path)
            and not (spec.uses_drafter and is_default_path(spec.draft_model_path)))


def target_model_config(config: ServerConfig) -> ModelConfig:
    """The target's ModelConfig for a resolved ``config`` (the scheduler and the start-up plan load the same)."""
    m = config.model
    return ModelConfig.load(m.model_path, m.dtype, m.device, m.int4_experts, attention_backend=m.attention_backend,
                            moe_backend=m.moe_backend, kv_cache_dtype=m.kv_cache_dtype,
                            vision=config.server.max_images_per_request > 0,  # 0: text only
                            deterministic_inference=m.enable_deterministic_inference,
                            video=config.server.max_videos_per_request > 0)


def resolve_cuda_graphs(config: ServerConfig, target: ModelConfig) -> ServerConfig:
    """``config`` with ``cuda_graph_max_bs`` concrete for ``target`` (its resolved kernel backends): the
    default (None) on where the forward can be captured, else 0 (``cuda_graph_runner.default_graph_max_bs``);
    the choice is logged. The scheduler and ``plan`` resolve alike, so the plan reserves what serving
    captures."""
    from ddtree_serve.model_executor.cuda_graph_runner import default_graph_max_bs

    m = config.model
    if m.cuda_graph_max_bs is not None:
        return config
    max_bs, why = default_graph_max_bs(None, target, m.device, config.scheduler.max_running_requests,
                                       config.parallel.decode_context_parallel_size)
    logger.info("CUDA graphs %s%s", f"up to batch {max_bs}: " if max_bs else "", why)
    return config.replace("model", cuda_graph_max_bs=max_bs)


def resolve_draft_sources(config: ServerConfig) -> str:
    """``auto`` -> ``dflash`` for the dflash algorithm; for ddtree ``dflash,suffix`` when a drafter is configured
    (a path, or the default model, whose drafter ships), ``suffix`` alone otherwise."""
    from ddtree_serve.speculative.draft_sources import resolve_sources

    spec = config.speculative
    drafter = spec.draft_model_path not in (None, "") or is_default_path(config.model.model_path)  # 'default' too
    return resolve_sources(spec.draft_sources, spec.algorithm, drafter)


def resolve_config(config: ServerConfig) -> ServerConfig:
    """The configuration with its paths and device resolved (idempotent), after refusing a model whose
    tokenizer needs remote code that is not trusted: all before any weights load or process starts."""
    from ddtree_serve.server.process_utils import check_trust_remote_code

    if config.speculative.enabled:  # before the model path is resolved: 'default' decides the sources
        config = config.replace("speculative", draft_sources=resolve_draft_sources(config))
        check_source_settings(config.speculative)
    draft_path = config.speculative.draft_model_path
    if config.speculative.uses_drafter and not is_default_path(draft_path) and not Path(draft_path).is_dir():
        check_drafter(draft_path, "")  # a missing drafter fails before the default model is prepared
    model_path = resolve_model_path(config.model.model_path)
    check_trust_remote_code(model_path, config.model.trust_remote_code)
    config = config.replace("model", model_path=model_path, device=resolve_device(config.model.device))
    if config.speculative.uses_drafter:
        draft_path = resolve_draft_path(draft_path)
        check_drafter(draft_path, model_path)
        config = config.replace("speculative", draft_model_path=draft_path)
    return config


KIMI_MARKERS: tuple[str, ...] = (
    "<think>", "</think>", "<|im_end|>", "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>",
    "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>",
)
KIMI_EOS = "<|im_end|>"
TRANSFORMERS_KIMI_BUG = ("transformers 5.4.0-5.5.3 load Kimi's tokenizer with shifted special-token ids "
                         "(huggingface/transformers#45356, fixed in 5.5.4)")


def uses_kimi_parser(config: ServerConfig) -> bool:
    """Whether the server parses replies in Kimi's format (``kimi_k2`` tool-call or reasoning parser)."""
    return "kimi_k2" in (config.server.tool_call_parser, config.server.reasoning_parser)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def declared_token_ids(model_path: str, tokenizer: Any) -> dict[str, int]:
    """Special token -> the id the checkpoint declares: tokenizer_config.json's ``added_tokens_decoder``, and
    for the tokens it does not list, the loaded tokenizer's added tokens (a tokenizer whose vocabulary file
    numbers them, as Kimi's ``tiktoken.model`` does)."""
    declared = {tok: int(i) for tok, i in tokenizer.get_added_vocab().items()}
    table = _read_json(Path(model_path) / "tokenizer_config.json").get("added_tokens_decoder")
    if isinstance(table, dict):
        declared.update({entry["content"]: int(i) for i, entry in table.items()
                         if isinstance(entry, dict) and "content" in entry})
    return declared


def declared_eos_ids(model_path: str) -> set[int]:
    """The eos ids config.json (top level and ``text_config``) and generation_config.json declare."""
    out: set[int] = set()
    cfg = _read_json(Path(model_path) / "config.json")
    for source in (cfg, cfg.get("text_config") or {}, _read_json(Path(model_path) / "generation_config.json")):
        eos = source.get("eos_token_id") if isinstance(source, dict) else None
        out |= {int(e) for e in (eos if isinstance(eos, list) else [eos]) if isinstance(e, int)}
    return out


def check_kimi_tokenizer(config: ServerConfig, tokenizer: Any) -> None:
    """With a Kimi parser selected, ValueError naming the first of ``KIMI_MARKERS`` that does not encode to one
    token, is missing from or differs from the checkpoint's declared ids (``declared_token_ids``), does not
    decode back to itself, or (``<|im_end|>``) is not among the declared eos ids; no-op otherwise."""
    if not uses_kimi_parser(config):
        return
    import transformers

    path = config.model.model_path
    declared = declared_token_ids(path, tokenizer)
    eos = declared_eos_ids(path)
    for marker in KIMI_MARKERS:
        ids = list(tokenizer.encode(marker, add_special_tokens=False))
        problem = None
        if len(ids) != 1:
            problem = f"encodes {marker!r} to {len(ids)} tokens {ids[:8]}, not one"
        elif marker not in declared:
            problem = f"encodes {marker!r} to token {ids[0]}, but the checkpoint declares no such special token"
        elif ids[0] != declared[marker]:
            problem = f"encodes {marker!r} to token {ids[0]}, but the checkpoint declares it as {declared[marker]}"
        elif tokenizer.decode(ids, skip_special_tokens=False) != marker:
            problem = f"decodes token {ids[0]} to {tokenizer.decode(ids)!r}, not {marker!r}"
        elif marker == KIMI_EOS and eos and ids[0] not in eos:
            problem = f"encodes {marker!r} to token {ids[0]}, but the model's eos ids are {sorted(eos)}"
        if problem:
            raise ValueError(f"the tokenizer of {path} {problem}: the Kimi parsers (--tool-call-parser / "
                             f"--reasoning-parser kimi_k2) need each of {' '.join(KIMI_MARKERS)} as one token with "
                             f"the checkpoint's id. {TRANSFORMERS_KIMI_BUG}; transformers {transformers.__version__} "
                             "is installed")
