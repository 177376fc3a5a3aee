"""Build the speculative worker from SpeculativeArgs (None when speculation is off)."""

from __future__ import annotations

import logging

from model_executor.model_config import ModelConfig
from model_executor.model_runner import ModelRunner
from server.config import SpeculativeArgs

logger = logging.getLogger(__name__)


def build_spec_worker(args: SpeculativeArgs, runner: ModelRunner, model_config: ModelConfig):
    if not args.enabled:
        return None
    if args.algorithm not in ("dflash", "ddtree"):
        raise ValueError(f"speculative_algorithm must be 'none', 'dflash' or 'ddtree', got {args.algorithm!r}")
    from speculative.spec_worker import SpecWorker

    if args.lossy:
        logger.warning("speculative accept thresholds single=%g acc=%g are below 1: sampled verification is LOSSY "
                       "(outputs no longer follow the target distribution)", args.accept_threshold_single,
                       args.accept_threshold_acc)
    return SpecWorker.create(args.algorithm, args.draft_model_path, args.ddtree_budget, args.block_size, runner,
                             model_config, args.ddtree_max_budget,
                             (args.accept_threshold_single, args.accept_threshold_acc))
