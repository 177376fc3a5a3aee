"""What the speculative worker's size depends on, computed the same way by the worker (at load) and by
``ddtree-serve plan`` (from config.json alone): the drafter's ModelConfig, and the drafter block and tree
budget that size one step's workspace and temporary KV slots."""

from __future__ import annotations

from ddtree_serve.model_executor.model_config import ModelConfig


def drafter_model_config(path: str, target_config: ModelConfig, device: str) -> ModelConfig:
    """The DFlash drafter's ModelConfig as the worker builds it: the target's dtype, and a hidden size equal to
    the target's (ValueError otherwise). ``ddtree-serve plan`` builds the drafter from it too."""
    cfg = ModelConfig.load(path, "float32", device)
    cfg = ModelConfig(cfg.path, cfg.hf, cfg.architecture, cfg.eos_token_ids, target_config.dtype)
    if cfg.hidden_size != target_config.hidden_size:
        raise ValueError(f"drafter hidden size {cfg.hidden_size} != target hidden size {target_config.hidden_size}")
    return cfg


def step_shape(algorithm: str, budget: int | str, max_budget: int, block_size: int | None) -> tuple[int, int]:
    """(drafter block, tree budget) of the worker: the block is 1 without a drafter (``block_size`` None); the
    budget is the chain's depth (``block - 1``) for dflash, ``max_budget`` for ``auto``, else ``budget``. The
    scheduler sizes the step workspace from them, as ``ddtree-serve plan`` does."""
    block = block_size if block_size is not None else 1
    if algorithm == "dflash":
        return block, block - 1
    return block, max_budget if budget == "auto" else int(budget)


def resolve_block(configured: int | None, drafter: object) -> int:
    """The drafter block: ``speculative_block_size`` when set, else the drafter's own (its config's);
    ValueError below 2."""
    block = configured or int(drafter.block_size)  # type: ignore[attr-defined]
    if block < 2:
        raise ValueError(f"speculative_block_size must be >= 2, got {block}")
    return block
