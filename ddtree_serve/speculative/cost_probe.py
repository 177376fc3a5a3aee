"""Start-up probe of the step-cost model: time real drafter and target-verify steps on empty contexts.

Runs once, before any request holds KV and after the forwards' graphs exist (``SpecWorker.probe_cost``:
the scheduler calls it once its trees are padded for the graphs, or the warm-up once it captured them), so
it times the forwards the steps run: ``bs`` drafter blocks with their top-K and tree build (on the host: the
pops of the largest budget, read back; on an accelerator: the device-built tree of the largest budget a
graph holds, nothing read back, as the step's) for the drafter table; tree-verify steps over ``bs`` requests
holding ``extra`` nodes in all (chains under their roots: assembly, verify forward, greedy verification, a
drafter-context write; on an accelerator every request padded to the captured width that holds
``ceil(extra / bs)`` nodes, as a device-built step is) for the verify tables; plain decode forwards over
``bs`` one-token requests (target layers captured, as the worker's plain step, whose drafter context writes
are deferred and batched) for the plain table. Every slot and request row it takes is returned.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
import torch

from ddtree_serve.model_executor.forward_batch import HostShape
from ddtree_serve.model_executor.sampler import BatchSamplingInfo
from ddtree_serve.model_executor.sampling_params import SamplingParams
from ddtree_serve.speculative.auto_device import allowed_budgets
from ddtree_serve.speculative.ddtree import PoppedNodes, assemble_tree, draft_topk, pop_nodes
from ddtree_serve.speculative.step_cost import StepCostModel
from ddtree_serve.speculative.tree_forward import padded_width
from ddtree_serve.speculative.verify import verify_tree

GREEDY = SamplingParams(temperature=0.0)
PIPELINED = 3  # an accelerator's steps queued back to back, one wait: the device's time, as the pipelined step's



class SpecWorker(Protocol):
    """What the probe reads of the speculative worker (ddtree_serve/speculative/spec_worker.py, which calls the
    probe with itself): its shape, runner and drafter, and the three forwards of its step."""

    runner: Any  # ModelRunner
    drafter: Any  # the DFlash drafter, or None (suffix drafts alone)
    block_size: int
    budget: int
    chain: bool
    tree_depth: int
    capture_layer_ids: tuple[int, ...]
    verify_widths: dict[int, tuple[int, ...]]
    max_verify_tokens: int | None
    tree_builder: Any  # DeviceTreeBuilder

    def _draft(self, idx: torch.Tensor, cached: torch.Tensor, roots: torch.Tensor, max_cached: int) -> torch.Tensor: ...

    def _verify_forward(self, tree: Any, idx: torch.Tensor, cached: torch.Tensor) -> tuple[torch.Tensor, ...]: ...

    def _write_context(self, captured: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None: ...


def _rows(worker: SpecWorker, n: int) -> list[int] | None:
    kv = worker.runner.slots
    rows = []
    for _ in range(n):
        idx = kv.alloc_row()
        if idx is None:
            for i in rows:
                kv.free_row(i)
            return None
        rows.append(idx)
    return rows


@torch.inference_mode()
def _time_draft(worker: SpecWorker, bs: int) -> float | None:
    r = worker.runner
    if worker.drafter is None:  # suffix drafts alone: no drafter forward
        return 0.0
    if r.slots.num_free < bs * worker.block_size:
        return None
    rows = _rows(worker, bs)
    if rows is None:
        return None
    try:
        idx = torch.tensor(rows, device=r.device)  # [bs]
        zeros = torch.zeros(bs, dtype=torch.int64, device=r.device)  # [bs]
        _sync(r)
        t = r.host_now()
        for _ in range(PIPELINED if r.accelerated else 1):
            logits, shard = worker._draft(idx, zeros, zeros, 0, True)  # [bs, L, V/tp]
            topk = draft_topk(logits, 1 if worker.chain else min(worker.budget, shard.vocab), shard)  # [bs, L, K]
            if r.accelerated:  # the device-built tree of the largest budget a graph holds, as the step's
                allowed = allowed_budgets(worker.verify_widths, bs)
                budget = int(allowed[-1]) if allowed is not None and allowed.size else worker.budget
                worker.tree_builder.build(topk, budget, [worker.block_size - 1] * bs, worker.chain, zeros, zeros,
                                          padded_width(worker.verify_widths, bs, budget + 1, None) or budget + 1)
            else:
                r.wait_device()  # the pops read the draft (as SpecWorker.decode)
                pop_nodes(logits, torch.full((bs,), worker.budget), chain=worker.chain, topk=topk)  # host copy
        _sync(r)
        return (r.host_now() - t) / (PIPELINED if r.accelerated else 1)
    finally:
        for i in rows:
            r.slots.free_row(i)


def _chain_pops(bs: int, extra: int, depth_limit: int) -> PoppedNodes:
    """``extra`` nodes spread evenly over ``bs`` requests, each request's nodes in chains of at most
    ``depth_limit`` under its root (the depths a real tree can reach)."""
    counts = np.array([extra // bs + (i < extra % bs) for i in range(bs)], dtype=np.int64)  # [bs]
    width = int(counts.max(initial=0))
    j = np.arange(width)  # [B] pop index
    depths = np.broadcast_to(1 + j % depth_limit, (bs, width)).copy()  # [bs, B]
    parents = np.broadcast_to(np.where(j % depth_limit == 0, 0, j), (bs, width)).copy()  # [bs, B] slot j = pop j-1
    used = j[None, :] < counts[:, None]  # [bs, B]
    return PoppedNodes(tokens=np.zeros((bs, width), dtype=np.int64), parents=np.where(used, parents, -1),
                       depths=np.where(used, depths, 0), logws=np.where(used, 0.0, -np.inf), counts=counts)


@torch.inference_mode()
def _time_verify(worker: SpecWorker, bs: int, extra: int) -> float | None:
    """A tree-verify step over ``bs`` requests holding ``extra`` nodes in all (spread evenly, chains under
    each root; on an accelerator padded, module docstring): the tree's assembly, the verify forward with its
    logits, greedy verification and the drafter-context write of one kept token per request, as
    ``SpecWorker.decode`` runs them."""
    r = worker.runner
    width = None  # ragged (a CPU step); on an accelerator the uniform width of a device-built tree
    if r.accelerated:
        width = padded_width(worker.verify_widths, bs, 1 + -(-extra // bs), None) or 1 + -(-extra // bs)
    host = HostShape(bs * width, width, width) if width else None
    if r.slots.num_free < (host.tokens if host else bs + extra):
        return None
    rows = _rows(worker, bs)
    if rows is None:
        return None
    idx = torch.tensor(rows, device=r.device)  # [bs]
    zeros = torch.zeros(bs, dtype=torch.int64, device=r.device)  # [bs] tokens and positions
    popped = _chain_pops(bs, bs * (width - 1) if width else extra, max(worker.tree_depth, 1))
    slots = None
    try:
        tree = assemble_tree(popped, torch.as_tensor(popped.counts), zeros, zeros, r.device, width=width)
        _sync(r)
        t = r.host_now()
        for _ in range(PIPELINED if width else 1):  # (a step's tree is built on the device: not timed here)
            logits, captured, slots = worker._verify_forward(tree, idx, zeros, host, width is not None)  # [bs, D, V]
            if width is None:
                r.wait_device()
            info = BatchSamplingInfo.build([GREEDY] * bs, logits.shape[-1], r.device)
            res = verify_tree(tree, logits, info.temperature, info.top_k, info.top_p, info.is_greedy, None,
                              want_reach=True, greedy_only=info.greedy_only, maybe=info.maybe)
            if width is None:
                res.accept_length.tolist()  # the commit's host copy: synchronises
                res.node_reach.cpu()  # the controller's copy (spec_worker)
            d = slots.shape[1]
            if captured is not None:  # (no drafter: no context)
                worker._write_context(captured[torch.arange(bs, device=r.device) * d], zeros, slots[:, 0])
            if width is not None:  # padded: every slot was placed (freed behind the forward, as the commit's)
                r.slots.free(slots.view(-1))
                slots = None
        _sync(r)
        return (r.host_now() - t) / (PIPELINED if width else 1)
    finally:
        if slots is not None:
            r.slots.free(slots[slots >= 0])
        for i in rows:
            r.slots.free_row(i)


@torch.inference_mode()
def _time_plain(worker: SpecWorker, bs: int) -> float | None:
    r = worker.runner
    if r.slots.num_free < bs:
        return None
    rows = _rows(worker, bs)
    if rows is None:
        return None
    zeros = [0] * bs  # tokens and positions
    fb = r.prepare_decode(rows, zeros, zeros, worker.capture_layer_ids)  # [bs] slots placed
    try:
        _sync(r)
        t = r.host_now()
        out = r.forward(fb)  # (the drafter context it captures is written later, in batches: deferred_context.py)
        r.wait_device()
        r.logits(out.hidden).argmax(-1).tolist()  # the sampler's host copy: synchronises
        return r.host_now() - t
    finally:
        r.slots.free(fb.out_cache_loc)
        for i in rows:
            r.slots.free_row(i)


def _sync(runner: Any) -> None:
    """Nothing queued on the device before a timing starts (a simulated device's backlog included)."""
    runner.synchronize()


def probe_step_cost(worker: SpecWorker, cost: StepCostModel, seconds: float) -> None:
    tp = worker.runner.tp
    with worker.runner.device_session():  # a simulated device charges the probe's host acts as a step's
        _probe(worker, cost, seconds, tp)


def _probe(worker: SpecWorker, cost: StepCostModel, seconds: float, tp: Any) -> None:
    cost.probe(
        lambda bs: _time_draft(worker, bs),
        lambda bs: _time_plain(worker, bs),
        lambda bs, extra: _time_verify(worker, bs, extra),
        seconds,
        agree=lambda stop: bool(tp.broadcast_object(stop)),
    )
