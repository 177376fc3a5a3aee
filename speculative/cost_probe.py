"""Start-up probe of the step-cost model: time real drafter and target-verify forwards on empty contexts.

Runs once when the worker is built (before any request holds KV): ``bs`` drafter blocks (plus the pops of
the largest budget) for the drafter table, tree-verify forwards over ``bs`` requests holding ``extra`` nodes
in all (causal chains under their roots) for the tree tables, and plain decode
forwards over ``bs`` one-token requests (target layers captured, as the worker's plain step, whose drafter
context writes are deferred and batched) for the plain table. Every slot and request row it takes is returned.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from model_executor.forward_batch import ForwardMode, build_forward_batch
from speculative.ddtree import pop_nodes
from speculative.step_cost import StepCostModel

if TYPE_CHECKING:
    from speculative.spec_worker import SpecWorker


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
    if r.slots.num_free < bs * worker.block_size:
        return None
    rows = _rows(worker, bs)
    if rows is None:
        return None
    try:
        idx = torch.tensor(rows, device=r.device)  # [bs]
        zeros = torch.zeros(bs, dtype=torch.int64, device=r.device)  # [bs]
        _sync(r.device)
        t = time.perf_counter()
        logits = worker._draft(idx, zeros, zeros)  # [bs, L, V]
        pop_nodes(logits, torch.full((bs,), worker.budget), chain=worker.chain)  # host copy: synchronises
        return time.perf_counter() - t
    finally:
        for i in rows:
            r.slots.free_row(i)


@torch.inference_mode()
def _time_verify(worker: SpecWorker, bs: int, extra: int) -> float | None:
    """A tree-verify step over ``bs`` requests holding ``extra`` nodes in all (spread evenly, each request a
    causal chain under its root), logits of every token included."""
    r = worker.runner
    lens = [1 + extra // bs + (i < extra % bs) for i in range(bs)]  # [bs] root + nodes
    n, d = sum(lens), max(lens)
    if r.slots.num_free < n:
        return None
    rows = _rows(worker, bs)
    if rows is None:
        return None
    idx = torch.tensor(rows, device=r.device)  # [bs]
    zeros = torch.zeros(bs, dtype=torch.int64, device=r.device)  # [bs]
    slots = r.slots.place(idx, zeros, torch.tensor(lens))  # [n]
    try:
        pos = torch.cat([torch.arange(k) for k in lens]).to(r.device)  # [n]
        mask = torch.ones(d, d, dtype=torch.bool, device=r.device).tril().expand(bs, d, d).contiguous()  # [bs, d, d]
        fb = build_forward_batch(
            ForwardMode.TARGET_VERIFY,
            torch.zeros(n, dtype=torch.int64, device=r.device),
            pos,
            slots,
            r.slots.table,
            idx,
            zeros,
            torch.tensor(lens),
            tree_mask=mask,
            capture_layer_ids=worker.capture_layer_ids,
        )
        _sync(r.device)
        t = time.perf_counter()
        out = r.forward(fb)
        r.logits(out.hidden)
        _sync(r.device)  # CUDA runs asynchronously: wait for the forward before reading the clock
        return time.perf_counter() - t
    finally:
        r.slots.free(slots)
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
        _sync(r.device)
        t = time.perf_counter()
        out = r.forward(fb)  # (the drafter context it captures is written later, in batches: deferred_context.py)
        r.logits(out.hidden).argmax(-1).tolist()  # the sampler's host copy: synchronises
        return time.perf_counter() - t
    finally:
        r.slots.free(fb.out_cache_loc)
        for i in rows:
            r.slots.free_row(i)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def probe_step_cost(worker: SpecWorker, cost: StepCostModel, seconds: float) -> None:
    tp = worker.runner.tp
    cost.probe(
        lambda bs: _time_draft(worker, bs),
        lambda bs: _time_plain(worker, bs),
        lambda bs, extra: _time_verify(worker, bs, extra),
        seconds,
        agree=lambda stop: bool(tp.broadcast_object(stop)),
    )
