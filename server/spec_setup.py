"""Build the speculative worker from SpeculativeArgs (None when speculation is off)."""

from __future__ import annotations

from model_executor.model_config import ModelConfig
from model_executor.model_runner import ModelRunner
from server.config import SpeculativeArgs


def build_spec_worker(args: SpeculativeArgs, runner: ModelRunner, model_config: ModelConfig):
    if not args.enabled:
        return None
    if args.algorithm not in ("dflash", "ddtree"):
        raise ValueError(f"speculative_algorithm must be 'none', 'dflash' or 'ddtree', got {args.algorithm!r}")
    from speculative.spec_worker import SpecWorker

    return SpecWorker.create(args.algorithm, args.draft_model_path, args.ddtree_budget, args.block_size, runner,
                             model_config)
