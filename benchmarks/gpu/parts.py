"""What the GPU check's parts share: the context a part runs in (its scratch directory, the numbers it reports,
written as they come), the reason a part cannot run here, and small measuring helpers.

A part is a function ``part(ctx: PartContext) -> bool`` (True: PASS) in one of the ``benchmarks/gpu/checks_*``
modules. It puts its figures into ``ctx.numbers`` and the backends that ran into ``ctx.backend``, calls
``ctx.flush()`` after each step worth keeping (a part cut by its timeout still reports what it measured),
and raises ``NotAvailable`` when this machine lacks something it needs (a library, a second GPU).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from benchmarks.gpu_triton_check import sync, time_ms  # noqa: F401 (re-exported to the parts)

CKPT_DIR = "kimi_tp8"  # under the work directory: the checkpoint the ``checkpoint`` part writes
DRAFTER_DIR = "kimi_tp8_drafter"


class NotAvailable(Exception):
    """This machine cannot run the part (the message names what is missing)."""


@dataclass
class PartContext:
    """One part's run: ``work`` is shared scratch (the checkpoint lives there), ``result`` the JSON file the
    driver reads back, ``deadline`` the monotonic time the driver will stop the part at."""

    name: str
    work: Path
    result: Path
    deadline: float
    numbers: dict[str, Any] = field(default_factory=dict)
    backend: dict[str, str] = field(default_factory=dict)
    device: str = "cuda"  # "cpu" only in the CPU tests of the parts' helpers

    @property
    def checkpoint(self) -> str:
        return str(self.work / CKPT_DIR)

    @property
    def drafter(self) -> str:
        return str(self.work / DRAFTER_DIR)

    def left(self) -> float:
        """Seconds until the driver stops this part."""
        return self.deadline - time.monotonic()

    def flush(self, status: str = "RUNNING", reason: str = "") -> None:
        """Write what the part has so far (the driver reads it even if the part is killed)."""
        payload = {"status": status, "reason": reason, "numbers": self.numbers, "backend": self.backend}
        tmp = self.result.with_suffix(".tmp")
        tmp.write_text(json.dumps(payload, indent=1, default=str))
        tmp.replace(self.result)


def compare(got: torch.Tensor, want: torch.Tensor) -> dict[str, float]:
    """How close ``got`` is to ``want`` ([rows, vocab] logits or any tensor): max abs error, relative
    Frobenius error, cosine similarity, and (2-D) the share of rows with the same argmax; ``bitwise``."""
    g, w = got.float().flatten(1) if got.dim() > 1 else got.float()[None], \
        want.float().flatten(1) if want.dim() > 1 else want.float()[None]
    diff = (g - w).norm() / w.norm().clamp_min(1e-30)
    cos = torch.nn.functional.cosine_similarity(g.flatten(), w.flatten(), dim=0)
    return {"max_abs": float((g - w).abs().max()), "rel_fro": float(diff), "cosine": float(cos),
            "top1_agree": float((g.argmax(-1) == w.argmax(-1)).float().mean()),
            "bitwise": bool(torch.equal(got, want))}


def random_prompts(lengths: list[int], vocab: int, seed: int) -> list[list[int]]:
    """Seeded random prompts of the given lengths (ids 1 .. vocab - 3: not bos, eos nor the drafter's mask)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab - 2, (n,), generator=g).tolist() for n in lengths]


def checkpoint_vocab(path: str) -> int:
    cfg = json.loads((Path(path) / "config.json").read_text())
    return int(cfg.get("text_config", cfg)["vocab_size"])


def need_checkpoint(ctx: PartContext) -> None:
    if not (Path(ctx.checkpoint) / "config.json").exists():
        raise NotAvailable(f"no checkpoint at {ctx.checkpoint} (the checkpoint part writes it)")


def runner(ctx: PartContext, *, dtype: str = "bfloat16", attention: str = "triton", moe: str = "triton",
           kv: str = "auto", graphs: int = 0, max_reqs: int = 8, max_context: int = 4096,
           tokens: int = 16384):  # noqa: ANN201 - a ModelRunner
    """A ModelRunner on the Kimi-shaped checkpoint (INT4 experts resident)."""
    from ddtree_serve.model_executor.model_config import ModelConfig
    from ddtree_serve.model_executor.model_runner import ModelRunner

    need_checkpoint(ctx)
    cfg = ModelConfig.load(ctx.checkpoint, dtype, ctx.device, "packed", attention_backend=attention, moe_backend=moe,
                           kv_cache_dtype=kv)
    return ModelRunner(cfg, max_reqs=max_reqs, max_context=max_context, device=ctx.device, max_total_tokens=tokens,
                       cuda_graph_max_bs=graphs)


def engine(ctx: PartContext, *, ddtree: bool = False, **kw: Any):  # noqa: ANN201 - an Engine
    """An Engine on the Kimi-shaped checkpoint (Triton MLA and MoE unless ``kw`` says otherwise); ``ddtree``:
    with the checkpoint's random drafter."""
    from ddtree_serve.server.engine import Engine

    need_checkpoint(ctx)
    opts: dict[str, Any] = dict(device=ctx.device, dtype="bfloat16", attention_backend="triton", moe_backend="triton",
                                context_length=4096, max_total_tokens=16384)
    if ddtree:
        opts |= dict(speculative_algorithm="ddtree", draft_model_path=ctx.drafter, ddtree_budget=8)
    opts |= kw
    return Engine(ctx.checkpoint, **opts)


def engine_backends(eng: Any) -> dict[str, str]:  # noqa: ANN401 - an Engine
    """The attention / MoE backends an engine's target (and drafter) run."""
    sch = eng.scheduler
    cfg = sch.runner.config
    out = {"attention": str(cfg.attention_backend), "moe": str(cfg.moe_backend), "int4_experts": str(cfg.int4_experts),
           "kv_dtype": str(cfg.kv_dtype)}
    if sch.spec is not None:
        out["drafter_attention"] = type(sch.spec.draft_backend).__name__
    return out
