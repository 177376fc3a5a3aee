"""Warm start of drafter training from an exported z-lab-format DFlash drafter (``--init-drafter``).

The weights of a drafter directory (``config.json`` + ``model.safetensors``, as ``export.save_drafter`` writes
it, or the shipped drafter: ``default``) seed a fresh run; the optimizer and the learning-rate schedule start
afresh. The drafter must be the one the run asks for: same block size, target layer ids (the data's), mask
token and shapes (hidden, MLP, heads, vocabulary, target depth); anything else is refused with every
mismatch named. A run that already has ``trainer_state.pt`` resumes from it instead.

Growing in depth: a drafter of fewer layers than ``--num-layers`` seeds the first layers of the new one; every
added layer starts with zero output projections (attention ``o_proj`` and MLP ``down_proj``), so its residual
branches add nothing and the grown drafter computes exactly what the seed computes (the zero-initialised
residual branch of Goyal et al. 2017 / Fixup, used here as progressive stacking, Gong et al. 2019); training
then opens the new layer.

Adding the convolution (``--conv-kernel-size``, models/dflash_conv.py): a plain drafter seeds a conv drafter,
whose convolutions start as the identity, so it too starts by computing exactly what the seed computes. A conv
seed must have the requested kernel and group size, and cannot seed a plain drafter.

Layer kinds (models/dflash_window.py): a seed's sliding-window and causal layers (``layer_types``,
``use_sliding_window``, ``sliding_window``, ``max_window_layers``, ``is_causal``) carry over to the run, so it trains
the drafter the seed is (``seed_attention``); such a seed cannot be grown in depth (an added layer's kind would
be a guess).

Widening the KV heads (``--num-kv-heads``): a seed with fewer KV heads (a divisor of the requested count) seeds
each new KV head with the seed's head that its query heads read (``k_proj``/``v_proj`` rows repeated, as
grouped-query attention shares them), so the widened drafter too starts by computing exactly what the seed
computes; training then lets the copies differ.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ddtree_serve.model_executor.models.dflash import DFlashDraftModel
from ddtree_serve.model_executor.models.dflash_conv import check_no_candidate_selector, conv_settings
from ddtree_serve.model_executor.models.dflash_window import DraftAttention, layer_attention
from ddtree_serve.model_executor.weight_loader import iter_weights, load_named_weights

# config.json fields that fix the drafter's shapes or semantics; (label, key in dflash_config or top level)
_MATCHED = (("num_layers", "num_hidden_layers"), ("block_size", "block_size"),
            ("target_layer_ids", "target_layer_ids"), ("mask_token_id", "mask_token_id"),
            ("hidden_size", "hidden_size"), ("intermediate_size", "intermediate_size"),
            ("num_attention_heads", "num_attention_heads"), ("num_key_value_heads", "num_key_value_heads"),
            ("head_dim", "head_dim"), ("vocab_size", "vocab_size"), ("num_target_layers", "num_target_layers"),
            ("attention_bias", "attention_bias"), ("conv_kernel_size", "conv_kernel_size"),
            ("conv_group_size", "conv_group_size"))


ATTENTION_KEYS = ("layer_types", "use_sliding_window", "sliding_window", "max_window_layers", "is_causal")


def seed_attention(seed_cfg: dict[str, Any], want_cfg: dict[str, Any], what: str) -> dict[str, Any]:
    """``want_cfg`` with the layer kinds of the drafter ``what`` (config ``seed_cfg``: a warm start's seed or the
    run being resumed): its attention keys replace the requested ones (a plain seed changes nothing). ValueError
    when a seed with sliding or causal layers would be grown to more layers."""
    kinds = layer_attention(seed_cfg, what)
    if all(k == DraftAttention() for k in kinds):
        return want_cfg
    if len(kinds) != int(want_cfg["num_hidden_layers"]):
        raise ValueError(f"{what} has sliding-window or causal layers ({[(k.window, k.causal) for k in kinds]}); "
                         f"growing it to {want_cfg['num_hidden_layers']} layers (--num-layers) is not supported")
    out = {k: v for k, v in want_cfg.items() if k not in ATTENTION_KEYS}
    out.update({k: seed_cfg[k] for k in ATTENTION_KEYS if k in seed_cfg})
    return out


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
    if key in ("conv_kernel_size", "conv_group_size"):  # (0, None) without a convolution
        k, gs = conv_settings(cfg)
        value = k if key == "conv_kernel_size" else (gs or None)
    return list(value) if isinstance(value, (list, tuple)) else value


def init_drafter_config(path: str) -> dict[str, Any]:
    """The ``config.json`` of the drafter at ``path`` (a resolved directory)."""
    cfg = json.loads((Path(path) / "config.json").read_text())
    check_no_candidate_selector(cfg, f"--init-drafter {path}")
    if "DFlashDraftModel" not in (cfg.get("architectures") or []):
        raise ValueError(f"--init-drafter {path}: config.json architectures {cfg.get('architectures')} is not "
                         "DFlashDraftModel (DFlash2 and other variants cannot seed this trainer)")
    return cfg


def check_init_drafter(init_cfg: dict[str, Any], want_cfg: dict[str, Any], what: str, grow: bool = False) -> None:
    """ValueError naming every field where the drafter ``what`` (config ``init_cfg``) differs from the requested
    ``want_cfg``; with ``grow``, the seed may be a part of the requested drafter: fewer layers, or no convolution
    (the added parts start as identities)."""
    def differs(key: str) -> bool:
        have, want = _field(init_cfg, key), _field(want_cfg, key)
        if grow and key == "num_hidden_layers":
            return have > want
        if grow and key == "conv_kernel_size" and have == 0:
            return False
        if grow and key == "num_key_value_heads":  # a seed's KV heads repeat into more (load_init_drafter)
            return not (have and want and want % have == 0)
        if key == "conv_group_size" and (have is None or want is None):  # no convolution on one side
            return False
        return have != want

    bad = [f"{label}: drafter {_field(init_cfg, key)!r}, requested {_field(want_cfg, key)!r}"
           for label, key in _MATCHED if differs(key)]
    if bad:
        raise ValueError(f"{what} does not match the requested drafter (" + "; ".join(bad) + "); pass matching "
                         "--num-layers/--block-size/--mask-token-id/--conv-kernel-size/--conv-group-size/--num-kv-heads and a "
                         "data directory captured at the drafter's target layers")


def _repeat_kv_heads(weights: Iterator[tuple[str, Any]], repeat: int, head_dim: int
                     ) -> Iterator[tuple[str, Any]]:
    """The seed's weights with every ``k_proj``/``v_proj`` head (rows ``[Hkv * d, ...]``) repeated ``repeat``
    times in place: new KV head j is seed head j // repeat, the head its query heads read in the seed."""
    for name, w in weights:
        if repeat > 1 and name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias",
                                          "self_attn.v_proj.weight", "self_attn.v_proj.bias")):
            heads = w.view(-1, head_dim, *w.shape[1:])  # [Hkv, d, (H)]
            w = heads.repeat_interleave(repeat, dim=0).reshape(-1, *w.shape[1:])  # [Hkv * repeat * d, (H)]
        yield name, w


def load_init_drafter(model: DFlashDraftModel, want_cfg: dict[str, Any], path: str) -> int:
    """Check the drafter at ``path`` against ``want_cfg`` and copy its weights (bf16 -> the model's dtype)
    into ``model``; every parameter of its layers must be present. ``model``'s layers past the seed's start
    with zero output projections, and its convolutions that a plain seed lacks as the identity (the module
    docstring). Returns the number of layers added."""
    init_cfg = init_drafter_config(path)
    check_init_drafter(init_cfg, want_cfg, f"--init-drafter {path}", grow=True)
    n_init = int(init_cfg["num_hidden_layers"])
    seed_conv = conv_settings(init_cfg)[0] > 0
    added = [f"layers.{i}." for i in range(n_init, len(model.layers))]
    params = {n: p for n, p in model.named_parameters()
              if not n.startswith(tuple(added)) and (seed_conv or "_conv." not in n)}
    repeat = int(_field(want_cfg, "num_key_value_heads")) // int(_field(init_cfg, "num_key_value_heads"))
    head_dim = int(_field(init_cfg, "head_dim"))
    weights = _repeat_kv_heads(iter_weights(path, desc="Loading --init-drafter"), repeat, head_dim)
    load_named_weights(params, weights, model._STACKED,
                       f"--init-drafter {path}", skip_prefixes=model.skip_weight_prefixes)
    with torch.no_grad():
        for i, layer in enumerate(model.layers):
            if i >= n_init:
                layer.self_attn.o_proj.weight.zero_()
                layer.down_proj.weight.zero_()
            for conv in (layer.attention_conv, layer.mlp_conv):
                if conv is not None and (i >= n_init or not seed_conv):
                    conv.identity_()
    return len(added)
