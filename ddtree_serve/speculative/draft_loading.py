"""The speculative worker's draft sources, loaded from its settings: the DFlash drafter (on the target's ranks
and device, its block resolved) and the suffix-draft settings, whichever the sources name."""

from __future__ import annotations

import logging

import torch

from ddtree_serve.model_executor.model_config import ModelConfig
from ddtree_serve.model_executor.model_runner import ModelRunner, load_model
from ddtree_serve.model_executor.models.dflash import check_target_layers, drafter_group
from ddtree_serve.speculative.draft_sources import resolve_sources
from ddtree_serve.speculative.suffix_index import SuffixConfig
from ddtree_serve.speculative.types import SpecSettings
from ddtree_serve.speculative.worker_shape import drafter_model_config, resolve_block

logger = logging.getLogger(__name__)


def load_draft_sources(settings: SpecSettings, runner: ModelRunner, target_config: ModelConfig
                       ) -> tuple[torch.nn.Module | None, int, SuffixConfig | None]:
    """(drafter or None, its block or 0, suffix settings or None): the drafter at ``settings.draft_model_path`` (a
    resolved directory) loaded onto the target's ranks and device when the draft sources name DFlash."""
    has = settings.draft_model_path is not None  # auto (a config not from ddtree_serve/server/startup.py): sources from it
    sources = resolve_sources(settings.draft_sources, settings.algorithm, has).split(",")
    drafter, bsz, path = None, 0, settings.draft_model_path
    if "dflash" in sources:
        if path is None:
            raise ValueError("speculative_draft_model_path is unset (ddtree_serve/server/startup.py resolves 'default')")
        cfg = drafter_model_config(path, target_config, str(runner.device))
        group = drafter_group(cfg.hf, runner.tp)  # unsharded when its KV heads do not split over the ranks
        if group.size != runner.tp.size:
            logger.info("drafter: %s KV heads < tp_size %d: the drafter runs unsharded on every rank",
                        cfg.hf.get("num_key_value_heads"), runner.tp.size)
        drafter = load_model(cfg, group, runner.device)
        if hasattr(drafter, "share_device"):  # a simulated drafter runs on the target's modelled device
            drafter.share_device(runner.model)
        check_target_layers(drafter.target_layer_ids, target_config.num_layers, path)
        window, factor = settings.dflash_draft_window_size, settings.dflash_rope_attention_factor
        if window is not None or factor is not None:  # DFlashDraftModel.configure (a simulated one refuses)
            configure = getattr(drafter, "configure", None)
            if configure is None:
                raise ValueError(f"the drafter at {path} takes no dflash window or rope settings")
            configure(window, factor)
        bsz = resolve_block(settings.block_size, drafter)
    suffix = None
    if "suffix" in sources:
        suffix = SuffixConfig(settings.suffix_max_depth, settings.suffix_min_match, settings.suffix_max_match,
                              cache_tokens=settings.suffix_cache_tokens)
    logger.info("speculative %s: sources %s, drafter %s, block %d, budget %s (max %d)", settings.algorithm,
                settings.draft_sources, path if drafter is not None else None, bsz, settings.ddtree_budget,
                settings.ddtree_max_budget)
    return drafter, bsz, suffix
