"""The speculative step's tree built from pops read back to the host (docs/DESIGN.md 4.3, 4.11, 4.13): where the
host must see the pops before the tree exists: suffix drafts merged with DFlash's (``draft_sources.merge_popped``),
grammar-pruned drafts (``grammar.prune_popped``), the auto budget's per-request choice on a CPU
(``BudgetController.pop_and_choose``: ragged verify forwards), and every step on a CPU. An accelerator's DFlash
steps without those build on the device instead (``ddtree.build_device_tree``, ``auto_device.py``)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ddtree_serve.model_executor.grammar import draft_pop_budgets, prune_popped
from ddtree_serve.model_executor.memory import step_budget
from ddtree_serve.speculative.budget import DRAFT
from ddtree_serve.speculative.ddtree import DraftTree, PoppedNodes, assemble_tree, pop_nodes
from ddtree_serve.speculative.draft_sources import merge_popped, no_pops
from ddtree_serve.speculative.suffix_choice import choose_suffix
from ddtree_serve.speculative.tree_forward import padded_width


def host_tree(worker: Any, plan: int, draft: tuple[torch.Tensor | None, Any], suffix: PoppedNodes | None,
              sampled: np.ndarray, cap: int | None, max_depths: list[int], grammars: list, mask_drafts: bool,
              roots: torch.Tensor, cached: torch.Tensor) -> tuple[DraftTree, np.ndarray, int | None] | None:
    """The step's trees for ``worker`` (a ``SpecWorker``): its budgets (fixed, under the verify cap ``cap``; or the
    controller's, from these pops), then the tree assembled from the pops (``assemble_tree``) at the captured width
    that holds the widest (None: ragged). ``draft``: the drafter's logits ``[bs, L, V/tp]`` and their top-K, or
    (None, None) for a suffix-only step; ``suffix``: this step's suffix drafts or None; ``max_depths`` [bs]: depth
    caps. Returns (tree, nodes per tree [bs], width), or None when every tree is its root alone."""
    r, ctl, bs = worker.runner, worker.controller, len(sampled)
    draft_logits, topk = draft
    depths = torch.tensor(max_depths)  # [bs]
    scale = ctl.scale(sampled, suffix) if ctl is not None and suffix is not None else None

    def pop(width: int) -> PoppedNodes:  # best-first pops of both sources, grammar-pruned when masked
        widths = torch.full((bs,), width)  # [bs]
        wide = draft_pop_budgets(grammars, widths) if mask_drafts else widths  # [bs]
        popped = no_pops(bs)
        if draft_logits is not None:  # on an accelerator, batched device ops (ddtree_pop.py); else the heap
            popped = pop_nodes(draft_logits, wide, chain=worker.chain, max_depths=depths, topk=topk,
                               batched=r.accelerated)
        if suffix is not None:  # one best-first order over both (ddtree_serve/speculative/draft_sources.py)
            popped = merge_popped(popped, suffix, int(wide.max()), scale)
        return prune_popped(popped, grammars, widths) if mask_drafts else popped

    if ctl is not None and plan == DRAFT:  # pops only as many nodes as can matter to its choice
        popped, chosen = ctl.pop_and_choose(pop, sampled, cap, agree=r.tp.broadcast_object)
        budgets = torch.as_tensor(chosen)
    elif ctl is not None:  # suffix drafts alone: no drafter cost
        popped = pop(worker.budget)
        budgets = torch.as_tensor(np.asarray(r.tp.broadcast_object(choose_suffix(ctl, popped, sampled, cap))))
    else:  # fixed budget, under the verify-workspace cap: bs x (budget + 1) fits the workspace
        popped = pop(worker.budget)
        budgets = torch.full((bs,), worker.budget if cap is None else step_budget(worker.budget, bs, cap))  # [bs]
    n_used = np.minimum(budgets.numpy(), popped.counts)  # [bs] nodes per tree (the host's: assemble_tree's)
    if not (n_used > 0).any():
        return None
    pad = padded_width(worker.verify_widths, bs, 1 + int(n_used.max()), cap)  # captured width, or None: ragged
    return assemble_tree(popped, budgets, roots, cached, r.device, width=pad), n_used, pad
