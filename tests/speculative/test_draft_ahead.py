"""The next step's draft queued before this step's read (``speculative/draft_ahead.py``; docs/DESIGN.md 4.17):
a tree drafted ahead is taken only by the step it was drafted for, its rows selected for the requests that go on,
and an engine on the device path (as on a GPU) stays lossless with it: greedy and seeded output == plain decoding
with requests stopping inside a step (EOS, stop ids, max_tokens), joining mid-decode and hitting the prefix cache,
and no KV slot leaked."""

from __future__ import annotations

import functools

import pytest
import torch

from ddtree_serve.model_executor.model_runner import ModelRunner
from ddtree_serve.server.engine import Engine, SamplingParams
from ddtree_serve.speculative import draft_ahead
from ddtree_serve.speculative.ddtree import draft_topk
from ddtree_serve.speculative.draft_ahead import DraftAhead, select_trees
from ddtree_serve.speculative.tree_graphs import DeviceTreeBuilder
from tests.speculative.test_device_tree import FIELDS, _logits


class _Req:
    def __init__(self, rid: str, num_cached: int) -> None:
        self.rid, self.num_cached = rid, num_cached


def _build(logits: torch.Tensor, limits: list[int]):
    topk = draft_topk(logits.log_softmax(-1), 8)
    bs = logits.shape[0]
    roots = torch.arange(bs) + 3  # [bs]
    cached = torch.arange(bs) * 5 + 7  # [bs]
    return DeviceTreeBuilder().build(topk, 8, limits, False, roots, cached, 9), topk, roots, cached


def test_selected_rows_equal_the_trees_built_for_them() -> None:
    logits = _logits(4, 5, 40, seed=3)  # [bs, L, V]
    full, topk, roots, cached = _build(logits, [5, 2, 0, 4])
    rows = [3, 1, 0]
    sel = torch.tensor(rows)
    alone = DeviceTreeBuilder().build((topk[0][sel], topk[1][sel]), 8, [4, 2, 5], False, roots[sel], cached[sel], 9)
    got = select_trees(full, rows)
    for name in FIELDS:
        assert torch.equal(getattr(got, name), getattr(alone, name)), name


def test_device_depth_caps_equal_host_caps() -> None:
    logits = _logits(3, 5, 40, seed=4)
    host, topk, roots, cached = _build(logits, [5, 1, 3])
    dev = DeviceTreeBuilder().build(topk, 8, torch.tensor([5, 1, 3]), False, roots, cached, 9)
    for name in FIELDS:
        assert torch.equal(getattr(host, name), getattr(dev, name)), name


def test_a_draft_ahead_is_taken_only_where_it_fits() -> None:
    tree = _build(_logits(3, 5, 40, seed=5), [5, 5, 5])[0]
    ahead = DraftAhead(("a", "b", "c"), tree, 8, 9, {"a": 10, "b": 20, "c": 30})
    a, b, c = _Req("a", 10), _Req("b", 20), _Req("c", 30)
    assert ahead.take([a, b, c], 8, 9) == (tree, None)
    assert ahead.take([a, b, c], 7, 9) is None  # another budget
    assert ahead.take([a, b, c], 8, 17) is None  # another width
    assert ahead.take([a, b, _Req("d", 5)], 8, 9) is None  # a request it was not drafted for
    assert ahead.take([a, _Req("b", 19), c], 8, 9) is None  # a request whose cache is not what the draft assumed
    picked = ahead.take([c, a], 8, 9)  # b stopped: its row dropped, the others in the batch's order
    assert picked is not None and picked[1] == [2, 0] and torch.equal(picked[0].candidates, tree.candidates[[2, 0]])


def test_a_forward_launched_ahead_is_claimed_row_by_row() -> None:
    """The verify forward launched with the draft: a step that takes some rows gets their logits, captured features
    and slots, and the other rows' slots are freed (exactly once); one whose requests all left frees every slot."""
    from ddtree_serve.model_executor.forward_batch import HostShape
    from ddtree_serve.model_executor.kv_slots import KVSlots
    from ddtree_serve.speculative.tree_forward import VerifyInputs

    slots = KVSlots(64, 4, 32)
    placed = slots.alloc(3 * 4)  # [bs * D]: every slot of three padded trees of width 4
    tree = _build(_logits(3, 5, 40, seed=6), [3, 3, 3])[0]
    logits, captured = torch.randn(3, 4, 10), torch.randn(3 * 4, 2)  # [bs, D, V], [bs * D, C]

    def ahead() -> DraftAhead:
        prepared = VerifyInputs(None, torch.arange(12), placed, placed.view(3, 4), 12, HostShape(12, 4, 30))
        return DraftAhead(("a", "b", "c"), tree, 8, 4, prepared=prepared, launched=(logits, captured))

    free = slots.num_free
    host, lg, cap, kept = ahead().claim([2, 0], slots)
    assert (host.tokens, host.max_q, host.max_k) == (8, 4, 30) and slots.num_free == free + 4  # b's slots freed
    assert torch.equal(lg, logits[[2, 0]]) and torch.equal(cap, captured.view(3, 4, 2)[[2, 0]].reshape(8, 2))
    assert torch.equal(kept, placed.view(3, 4)[[2, 0]])
    slots.free(kept.reshape(-1))
    placed = slots.alloc(12)
    a = ahead()
    for rid in ("a", "b"):
        a.release(rid, slots)
    assert a.prepared is not None  # c may still take its row
    a.release("c", slots)
    assert a.prepared is None and a.launched is None and slots.num_free == 64
    assert a.claim(None, slots) is None


@pytest.fixture
def device_steps(monkeypatch) -> dict[str, int]:
    """The engine's runner reports an accelerator (its step takes the device paths, as on a GPU); counts the
    trees selected from a draft ahead and the verify forwards launched ahead that a step claimed."""
    seen = {"selected": 0, "claimed": 0}
    real, claim = draft_ahead.select_trees, draft_ahead.DraftAhead.claim

    def spy(tree, rows):
        seen["selected"] += 1
        return real(tree, rows)

    def claimed(self, rows, slots):
        out = claim(self, rows, slots)
        seen["claimed"] += out is not None
        return out

    monkeypatch.setattr(ModelRunner, "accelerated", property(lambda self: True))
    monkeypatch.setattr(draft_ahead, "select_trees", spy)
    monkeypatch.setattr(draft_ahead.DraftAhead, "claim", claimed)
    return seen


def _requests(eos: bool) -> list[SamplingParams]:
    """Greedy and seeded requests that end at different steps, inside a step's accepted path."""
    base = dict(ignore_eos=not eos)
    return [SamplingParams(temperature=0, max_tokens=9, **base),
            SamplingParams(temperature=0, max_tokens=40, stop_token_ids=(13, 30), **base),
            SamplingParams(temperature=0.7, top_p=0.9, seed=11, max_tokens=23, **base),
            SamplingParams(temperature=0, max_tokens=31, presence_penalty=0.5, **base),
            SamplingParams(temperature=0.8, top_k=20, seed=5, max_tokens=17, stop_token_ids=(28,), **base)]


KW = dict(dtype="float32", max_total_tokens=16384, max_running_requests=3)


@functools.lru_cache(maxsize=1)
def plain_refs(model_path: str) -> tuple[list, list, list]:
    """Five chat prompts, ``_requests(eos=True)`` and plain decoding's (tokens, finish reason) of each, over three
    running slots (shared by the device-path engine tests of this package)."""
    from benchmarks.common import CHAT_PROMPTS, chat_ids

    plain = Engine(model_path, **KW)
    try:
        ids = chat_ids(plain.tokenizer, CHAT_PROMPTS)[:5]
        params = _requests(eos=True)
        return ids, params, [(o.token_ids, o.finish_reason) for o in plain.generate(input_ids=ids,
                                                                                      sampling_params=params)]
    finally:
        plain.shutdown()


def test_engine_with_drafts_ahead_equals_plain(default_model_path, device_steps) -> None:
    """Five requests over three running slots (two join mid-decode after a prefill), twice (the second run hits
    the prefix cache): token for token plain decoding's, drafts accepted and taken ahead, no KV left held."""
    ids, params, refs = plain_refs(default_model_path)
    kw = KW
    spec = Engine(default_model_path, speculative_algorithm="ddtree", draft_model_path="default", ddtree_budget=16,
                  speculative_draft_sources="dflash", **kw)
    try:
        worker = spec.scheduler.spec
        for run in range(2):
            outs = spec.generate(input_ids=ids, sampling_params=params)
            assert [(o.token_ids, o.finish_reason) for o in outs] == refs, run
            assert sum(o.spec_accepted_tokens for o in outs) > 0, run
        assert worker.ahead_taken > 0 and device_steps["selected"] > 0 < device_steps["claimed"], device_steps
        st = spec.stats()
        assert st.running == 0 and st.waiting == 0
        assert st.kv_used_tokens == 0  # every slot is free or the prefix cache's (evictable)
        assert spec.scheduler.runner.slots.num_free + st.cache_held_tokens == st.kv_total_tokens
    finally:
        spec.shutdown()


def test_simulated_stops_inside_accepted_paths(tmp_path, device_steps, monkeypatch) -> None:
    """The simulated device (a drafter right 95% of the time: deep paths) with stop ids inside them: the commit
    trims the path at the stop after the read, the draft ahead for a stopped request is dropped (and the verify
    inputs prepared with it freed), the output is the known continuation up to the stop, and no slot is left
    held."""
    from ddtree_serve.model_executor.models.simulated import greedy_continuation
    from ddtree_serve.sim.checkpoint import write_simulated_pair
    from ddtree_serve.speculative import commit

    trims = []
    real = commit.find_stop

    def spy(tokens, *args):
        keep, reason = real(tokens, *args)
        trims.append(keep < len(tokens))
        return keep, reason

    monkeypatch.setattr(commit, "find_stop", spy)
    vocab, n = 512, 40
    target, drafter = write_simulated_pair(tmp_path, vocab=vocab, accept_prob=0.95)
    prompts = [[(7 * i + j) % 500 + 1 for j in range(5 + i % 3)] for i in range(12)]
    refs = [greedy_continuation(p, n, vocab) for p in prompts]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True,
                             stop_token_ids=(ref[5 + i % 9],) if i % 4 else ()) for i, ref in enumerate(refs)]
    eng = Engine(target, device="cpu", dtype="float32", max_running_requests=8, max_total_tokens=4096,
                 speculative_algorithm="ddtree", speculative_draft_model_path=drafter, ddtree_budget=8,
                 speculative_draft_sources="dflash")
    try:
        outs = eng.generate(input_ids=prompts, sampling_params=params)
        for o, ref, p in zip(outs, refs, params, strict=True):
            end = next((j + 1 for j, t in enumerate(ref) if t in p.stop_token_ids), n)
            assert o.token_ids == ref[:end] and o.finish_reason == ("stop" if end < n else "length")
        assert eng.scheduler.spec.ahead_taken > 0 and sum(trims) >= 3, (eng.scheduler.spec.ahead_taken, sum(trims))
        assert device_steps["selected"] > 0 < device_steps["claimed"], device_steps
        st = eng.stats()
        assert st.running == 0 and st.kv_used_tokens == 0
        assert eng.scheduler.runner.slots.num_free + st.cache_held_tokens == st.kv_total_tokens
    finally:
        eng.shutdown()
