"""Write randomly initialised z-lab-format DFlash drafters for a target checkpoint (test helper)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ddtree_serve.model_executor.model_config import ModelConfig
from ddtree_serve.model_executor.models.dflash import (
    DFlashDraftModel,
    default_target_layer_ids,
)
from ddtree_serve.speculative.train.export import drafter_config, save_drafter


def write_random_drafter(target_path: str, out_dir: str | Path, num_layers: int = 1, block_size: int = 8,
                         seed: int = 0, std: float = 0.05, conv_kernel_size: int = 0, **overrides) -> str:
    """``overrides``: config.json fields to change (e.g. ``num_key_value_heads``); ``conv_kernel_size`` > 0: DFlash2's
    convolution (``models/dflash_conv.py``, random taps like every other weight)."""
    target_hf = json.loads((Path(target_path) / "config.json").read_text())
    target_hf = target_hf.get("text_config", target_hf)
    n = int(target_hf["num_hidden_layers"])
    ids = sorted(set(default_target_layer_ids(n, min(3, n))))
    mask_id = int(target_hf["vocab_size"]) - 2
    cfg = {**drafter_config(target_hf, num_layers, block_size, ids, mask_id, conv_kernel_size=conv_kernel_size),
           **overrides}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg))
    model = DFlashDraftModel(ModelConfig.load(str(out), "float32"))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    save_drafter(model, cfg, out)
    return str(out)
