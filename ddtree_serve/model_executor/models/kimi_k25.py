"""Kimi K2.5 / K2.6 (``KimiK25ForConditionalGeneration``): the DeepSeek-V3 text model (``language_model.*``,
config ``text_config``) plus, when the checkpoint's ``vision_config`` describes one, the MoonViT vision tower
and its projector (models/moonvit.py, ``vision_tower.*`` / ``mm_projector.*``), replicated on every TP rank.

``vision`` is None for a checkpoint without a complete ``vision_config`` (no ``vt_hidden_size``), or when
``ModelConfig.vision`` is off (``--max-images-per-request 0``: no tower memory): its vision tensors are
skipped and the server refuses image inputs, as for any text-only model. ``embed_images`` turns
preprocessed images and video chunks (ddtree_serve/server/multimodal/) into rows of the text model's embedding space;
the scheduler writes them over the placeholder tokens' embeddings at prefill (docs/DESIGN.md, "Images").
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ddtree_serve.model_executor.model_config import ModelConfig
from ddtree_serve.model_executor.models.deepseek_v3 import DeepseekV3ForCausalLM
from ddtree_serve.model_executor.models.moonvit import (
    VISION_PREFIXES,
    KimiVision,
    encoder_peak_bytes,
    fused_attention_available,
    max_image_patches,
    max_vision_patches,
    read_vision_config,
)
from ddtree_serve.model_executor.parallel_state import TPGroup

logger = logging.getLogger(__name__)

_OTHER_VISION_PREFIXES = ("multi_modal_projector.", "vision_model.")


class KimiK25ForConditionalGeneration(DeepseekV3ForCausalLM):
    weight_prefix = "language_model."

    def __init__(self, config: ModelConfig, tp: TPGroup = TPGroup()):
        super().__init__(config, tp)
        vision_cfg, self.media_placeholder_token_id = read_vision_config(config.path)
        self.vision: KimiVision | None = None
        if vision_cfg is not None and config.vision:
            if vision_cfg.text_hidden_size != self.config.hidden_size:
                raise ValueError(f"vision_config.text_hidden_size {vision_cfg.text_hidden_size} != the text "
                                 f"model's hidden_size {self.config.hidden_size}")
            self.vision = KimiVision(vision_cfg, config.dtype)
            # the largest image the preprocessor admits, or video chunk (frames x per-frame patches) with video on
            self.max_image_patches = (max_vision_patches(config.path, vision_cfg.merge_kernel[0],
                                                         vision_cfg.pos_emb_time) if config.video
                                      else max_image_patches(config.path, vision_cfg.merge_kernel[0]))
        # the loader skips these before they reach load_weights (a vision tower, when built, takes its own)
        self.skip_weight_prefixes = _OTHER_VISION_PREFIXES + (() if self.vision is not None else VISION_PREFIXES)

    def text_parameters(self) -> dict[str, nn.Parameter]:
        return {k: v for k, v in self.named_parameters() if not k.startswith("vision.")}

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        vision: list[tuple[str, Any]] = []

        def text_only() -> Iterable[tuple[str, Any]]:
            for name, tensor in weights:
                if self.vision is not None and name.startswith(VISION_PREFIXES):
                    vision.append((name, tensor))
                else:
                    yield name, tensor

        super().load_weights(text_only())
        if self.vision is not None:
            self.vision.load_weights(vision)
            logger.info("KimiK25ForConditionalGeneration: vision tower (%d layers) and projector loaded (%d tensors)",
                        self.vision.cfg.num_layers, len(vision))

    def embed_images(self, pixel_values: list[torch.Tensor], grids: list[tuple[int, int, int]]) -> list[torch.Tensor]:
        """Image token embeddings [tokens_i, hidden] per image, in the text model's dtype."""
        if self.vision is None:
            raise ValueError("this checkpoint has no vision tower")
        dev = next(self.vision.parameters()).device
        embeds = self.vision.embed_images([pv.to(dev) for pv in pixel_values], grids)
        return [e.to(self.config.dtype) for e in embeds]

    def encoder_peak_bytes(self, device: torch.device | str | None = None) -> int:
        """The vision tower's activation peak for the largest image the checkpoint's preprocessor admits (0
        without a tower), with the attention kernel SDPA runs on ``device`` (default: the tower's): start-up
        sizing keeps it out of the KV pool (ddtree_serve/server/memory_sizing.py)."""
        if self.vision is None:
            return 0
        dev = device if device is not None else next(self.vision.parameters()).device
        return encoder_peak_bytes(self.vision.cfg, self.max_image_patches, self.config.dtype.itemsize,
                                  fused=fused_attention_available(dev))

    def _after_load(self, skipped: int) -> None:
        if self.vision is None:
            logger.info("KimiK25ForConditionalGeneration: serving the text model only (no complete vision_config, or "
                        "--max-images-per-request 0); %d tensors skipped", skipped)
