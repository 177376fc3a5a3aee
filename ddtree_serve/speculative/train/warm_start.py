"""Warm start of drafter training from an exported z-lab-format DFlash drafter (``--init-drafter``).

The weights of a drafter directory (``config.json`` + ``model.safetensors``, as ``export.save_drafter`` writes
it, or the shipped drafter: ``default``) seed a fresh run; the optimizer and the learning-rate schedule start
afresh. The drafter must be the one the run asks for: same layer count, block size, target layer ids (the
data's), mask token and shapes (hidden, MLP, heads, vocabulary, target depth); anything else is refused
with every mismatch named. A run that already has ``trainer_state.pt`` resumes from it instead.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ddtree_serve.model_executor.models.dflash import DFlashDraftModel
from ddtree_serve.model_executor.weight_loader import iter_weights

# config.json fields that fix the drafter's shapes or semantics; (label, key in dflash_config or top level)
_MATCHED = (("num_layers", "num_hidden_layers"), ("block_size", "block_size"),
            ("target_layer_ids", "target_layer_ids"), ("mask_token_id", "mask_token_id"),
            ("hidden_size", "hidden_size"), ("intermediate_size", "intermediate_size"),
            ("num_attention_heads", "num_attention_heads"), ("num_key_value_heads", "num_key_value_heads"),
            ("head_dim", "head_dim"), ("vocab_size", "vocab_size"), ("num_target_layers", "num_target_layers"),
            ("attention_bias", "attention_bias"))


def resolve_init_drafter(path: str) -> str:
    """``default`` -> the shipped drafter's directory; otherwise ``path`` (absolute). FileNotFoundError when the
    directory lacks ``config.json`` or ``model.safetensors``."""
    if path == "default":
        from ddtree_serve.model_executor.default_drafter import default_drafter_path

        path = default_drafter_path()
    p = Path(path).resolve()
    for name in ("config.json", "model.safetensors"):
        if not (p / name).exists():
            raise FileNotFoundError(f"--init-drafter {path}: no {name} there (expected an exported DFlash drafter)")
    return str(p)


def _field(cfg: dict[str, Any], key: str) -> Any:
    """A drafter config field, read from ``dflash_config`` first (z-lab keeps ids and the mask token there)."""
    dflash = cfg.get("dflash_config") or {}
    value = dflash.get(key, cfg.get(key))
    if key == "head_dim" and value is None:
        value = int(cfg["hidden_size"]) // int(cfg["num_attention_heads"])
    if key == "num_key_value_heads" and value is None:
        value = cfg.get("num_attention_heads")
    if key == "attention_bias":
        value = bool(value)
    return list(value) if isinstance(value, (list, tuple)) else value


def init_drafter_config(path: str) -> dict[str, Any]:
    """The ``config.json`` of the drafter at ``path`` (a resolved directory)."""
    cfg = json.loads((Path(path) / "config.json").read_text())
    if "DFlashDraftModel" not in (cfg.get("architectures") or []):
        raise ValueError(f"--init-drafter {path}: config.json architectures {cfg.get('architectures')} is not "
                         "DFlashDraftModel (DFlash2 and other variants cannot seed this trainer)")
    return cfg


def check_init_drafter(init_cfg: dict[str, Any], want_cfg: dict[str, Any], what: str) -> None:
    """ValueError naming every field where the drafter ``what`` (config ``init_cfg``) differs from the requested
    ``want_cfg``."""
    bad = [f"{label}: drafter {_field(init_cfg, key)!r}, requested {_field(want_cfg, key)!r}"
           for label, key in _MATCHED if _field(init_cfg, key) != _field(want_cfg, key)]
    if bad:
        raise ValueError(f"{what} does not match the requested drafter (" + "; ".join(bad) + "); pass matching "
                         "--num-layers/--block-size/--mask-token-id and a data directory captured at the drafter's "
                         "target layers")


def load_init_drafter(model: DFlashDraftModel, want_cfg: dict[str, Any], path: str) -> None:
    """Check the drafter at ``path`` against ``want_cfg`` and copy its weights (bf16 -> the model's dtype)
    into ``model``; every parameter must be present."""
    check_init_drafter(init_drafter_config(path), want_cfg, f"--init-drafter {path}")
    model.load_weights(iter_weights(path, desc="Loading --init-drafter"))
