"""The speculative worker's CUDA graphs, set up once at start-up (docs/DESIGN.md 4.17, "Graphs for trees"): its
verify trees padded to the widths the target's graphs hold, the drafter's and the tree build's graphs made and
captured ahead of their first use. Every function takes the ``SpecWorker`` (``spec_worker.py``)."""

from __future__ import annotations

from typing import Any

from ddtree_serve.speculative.auto_device import tree_graph_keys
from ddtree_serve.speculative.draft_graphs import graphed_draft
from ddtree_serve.speculative.tree_graphs import graphed_tree_builder


def pad_trees_to(worker: Any, widths: dict[int, tuple[int, ...]]) -> None:
    """Pad a verify forward to the smallest captured width (nodes + root per request) of its padded batch size
    (``widths``: padded batch size -> widths, ``cuda_graph_runner.verify_widths``) that holds its widest tree, so
    it replays a captured CUDA graph: the padding slots are the tree's unused slots (no link reaches them, never
    accepted), run through the forward and freed by the commit. A step with no such width, or whose padded trees
    would pass its verify cap, stays ragged (eager)."""
    worker.verify_widths = dict(sorted(widths.items()))  # ascending: the first that holds a batch


def pad_for_graphs(worker: Any, graph_batch_sizes: tuple[int, ...]) -> None:
    """With CUDA graphs on (``graph_batch_sizes``; after ``max_verify_tokens`` is set): pad to the widths the
    server captures (``cuda_graph_runner.serving_graph_keys``), and graph the tree build and the drafter."""
    if not graph_batch_sizes:
        return
    from ddtree_serve.model_executor.cuda_graph_runner import serving_graph_keys, verify_widths

    w = worker
    pad_trees_to(w, verify_widths(serving_graph_keys(graph_batch_sizes, w.capture_layer_ids, w.budget,
                                                     w.max_verify_tokens, w.auto)))
    w.tree_builder = graphed_tree_builder(w.runner, graph_batch_sizes)  # (speculative/tree_graphs.py)
    w.draft_graphs = graphed_draft(w.runner, graph_batch_sizes, w.drafter, w.draft_kv, w.block_size)


def capture_graphs(worker: Any) -> int:
    """The drafter's and the tree build's graphs captured ahead of their first use (the warm-up, after the
    target's: ``auto_device.tree_graph_keys``); how many were new."""
    n = worker.draft_graphs.prepare() if worker.draft_graphs is not None else 0
    return n + sum(worker.tree_builder.prepare(key, worker.runner.device) for key in tree_graph_keys(worker))
