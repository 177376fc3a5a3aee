"""The fixed budget's tree build as one CUDA graph replay (docs/DESIGN.md 4.17).

``ddtree.build_device_tree`` (the device pops and the tree's assembly: ~10 kernels per draft depth and ~4 per
pointer jump, ~250 launches at budget 16 and block 16) reads nothing back, copies nothing up and has shapes the
host knows, so it can be captured once per ``(padded batch size, depth, K, budget, width, chain)`` and replayed:
the host then pays one replay a step instead of every launch and its Python (SGLang captures its EAGLE draft
phase, tree building included, the same way).

Static inputs are per graph: top-K log-probs and tokens ``[pad_bs, L, K]``, per-request budgets, depth caps,
roots and root positions ``[pad_bs]``. A replay copies the real batch into the leading rows; padded rows get
budget 0 and depth cap 0 (no node: their rows are never read). The tree returned is a view of the graph's static
outputs, valid until that graph's next replay (the step that built it verifies and commits it before the next
step's build). Without a capture (graphs off, or a batch larger than the largest captured size) the same
function runs eagerly on the step's own tensors. The deepest-node bound of a graph is ``min(L, budget)`` (the
eager path uses the batch's depth caps): a looser bound only runs more pointer jumps.

Captures: ``CudaCapture`` on a GPU (the target's graphs' protocol, ddtree_serve/model_executor/cuda_graph_runner.py;
a pool of their own); under the simulated device ``ReplayByRunning``, whose replay runs the recorded function
inside ``kernels.dispatch.graph_replay`` (charged as one replay; a sync inside fails, as a capture would).
The warm-up captures the graphs a server will build with (``worker_graphs.capture_graphs``: every padded batch size
at each budget it may take, the auto budget's allowed ones included); any other key is captured at its first use
(a few milliseconds).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ddtree_serve.kernels.dispatch import graph_replay
from ddtree_serve.model_executor.uploads import upload
from ddtree_serve.speculative.ddtree import DraftTree, build_device_tree
from ddtree_serve.speculative.ddtree_pop import device_pairs


class ReplayByRunning:
    """A ``GraphCapture`` for the simulated device: the warm-up runs the function; the replay runs it again under
    ``graph_replay`` (one replay charged, a sync inside an error), on the static inputs' contents at replay
    time, as a graph replay does."""

    def warm_up(self, run: Callable[[], Any]) -> None:
        run()

    def capture(self, run: Callable[[], Any]) -> Callable[[], Any]:
        def replay() -> Any:
            with graph_replay():
                return run()

        return replay


@dataclass
class _TreeGraph:
    top_lp: torch.Tensor  # [pad_bs, L, K] float64
    top_ids: torch.Tensor  # [pad_bs, L, K] int64
    budgets: torch.Tensor  # [pad_bs] int64
    limits: torch.Tensor  # [pad_bs] int64
    roots: torch.Tensor  # [pad_bs] int64
    cached: torch.Tensor  # [pad_bs] int64
    replay: Callable[[], DraftTree] | None = None


class DeviceTreeBuilder:
    """Builds the fixed budget's trees on the device (``build``), replaying a captured graph where one fits."""

    def __init__(self, capture: Any = None, batch_sizes: tuple[int, ...] = ()) -> None:
        """``capture``: a ``GraphCapture`` (None: always eager); ``batch_sizes``: the padded sizes to capture."""
        self.capture = capture
        self.batch_sizes = tuple(sorted(batch_sizes))
        self.graphs: dict[tuple, _TreeGraph] = {}
        self.replays = 0  # builds served by a graph

    def build(self, topk: tuple[torch.Tensor, torch.Tensor], budget: int, max_depths: list[int] | torch.Tensor,
              chain: bool, roots: torch.Tensor, cached: torch.Tensor, width: int, pop_width: int = 0) -> DraftTree:
        """Every request's tree of ``budget`` nodes at ``width`` slots from its top-K ``[bs, L, K]``;
        ``max_depths`` [bs]: the depth caps, the host's list or a device tensor (a step drafted ahead of the
        read, whose caps follow from the previous step's accepted lengths); roots, cached [bs]: root tokens and
        positions (device); ``pop_width`` > budget: that many pops kept past the tree (``build_device_tree``)."""
        bs, depth_limit, k = topk[0].shape
        dev = topk[0].device
        if isinstance(max_depths, torch.Tensor):  # [bs] on the device: the host bounds the deepest node alone
            limits = max_depths.clamp(0, depth_limit)  # [bs]
            budgets = torch.where(limits > 0, budget, 0)  # [bs]
            deepest = min(depth_limit, budget)
        else:
            host = np.clip(np.asarray(max_depths, dtype=np.int64), 0, depth_limit)  # [bs]
            deepest = min(int(host.max()) if bs else 0, budget)
            limits = upload(torch.as_tensor(host), dev)
            budgets = upload(torch.as_tensor(np.where(host > 0, budget, 0).astype(np.int64)), dev)
        pad_bs = next((b for b in self.batch_sizes if b >= bs), None)
        pop_width = 0 if chain else pop_width
        if self.capture is None or pad_bs is None:  # eager, on the step's own tensors
            return build_device_tree(topk, budgets, limits, (budget, deepest, chain), roots, cached, width,
                                     None if chain else device_pairs(max(budget, pop_width), k, dev), pop_width)
        key = (pad_bs, depth_limit, k, budget, width, chain, pop_width)
        g = self.graphs.get(key) or self._capture(key, dev)
        g.budgets[bs:].zero_()  # padded rows: no node
        g.limits[bs:].zero_()
        g.budgets[:bs].copy_(budgets)
        g.limits[:bs].copy_(limits)
        g.top_lp[:bs].copy_(topk[0])
        g.top_ids[:bs].copy_(topk[1])
        g.roots[:bs].copy_(roots)
        g.cached[:bs].copy_(cached)
        tree = g.replay()
        self.replays += 1
        return dataclasses.replace(tree, **{name: getattr(tree, name)[:bs] for name in tree.row_fields()})

    def prepare(self, key: tuple, dev: torch.device) -> bool:
        """Capture the graph of ``key`` (``(pad_bs, depth, K, budget, width, chain, pop_width)``, as ``build``
        forms it) ahead of its first use (the warm-up: ``worker_graphs.capture_graphs``); whether one was captured."""
        if self.capture is None or key in self.graphs:
            return False
        self._capture(key, dev)
        return True

    def _capture(self, key: tuple, dev: torch.device) -> _TreeGraph:
        pad_bs, depth_limit, k, budget, width, chain, pop_width = key
        g = _TreeGraph(torch.zeros(pad_bs, depth_limit, k, dtype=torch.float64, device=dev),
                       torch.zeros(pad_bs, depth_limit, k, dtype=torch.int64, device=dev),
                       *(torch.zeros(pad_bs, dtype=torch.int64, device=dev) for _ in range(4)))
        pairs = None if chain else device_pairs(max(budget, pop_width), k, dev)  # constant inputs of the graph
        shape = (budget, min(depth_limit, budget), chain)

        def run() -> DraftTree:
            return build_device_tree((g.top_lp, g.top_ids), g.budgets, g.limits, shape, g.roots, g.cached, width,
                                     pairs, pop_width)

        self.capture.warm_up(run)
        g.replay = self.capture.capture(run)
        self.graphs[key] = g
        return g


def graphed_tree_builder(runner: Any, batch_sizes: tuple[int, ...]) -> DeviceTreeBuilder:
    """The builder for a server with CUDA graphs on (``batch_sizes``): captured with ``CudaCapture`` on a GPU, with
    ``ReplayByRunning`` under the simulated device, eager elsewhere (a CPU takes the host-built tree anyway)."""
    if getattr(runner, "simulated", False):
        return DeviceTreeBuilder(ReplayByRunning(), batch_sizes)
    if runner.device.type == "cuda":
        from ddtree_serve.model_executor.cuda_graph_runner import CudaCapture

        return DeviceTreeBuilder(CudaCapture(), batch_sizes)
    return DeviceTreeBuilder()
