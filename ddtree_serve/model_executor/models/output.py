"""What a model forward returns."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ModelOutput:
    hidden: torch.Tensor  # [T, H] final-normed hidden states (logits come from compute_logits)
    captured: torch.Tensor | None  # [T, n_layers * H] outputs of fb.capture_layer_ids, in that order


def capture_hidden(captured: list[torch.Tensor], layer_ids: tuple[int, ...]) -> torch.Tensor | None:
    """Concatenate captured layer outputs in the order of ``layer_ids`` (collected in layer order)."""
    if not layer_ids:
        return None
    order = sorted(set(layer_ids))
    by_id = dict(zip(order, captured, strict=True))
    return torch.cat([by_id[i] for i in layer_ids], dim=-1)
