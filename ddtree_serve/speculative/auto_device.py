"""The adaptive budget on the device path (docs/DESIGN.md 4.17, "The auto budget one read late").

On an accelerator every verify forward is padded: to the smallest captured width that holds the widest tree
(``tree_forward.padded_width``), or, built on the device, to one width for all. A padded step costs
``bs x width`` tokens whatever each request's own budget, so the best allocation gives every request the first
``b`` pops of its draft for one ``b`` (``allocation.choose_budgets(padded=True)``), and the choice among the widths
a graph holds is made from the mean gain curves the controller already keeps (``BudgetController.device_budget``)
before anything is drafted. The tree is then the fixed budget's: popped and assembled on the device, graphed,
drafted ahead of the previous step's read (``draft_ahead.py``), and the step reads back once.

What the controller learns comes with that one read: the tree's depths and log-weights (calibration), the
verification's reach (``verify.node_reach``) and the pops past the tree (``pop_width``: twice the budget, at least
``min_pops``; ``ddtree.build_device_tree`` keeps them), so the curve grows past the chosen width as the host pops
of ``BudgetController.pop_and_choose`` did. The step ahead is drafted at the budget chosen before this step's read
(its curve one step old): the choice acts one step late, like everything else the read feeds.

The step's time: the drafter of a step drafted ahead ran while the host waited for the previous step, so the
step is timed from the previous step's read to its own (one period of the pipeline) and priced against the
cost model with the drafter at the model's own price (``record(draft_measured=False)``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ddtree_serve.model_executor.memory import step_budget
from ddtree_serve.speculative.budget_config import BudgetConfig
from ddtree_serve.speculative.ddtree import DraftTree, PoppedNodes
from ddtree_serve.speculative.tree_forward import padded_width

TREE_READS = ("depths", "node_logws", "pop_depths", "pop_logws")  # the tree's fields the step's read carries


def pop_width(budget: int, config: BudgetConfig) -> int:
    """Pops a device-built auto step keeps past its ``budget`` (the curve's view beyond the chosen width)."""
    return min(config.max_budget, max(2 * budget, config.min_pops))


def allowed_budgets(verify_widths: dict[int, tuple[int, ...]], bs: int) -> np.ndarray | None:
    """The budgets a batch of ``bs`` may take: the captured widths of its padded batch size less the root
    (``verify_widths``: padded batch size -> widths); None (any) without a captured size for it."""
    pad_bs = next((b for b in verify_widths if b >= bs), None)
    if pad_bs is None:
        return None
    return np.asarray([w - 1 for w in verify_widths[pad_bs] if w >= 2], dtype=np.int64)


def tree_tensors(tree: DraftTree) -> dict:
    """The tree's tensors the step's read carries for the controller (``TREE_READS``; no pops past the tree
    where the budget is the widest already)."""
    return {name: getattr(tree, name) for name in TREE_READS if getattr(tree, name) is not None}


def learn_from_read(ctl: Any, tree: DraftTree, host: dict[str, np.ndarray], n_used: np.ndarray,
                    sampled: np.ndarray) -> None:
    """Give the controller (a ``BudgetController``) what the read brought: the tree's host arrays (so ``record``
    calibrates without reading the device) and the pops, for its gain curves."""
    tree.on_host = {"depths": host["depths"], "node_logws": host["node_logws"], "num_nodes": n_used}
    if "pop_depths" in host:
        depths, logws = host["pop_depths"], host["pop_logws"]  # [bs, P]
    else:  # the tree's own nodes are its pops (slot i + 1 = pop i)
        depths, logws = host["depths"][:, 1:], host["node_logws"][:, 1:].astype(np.float64)  # [bs, D - 1]
    logws = np.where(depths > 0, logws, -np.inf)  # [bs, P]
    zeros = np.zeros_like(depths)
    ctl.learn(PoppedNodes(tokens=zeros, parents=np.where(depths > 0, 0, -1), depths=depths, logws=logws,
                          counts=(depths > 0).sum(1)), sampled)


def device_budget(worker: Any, sampled: np.ndarray, cap: int | None, ahead: Any) -> int:
    """This step's budget for a device-built tree (``worker``: a ``SpecWorker``): the fixed one (under the verify
    cap ``cap``), or the auto budget's: the one the step ahead (``ahead``: a ``DraftAhead`` or None) was drafted
    at while its batch may still take it and it fits ``cap``, else ``BudgetController.device_budget``'s (rank 0's
    under TP)."""
    ctl, bs = worker.controller, len(sampled)
    if ctl is None:
        return worker.budget if cap is None else step_budget(worker.budget, bs, cap)
    allowed = allowed_budgets(worker.verify_widths, bs)
    if ahead is not None and (allowed is None or ahead.budget in allowed) and (cap is None or bs * ahead.width <= cap):
        return ahead.budget
    return int(worker.runner.tp.broadcast_object(ctl.device_budget(sampled, cap)))


def next_budget(worker: Any, sampled: np.ndarray, cap: int | None, current: tuple[int, int]) -> tuple[int, int]:
    """The budget and width the step ahead is drafted at: ``current`` (this step's) for a fixed budget; the auto
    budget's choice now, from the curve before this step's read (0: none fits ``cap``, or no curve yet: the next
    step is drafted after this step's read and chooses from the curve it brings, where a draft ahead would take
    the first draft's smallest tree a second time)."""
    ctl = worker.controller
    if ctl is None:
        return current
    b = int(worker.runner.tp.broadcast_object(ctl.device_budget(sampled, cap) if ctl.curve_steps.any() else 0))
    return b, padded_width(worker.verify_widths, len(sampled), 1 + b, cap) or b + 1


def step_times(ctl: Any, bs: int, step_s: float) -> tuple[float, float]:
    """A device-built step's (drafter, verify) seconds for ``BudgetController.record``: ``step_s`` with the drafter
    at the cost model's price (module docstring)."""
    draft_s = float(ctl.cost.draft.at(bs))
    return draft_s, step_s - draft_s


def tree_graph_keys(worker: Any) -> list[tuple]:
    """The tree-build graph keys a server's steps form (``DeviceTreeBuilder.build``), for the warm-up to capture:
    per captured batch size, each budget its steps may take (the fixed budget, lowered under the verify cap as for
    the batches it pads; or every allowed auto budget, with its pop width) at the captured width."""
    builder, ctl, r = worker.tree_builder, worker.controller, worker.runner
    if builder.capture is None or worker.drafter is None:
        return []
    k = 1 if worker.chain else min(worker.budget, r.vocab_shard.vocab)
    keys, lo = [], 0
    for pad_bs in builder.batch_sizes:
        if ctl is not None:
            allowed = allowed_budgets(worker.verify_widths, pad_bs)
            budgets = set(allowed.tolist()) if allowed is not None else set()
        else:
            cap = worker.max_verify_tokens
            budgets = {worker.budget if cap is None else step_budget(worker.budget, n, cap) for n in range(lo + 1,
                                                                                                            pad_bs + 1)}
        for budget in sorted(b for b in budgets if b >= 1):
            width = padded_width(worker.verify_widths, pad_bs, budget + 1, None) or budget + 1
            pops = 0 if ctl is None or worker.chain else pop_width(budget, ctl.config)
            keys.append((pad_bs, worker.depth_limit, k, budget, width, worker.chain, pops))
        lo = pad_bs
    return keys
