"""Plain decoding with the next step's forward launched before this step's tokens are read (docs/DESIGN.md 4.17,
"The plain decode ahead of the read"; SGLang's overlap scheduler and vLLM's async scheduling do the same).

A plain decode step's next forward needs nothing from the host but the tokens it samples: each running request
advances by exactly one position, so the next step's slots, positions and batch shape are the host's already,
and its input ids are this step's sampled tokens, on the device. So after sampling, the step starts its read of
the tokens without waiting (``read_back.read_later``), places one slot per request and launches the next forward
over the sampled tokens, and only then waits: the host's stop checks, output and scheduling run while the device
runs that forward, instead of leaving the device idle between forwards.

The forward launched ahead (``DecodeAhead``) belongs to the next decode step of the same requests: it is used when
that step's batch is the same requests in the same order with the ``num_cached`` it assumed. Otherwise (a
request finished, was aborted or retracted; a prefill added requests) its slots are freed and the step runs its
own forward; its KV writes, queued before anything that could reuse the slots, are harmless. Sampling stays in
the step that uses the forward, after the previous step's tokens were processed, so penalties, grammars, seeds
(position-keyed) and logprobs see exactly what plain decoding sees.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ddtree_serve.model_executor.forward_batch import ForwardBatch
from ddtree_serve.model_executor.kv_slots import KVSlots
from ddtree_serve.model_executor.models.output import ModelOutput
from ddtree_serve.model_executor.read_back import read_later


@dataclass
class DecodeAhead:
    """A decode forward launched for requests ``rids`` at ``cached`` (their ``num_cached``), not yet used."""

    rids: tuple[str, ...]
    cached: tuple[int, ...]
    fb: ForwardBatch
    out: ModelOutput

    def fits(self, reqs: Sequence[Any]) -> bool:
        return self.rids == tuple(q.rid for q in reqs) and self.cached == tuple(q.num_cached for q in reqs)

    def release(self, slots: KVSlots) -> None:
        """Free the slots the forward wrote (it will not be used)."""
        slots.free(self.fb.out_cache_loc)


def plain_decode(sched: Any, batch: Any) -> list[list[int]]:
    """One plain decode step of ``sched`` (a ``Scheduler``) over ``batch``: the forward launched ahead by the
    previous step when it fits, else its own (room made first, which may retract requests from the batch);
    sampling; the next forward launched ahead; the tokens read. Returns one token per request."""
    r, reqs = sched.runner, batch.reqs
    ahead, sched.decode_ahead = sched.decode_ahead, None
    if ahead is not None and ahead.fits(reqs):
        out = ahead.out
    else:
        if ahead is not None:
            ahead.release(r.slots)
        sched._make_room(batch, 1)
        fb = r.prepare_decode([q.req_pool_idx for q in reqs], [q.num_cached for q in reqs],
                              [q.output_ids[-1] for q in reqs], params=[q.params for q in reqs])
        assert fb is not None, "room was made"
        out = r.forward(fb)
    r.wait_device()
    for q in reqs:
        q.num_cached += 1
        q.spec_plain_steps += 1
    tokens = sched._sample_device(reqs, *r.step_logits(out.hidden))  # [bs] on the device
    pending = read_later(tokens)
    if sched.launch_ahead and r.accelerated and r.slots.num_free >= 2 * len(reqs):  # room for the next one's too
        sched.decode_ahead = launch_ahead(r, reqs, tokens)
    return [[t] for t in pending.wait()[0].tolist()]


def launch_ahead(r: Any, reqs: Sequence[Any], tokens: torch.Tensor) -> DecodeAhead:
    """The next decode forward over ``tokens`` [bs] (device), every request one position further (module docstring)."""
    cached = [q.num_cached for q in reqs]
    fb = r.prepare_decode([q.req_pool_idx for q in reqs], cached, tokens, params=[q.params for q in reqs])
    return DecodeAhead(tuple(q.rid for q in reqs), tuple(cached), fb, r.forward(fb))
