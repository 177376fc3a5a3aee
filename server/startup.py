"""Start-up resolution, done once before anything is built: the model and drafter paths and the device.

``resolve_config`` turns the user's configuration into a resolved one (``model_path`` and, with
speculation, ``speculative_draft_model_path`` are existing directories, the drafter's checked to be a DFlash
drafter for the target (``check_drafter``, before any weights load), ``"default"`` replaced by the
shipped model / drafter; ``device`` is ``cpu`` or ``cuda``). Everything below it (``make_scheduler``,
``Scheduler``, ``SpecWorker.create``, the TP ranks) reads those fields as they are and resolves nothing.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from server.config import ServerConfig, SpeculativeArgs, flat_name, is_default_path


def resolve_device(device: str) -> str:
    """``"auto"`` -> ``"cuda"`` when CUDA is available, else ``"cpu"``; any other value as given."""
    if device == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def resolve_model_path(path: str | None) -> str:
    """A local Hugging Face directory; ``"default"`` = SmolLM2-135M-Instruct, converted once into the cache."""
    if is_default_path(path):
        from model_executor.default_model import ensure_default_model

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
        from model_executor.default_drafter import default_drafter_path

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
        if problem is None and "DFlashDraftModel" not in (cfg.get("architectures") or []):
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
    ValueError naming it (a drafter path or block size without DFlash, a suffix bound without suffix drafts;
    ``default``, the shipped drafter's name, is the default model's implicit value and passes)."""
    sources = spec.draft_sources.split(",")
    unused = []
    if "dflash" not in sources:
        unused += ["speculative_draft_model_path"] * (not is_default_path(spec.draft_model_path))
        unused += ["speculative_block_size"] * (spec.block_size is not None)
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


def resolve_draft_sources(config: ServerConfig) -> str:
    """``auto`` -> ``dflash`` for the dflash algorithm; for ddtree ``dflash,suffix`` when a drafter is configured
    (a path, or the default model, whose drafter ships), ``suffix`` alone otherwise."""
    from speculative.draft_sources import resolve_sources

    spec = config.speculative
    drafter = spec.draft_model_path not in (None, "") or is_default_path(config.model.model_path)  # 'default' too
    return resolve_sources(spec.draft_sources, spec.algorithm, drafter)


def resolve_config(config: ServerConfig) -> ServerConfig:
    """The configuration with its paths and device resolved (idempotent), after refusing a model whose
    tokenizer needs remote code that is not trusted: all before any weights load or process starts."""
    from server.process_utils import check_trust_remote_code

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
