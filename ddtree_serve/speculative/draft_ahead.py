"""The next step's draft, queued before this step's read (docs/DESIGN.md 4.17, "The draft ahead of the read").

A fixed-budget step with DFlash drafts alone builds its tree on the device. What the next step's draft needs
from this one is on the device too: its roots are the last emitted tokens (``emitted_tokens[b, accept_length[b]]``),
their positions ``cached + accept_length + 1``, the depth caps ``remaining - 1 - (accept_length + 1)``, and the
drafter's context of the accepted path is written by the commit's device half (``commit.commit_paths``). So the
step queues the next step's drafter forward, top-K and tree build right after its own verification and commit,
starts its one read without waiting (``read_back.read_later``), queues the next step's verify forward over that
tree too (its tree slots placed: ``tree_forward.prepare_verify``, where they leave the next step its own room), and
only then waits: the host's launches of the next draft and forward run while the device still runs this step's
verify forward, and the device goes on into the next forward while the host reads, scans stops and schedules
(SGLang's spec v2 and vLLM's async scheduling overlap the same way). The next step's verification, which needs
the host's state after this step's tokens (penalties, sampling positions), stays in that step.

The tree drafted ahead belongs to the very next ``SpecWorker.decode`` call and to the requests of this batch: the
next step takes it (``take``) when it also runs the device-built tree at the same budget and width, its requests
are among these (a request that stopped, was aborted or retracted simply drops out: the tree's rows are
selected, and ``claim`` takes the forward's logits, captured features and slots of those rows and frees the
others' slots) and each one's ``num_cached`` is what the draft assumed. Anything else (a prefill step in between,
a grammar or suffix request joining, a plain step) discards it and frees the forward's slots (``drop_prepared``);
so do a failure (``step_recovery.fail_step``) and the last of its requests leaving (``release``). The slots' writes
were queued before anything that can reuse them, so freeing them never races the forward. A request that stops
inside this step gets a draft and a forward ahead that nobody uses; its KV past the stop is freed by the host
half of the commit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ddtree_serve.model_executor.forward_batch import HostShape
from ddtree_serve.model_executor.kv_slots import KVSlots
from ddtree_serve.model_executor.uploads import upload
from ddtree_serve.speculative.ddtree import DraftTree, draft_topk
from ddtree_serve.speculative.tree_forward import VerifyInputs, prepare_verify
from ddtree_serve.speculative.types import SpecRequest
from ddtree_serve.speculative.verify import VerifyResult


@dataclass
class DraftAhead:
    """A tree drafted ahead for the requests ``rids`` at ``budget`` nodes and ``width`` slots; ``expected``: each
    request's ``num_cached`` at the step that may use it (set once the drafting step's read has landed)."""

    rids: tuple[str, ...]
    tree: DraftTree
    budget: int
    width: int
    expected: dict[str, int] = field(default_factory=dict)
    prepared: VerifyInputs | None = None  # its verify forward's inputs, every tree slot placed (padded trees)
    launched: tuple[torch.Tensor, torch.Tensor | None] | None = None  # its logits [bs, D, V], captured [bs*D, C]
    released: set[str] = field(default_factory=set)  # requests that left the running set since

    @property
    def held(self) -> int:
        """KV slots its verify forward holds (placed ahead for the step that takes it)."""
        return self.prepared.tokens if self.prepared is not None else 0

    def release(self, rid: str, slots: KVSlots) -> None:
        """Request ``rid`` left the running set: once every drafted request has, the verify forward's slots are
        freed (no step will take them; a later step that takes some rows frees the others' then)."""
        self.released.add(rid)
        if self.released.issuperset(self.rids):
            self.drop_prepared(slots)

    def drop_prepared(self, slots: KVSlots) -> None:
        """Free the verify forward's tree slots (queued before any reuse: a launched forward's writes come first)."""
        if self.prepared is not None:
            slots.free(self.prepared.flat)
        self.prepared = self.launched = None

    def take(self, reqs: Sequence[SpecRequest], budget: int, width: int
             ) -> tuple[DraftTree, list[int] | None] | None:
        """The trees for ``reqs`` and the drafted rows they are (None: all, in order), or None when the draft does
        not fit this step."""
        if budget != self.budget or width != self.width:
            return None
        at = {rid: i for i, rid in enumerate(self.rids)}
        rows = [at.get(q.rid) for q in reqs]
        if any(i is None for i in rows) or any(q.num_cached != self.expected.get(q.rid) for q in reqs):
            return None
        if rows == list(range(len(self.rids))):
            return self.tree, None
        return select_trees(self.tree, rows), rows

    def claim(self, rows: list[int] | None, slots: KVSlots
              ) -> tuple[HostShape, torch.Tensor, torch.Tensor | None, torch.Tensor] | None:
        """The verify forward launched ahead, for the drafted ``rows`` a step took (``take``): its host shape, logits
        ``[bs, D, V]``, captured features ``[bs * D, C]`` or None and tree slots ``[bs, D]``, the other rows' slots freed; None when
        none was launched. The step owns the slots from here (its commit frees those it does not keep)."""
        if self.launched is None or self.prepared is None:
            return None
        p, (logits, captured) = self.prepared, self.launched
        self.prepared = self.launched = None
        if rows is None:
            return p.host, logits, captured, p.slots
        dev = logits.device
        gone = [i for i in range(len(self.rids)) if i not in set(rows)]
        if gone:  # padded trees: every slot of a row was placed
            slots.free(p.slots.index_select(0, upload(gone, dev, torch.int64)).view(-1))
        sel = upload(rows, dev, torch.int64)  # [bs']
        d = p.slots.shape[1]
        if captured is not None:  # [bs * D, C] rows of the padded layout
            captured = captured.view(len(self.rids), d, -1).index_select(0, sel).view(len(rows) * d, -1)
        return (HostShape(len(rows) * d, d, p.host.max_k), logits.index_select(0, sel), captured,
                p.slots.index_select(0, sel))


def select_trees(tree: DraftTree, rows: list[int]) -> DraftTree:
    """The trees of requests ``rows`` (in that order), as a batch of their own."""
    dev = tree.candidates.device
    sel = upload(rows, dev, torch.int64)  # [bs']
    bs, d = len(rows), tree.num_slots
    picked = {name: getattr(tree, name).index_select(0, sel) for name in tree.row_fields()}
    picked["retrive_index"] = torch.arange(bs * d, dtype=torch.int64, device=dev).view(bs, d)  # [bs', D]: global
    return replace(tree, on_host=None, **picked)


def next_inputs(res: VerifyResult, cached: torch.Tensor, remaining: list[int]
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The next step's roots, root positions and depth caps ``[bs]`` on the device, from this step's verification
    (every request assumed to go on: one that stops drops out of the next batch): the last emitted token, at
    ``cached + accept_length + 1``, with ``remaining - 1`` tokens left less those emitted now."""
    acc = res.accept_length  # [bs]
    roots = res.emitted_tokens.gather(1, acc[:, None]).squeeze(1)  # [bs]
    left = upload(remaining, cached.device, torch.int64)  # [bs] the host's, before this step
    return roots, cached + acc + 1, left - 1 - (acc + 1)


def draft_next(worker: Any, reqs: Sequence[SpecRequest], idx: torch.Tensor, cached: torch.Tensor, res: VerifyResult,
               budget: int, pad: int, max_cached: int, pop_width: int = 0) -> DraftAhead:
    """The next step's trees for ``worker`` (a ``SpecWorker``), queued now (module docstring): the drafter over
    the emitted roots, top-K, the device build at ``budget`` nodes and ``pad`` slots, and, where the slots leave
    the next step its own room, its verify forward's inputs. ``max_cached``: this step's largest root position;
    ``pop_width``: pops kept past the tree (the auto budget's, speculative/auto_device.py)."""
    roots, nxt, limits = next_inputs(res, cached, [q.remaining_tokens for q in reqs])  # [bs] each
    bs, r = len(reqs), worker.runner  # a bound on the next step's root positions, within the table's columns
    longest = min(max_cached + res.accept_index.size(1), r.slots.table.size(1) - worker.max_step_tokens)
    logits, shard = worker._draft(idx, nxt, roots, longest, True)  # [bs, L, V/tp]
    topk = draft_topk(logits, 1 if worker.chain else min(worker.budget, shard.vocab), shard)  # [bs, L, K]
    tree = worker.tree_builder.build(topk, budget, limits, worker.chain, roots, nxt, pad, pop_width)
    ahead = DraftAhead(tuple(q.rid for q in reqs), tree, budget, pad)
    if r.slots.num_free >= bs * (pad + worker.max_step_tokens):  # the verify forward too, where it leaves room
        host, params = HostShape(bs * pad, pad, longest + pad), [q.params for q in reqs]
        ahead.prepared = prepare_verify(r, tree, idx, nxt, worker.capture_layer_ids, host, True, params)
        logits, captured, _ = worker._verify_forward(tree, idx, nxt, host, True, params, ahead.prepared)
        ahead.launched = (logits, captured)
    worker.timer.lap("ahead")
    return ahead
