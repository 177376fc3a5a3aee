"""The DFlash drafter's forward as one CUDA graph replay (docs/DESIGN.md 4.17; issue 57 item 4).

The eager draft (``tree_forward.draft_forward``) places a temporary block of KV slots, builds a forward batch,
runs the drafter through the attention backend (flashinfer plans its custom-mask prefill on the host, so it cannot
be captured), frees the block and runs the LM head: ~220 launches and their Python a step. The graphed draft runs
``drafter.forward_block`` instead: device tensors of static shape in, the block's K/V kept as tensors (no slot
taken), attention by ``kernels/dflash_attention.py`` (on CUDA the Triton kernel, whose key loop is bounded by the
device's context lengths), so the whole draft (block embeddings -> drafter -> LM head on the B-1 mask rows) is
captured once per (padded batch size, ``local``) and replayed.

Static inputs per graph: request rows ``idx``, context lengths ``cached`` and roots ``[pad_bs]``, stacked in one
``[3, pad_bs]`` tensor. A replay copies the real batch into the leading columns and zeroes the rest: a padded row
is request row 0 with no context and root 0 (it reads only its own block; its logits are dropped). The logits
returned are a view ``[:bs]`` of the graph's static output ``[pad_bs, B-1, V]`` (``local``: V/tp columns, as
``ModelRunner.step_logits``), valid until that graph's next replay (the step builds its tree from them first).
Without a graph for the batch (graphs off, a larger batch) ``draft_forward`` runs eagerly as before.

Captures: ``CudaCapture`` on a GPU (the target graphs' protocol, a pool of its own), ``ReplayByRunning`` under the
simulated device (the region charged as one replay, a sync inside an error; the simulated drafter's
``forward_block`` queues its modelled cost as a graphed forward). Plain CPU runs eagerly (``graphed_draft``: None).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ddtree_serve.model_executor.kv_cache import KVCache
from ddtree_serve.model_executor.vocab_shard import VocabShard
from ddtree_serve.speculative.tree_graphs import ReplayByRunning


@dataclass
class _DraftGraph:
    inputs: torch.Tensor  # [3, pad_bs] int64: idx, cached, roots
    replay: Callable[[], torch.Tensor] | None = None  # -> logits [pad_bs, B-1, V or V/tp]


class DraftGraphs:
    """The drafter's forward replayed from captured graphs (module docstring); ``draft`` serves a batch that fits,
    ``tree_forward.draft_forward`` calls it."""

    def __init__(self, runner: Any, drafter: torch.nn.Module, draft_kv: KVCache, block_size: int, capture: Any,
                 batch_sizes: tuple[int, ...]) -> None:
        """``runner``: the target's ``ModelRunner`` (embeddings, LM head, slot table); ``drafter``: has
        ``forward_block``; ``capture``: a ``GraphCapture``; ``batch_sizes``: the padded sizes to capture."""
        self.runner, self.drafter, self.draft_kv, self.block_size = runner, drafter, draft_kv, block_size
        self.capture = capture
        self.batch_sizes = tuple(sorted(batch_sizes))
        self.graphs: dict[tuple[int, bool], _DraftGraph] = {}
        self.replays = 0  # drafts served by a graph

    def padded(self, bs: int) -> int | None:
        """The captured batch size that holds ``bs`` requests (None: none does, draft eagerly)."""
        return next((b for b in self.batch_sizes if b >= bs), None)

    def draft(self, idx: torch.Tensor, cached: torch.Tensor, roots: torch.Tensor,
              local: bool) -> tuple[torch.Tensor, VocabShard] | None:
        """``draft_forward``'s result from a replay: logits ``[bs, B-1, V]`` (``local``: this rank's ``V/tp``) and
        their shard; idx, cached, roots [bs] on the device. None when no captured size holds the batch."""
        bs = idx.size(0)  # (size, not shape: the simulated device counts a shape read as an op)
        pad_bs = self.padded(bs)
        if pad_bs is None or bs == 0:
            return None
        r = self.runner
        with torch.inference_mode():
            g = self.graphs.get((pad_bs, local)) or self._capture(pad_bs, local)
            g.inputs[:, :bs].copy_(torch.stack([idx, cached, roots]))  # [3, bs]
            if bs < pad_bs:
                g.inputs[:, bs:].zero_()  # padded rows: row 0, no context, root 0
            logits = g.replay()  # [pad_bs, B-1, V]
        self.replays += 1
        shard = r.vocab_shard if local else VocabShard.whole(r.config.vocab_size)
        return logits[:bs], shard

    def prepare(self, local: bool = True) -> int:
        """Capture every padded batch size's graph ahead of its first use (the warm-up); how many were new."""
        new = [b for b in self.batch_sizes if (b, local) not in self.graphs]
        with torch.inference_mode():
            for b in new:
                self._capture(b, local)
        return len(new)

    def _capture(self, pad_bs: int, local: bool) -> _DraftGraph:
        r, bsz = self.runner, self.block_size
        dev = r.device
        g = _DraftGraph(torch.zeros(3, pad_bs, dtype=torch.int64, device=dev))
        table, kv, drafter = r.slots.table, self.draft_kv, self.drafter
        mask_id = int(drafter.mask_token_id)
        offs = torch.arange(bsz, device=dev)  # [B] a constant of the graph

        def run() -> torch.Tensor:
            idx, cached, roots = g.inputs  # [pad_bs] each
            ids = torch.cat([roots[:, None], torch.full((pad_bs, bsz - 1), mask_id, device=dev)], 1)  # [pad_bs, B]
            positions = (cached[:, None] + offs).view(-1)  # [pad_bs*B]
            embeds = r.model.embed(ids.view(-1))  # [pad_bs*B, H]
            hidden = drafter.forward_block(ids.view(-1), embeds, positions, idx, cached, table, kv)  # [pad_bs*B, H]
            rows = hidden.view(pad_bs, bsz, -1)[:, 1:].reshape(pad_bs * (bsz - 1), -1)  # [pad_bs*(B-1), H]
            logits = r.step_logits(rows)[0] if local else r.logits(rows)  # [pad_bs*(B-1), V or V/tp]
            return logits.view(pad_bs, bsz - 1, -1)

        self.capture.warm_up(run)
        g.replay = self.capture.capture(run)
        self.graphs[(pad_bs, local)] = g
        return g


def graphed_draft(runner: Any, batch_sizes: tuple[int, ...], drafter: torch.nn.Module | None,
                  draft_kv: KVCache | None, block_size: int) -> DraftGraphs | None:
    """The graphed draft for a server with CUDA graphs on (``batch_sizes``): ``CudaCapture`` on a GPU,
    ``ReplayByRunning`` under the simulated device; None without graphs, a drafter with ``forward_block``, its
    cache, or an accelerator (a CPU drafts eagerly)."""
    if not batch_sizes or drafter is None or draft_kv is None or not hasattr(drafter, "forward_block"):
        return None
    if getattr(runner, "simulated", False):
        return DraftGraphs(runner, drafter, draft_kv, block_size, ReplayByRunning(), batch_sizes)
    if runner.device.type == "cuda":
        from ddtree_serve.model_executor.cuda_graph_runner import CudaCapture

        return DraftGraphs(runner, drafter, draft_kv, block_size, CudaCapture(), batch_sizes)
    return None
