"""A scheduler step that raises fails only its batch's requests and leaks no KV (ddtree_serve/server/scheduling/step_recovery.py).

A real ``Scheduler`` over a tiny random Llama (plain decoding, and DDTree with a random drafter whose trees
are merged with the scripted draft source's, so accepted paths are exercised) is stepped by hand; the step's
target forward, the logits projection right after it (KV written, counts advanced), the drafter's forward (the
draft block's slots placed) or the speculative commit (right after it moved the accepted path's slots and
freed the rest) is made to raise once. After the recovery every KV slot is free or counted by a live request,
the survivors finish with exactly the tokens they produce without any failure, and new requests run.
"""

from __future__ import annotations

import pytest

from ddtree_serve.model_executor.model_runner import ModelRunner
from ddtree_serve.model_executor.sampling_params import SamplingParams
from ddtree_serve.server.config import ServerConfig
from ddtree_serve.server.io_struct import GenerateReq
from ddtree_serve.server.scheduling.scheduler import Scheduler
from ddtree_serve.server.scheduling.step_recovery import fail_step, orphaned_rids
from tests.speculative.scripted_drafts import greedy_script, install

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


class Fault:
    """Arms a one-shot exception in the scheduler's target forward (``where="forward"``: no KV written
    yet), in the logits projection after it (``"logits"``: KV written, ``num_cached`` advanced), in the
    drafter's forward (``"drafter"``: the draft block's slots placed) or in the speculative commit
    (``"commit"``: raised right after ``drop_tree`` freed the slots the commit did not keep)."""

    def __init__(self, s: Scheduler, where: str) -> None:
        self.armed = False
        self.fired = 0
        obj, name = {"forward": (s.runner, "forward"), "logits": (s.runner, "logits"),
                     "drafter": (s.spec.drafter if s.spec else None, "forward"),
                     "commit": (s.runner.slots, "drop_tree")}[where]
        inner = getattr(obj, name)

        def call(*args, **kw):  # noqa: ANN002, ANN003, ANN202
            out = inner(*args, **kw) if where == "commit" else None
            if self.armed:
                self.armed = False
                self.fired += 1
                raise RuntimeError("injected step failure")
            return out if where == "commit" else inner(*args, **kw)

        setattr(obj, name, call)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from tests.conftest import write_tiny_llama_family
    from tests.speculative.drafter_utils import write_random_drafter

    target = write_tiny_llama_family(tmp_path_factory.mktemp("tiny-llama"), "llama")
    return target, write_random_drafter(target, tmp_path_factory.mktemp("drafter"), num_layers=1, block_size=4)


def _scheduler(models, algorithm: str, chunk: int = 512, cache: bool = True) -> Scheduler:
    """DDTree drafts with the scripted source around plain greedy tokens (tests/speculative/scripted_drafts.py),
    so its steps accept depth-2 paths and reject nodes; the step log is ``s.step_log``."""
    target, drafter = models
    spec = dict(speculative_algorithm="ddtree", speculative_draft_model_path=drafter,
                speculative_ddtree_budget=8) if algorithm == "ddtree" else {}
    s = Scheduler(ServerConfig.from_flat(dict(model_path=target, dtype="float32", device="cpu", context_length=256,
                                              max_running_requests=4, max_total_tokens=2048,
                                              chunked_prefill_size=chunk, disable_radix_cache=not cache, **spec)))
    if algorithm == "ddtree":
        refs = {tuple(p): _reference(models, "none", p) for p in (_prompt(1), _prompt(2, 14), _prompt(4))}
        s.step_log = install(s, greedy_script(refs, 256))
    return s


def _prompt(seed: int, n: int = 10) -> list[int]:
    return [(seed * 31 + 7 * i) % 250 + 1 for i in range(n)]


def _step(s: Scheduler, outs: dict[str, list[int]]) -> None:
    for o in s.step():
        outs.setdefault(o.rid, []).extend(o.token_ids)


def _drain(s: Scheduler, outs: dict[str, list[int]]) -> None:
    while s.has_work():
        _step(s, outs)


def _used_by_live(s: Scheduler) -> int:
    return sum(q.num_cached for q in list(s.waiting) + s.running if q.req_pool_idx is not None)


def _held(s: Scheduler) -> set[int]:
    """Slots a live request counts (``num_cached``) or the prefix cache holds."""
    table = s.runner.slots.table
    held = {x for q in list(s.waiting) + s.running if q.req_pool_idx is not None
            for x in table[q.req_pool_idx, :q.num_cached].tolist()}
    if s.kv.tree is not None:
        s.kv.tree.check()
        held |= set(s.kv.tree.held_slots().tolist())
    return held


def _assert_accounting(s: Scheduler) -> None:
    """Every allocated KV slot is counted by a live request or held by the prefix cache; every request-table
    row belongs to a live request."""
    slots = s.runner.slots
    assert set(slots.allocated().tolist()) == _held(s)
    live_rows = sum(q.req_pool_idx is not None for q in list(s.waiting) + s.running)
    assert slots.max_rows - slots.num_free_rows == live_rows


def _all_free(s: Scheduler) -> bool:
    """No request holds KV: every slot is free or a cached prefix."""
    return s.runner.slots.num_free + s.kv.cached_tokens == s.runner.slots.num_slots


def _reference(models, algorithm: str, prompt: list[int]) -> list[int]:
    s = _scheduler(models, algorithm)
    outs: dict[str, list[int]] = {}
    s.add_request(GenerateReq("ref", prompt, GREEDY))
    _drain(s, outs)
    return outs["ref"]


@pytest.mark.parametrize("where", ["forward", "logits"])
@pytest.mark.parametrize("algorithm", ["none", "ddtree"])
def test_failed_prefill_spares_the_running_request(models, algorithm, where) -> None:
    s = _scheduler(models, algorithm)
    fault = Fault(s, where)
    outs: dict[str, list[int]] = {}
    s.add_request(GenerateReq("a", _prompt(1), GREEDY))
    _step(s, outs)  # a's prefill
    _step(s, outs)  # one decode step
    s.add_request(GenerateReq("b", _prompt(2, 14), GREEDY))
    fault.armed = True
    with pytest.raises(RuntimeError, match="injected"):
        s.step()  # b's prefill (prefill goes first)
    assert fail_step(s) == ["b"]
    assert [q.rid for q in s.running] == ["a"] and not s.waiting
    assert orphaned_rids(s, {"a", "b"}) == ["b"]  # the loop errors b; a is still held
    _assert_accounting(s)
    _drain(s, outs)
    assert outs["a"] == _reference(models, "none", _prompt(1)) and "b" not in outs
    _assert_accounting(s)
    assert _all_free(s)
    if algorithm == "ddtree":
        s.step_log.assert_accepted()


@pytest.mark.parametrize("cache", [True, False], ids=["cache", "nocache"])
@pytest.mark.parametrize("algorithm,where", [("none", "forward"), ("none", "logits"), ("ddtree", "forward"),
                                             ("ddtree", "logits"), ("ddtree", "drafter"), ("ddtree", "commit")])
def test_failed_decode_fails_its_batch_and_the_server_goes_on(models, algorithm, where, cache) -> None:
    s = _scheduler(models, algorithm, cache=cache)
    fault = Fault(s, where)
    outs: dict[str, list[int]] = {}
    for rid, seed in (("a", 1), ("b", 2)):
        s.add_request(GenerateReq(rid, _prompt(seed), GREEDY))
    _step(s, outs)  # both prefilled in one batch
    fault.armed = True
    allocated = s.runner.slots.num_slots - s.runner.slots.num_free
    with pytest.raises(RuntimeError, match="injected"):
        s.step()  # the decode batch of a and b
    assert fault.fired == 1
    if where in ("drafter", "commit"):  # the step had taken slots (draft block; kept path) when it failed
        assert s.runner.slots.num_slots - s.runner.slots.num_free > allocated
    assert sorted(s.fail_step()) == ["a", "b"] and not s.has_work()
    _assert_accounting(s)
    assert _all_free(s)
    s.add_request(GenerateReq("c", _prompt(4), GREEDY))
    _drain(s, outs)
    assert outs["c"] == _reference(models, "none", _prompt(4))
    assert _all_free(s)
    if algorithm == "ddtree":
        s.step_log.assert_accepted()


@pytest.mark.parametrize("where", ["forward", "logits"])
def test_failed_prefill_chunk_frees_the_earlier_chunks(models, where) -> None:
    s = _scheduler(models, "none", chunk=16)
    fault = Fault(s, where)
    outs: dict[str, list[int]] = {}
    s.add_request(GenerateReq("long", _prompt(5, 40), GREEDY))
    _step(s, outs)  # chunk 1 of 3: the request stays at the head of the queue with 16 cached tokens
    assert s.waiting[0].num_cached == 16
    if where == "logits":  # only the last chunk projects logits (its first token): fail that one
        _step(s, outs)
        assert s.waiting[0].num_cached == 32
    fault.armed = True
    with pytest.raises(RuntimeError, match="injected"):
        s.step()
    assert fail_step(s) == ["long"]
    assert not s.waiting and not s.running and not s.has_work()
    assert _all_free(s)
    _assert_accounting(s)




def test_offline_engine_fails_the_call_and_serves_on(models, monkeypatch) -> None:
    """The offline Engine (one process) recovers too: the call whose step failed raises, the next call works
    and no KV is held (the test-only hook, ddtree_serve/server/scheduling/fault_injection.py, fails steps over token 200)."""
    from ddtree_serve.server.engine import Engine
    from ddtree_serve.server.scheduling.fault_injection import TEST_FAULT_ENV

    target, _ = models
    monkeypatch.setenv(TEST_FAULT_ENV, "forward:200")
    eng = Engine(target, device="cpu", dtype="float32", max_total_tokens=512, max_running_requests=4)
    try:
        with pytest.raises(RuntimeError, match="scheduler step running this request failed"):
            eng.generate(input_ids=[_prompt(1), [3, 200, 9]], sampling_params=GREEDY)  # one batch: both fail
        assert [o.token_ids for o in eng.generate(input_ids=[_prompt(1)], sampling_params=GREEDY)] == \
            [_reference(models, "none", _prompt(1))]
        s = eng.scheduler
        assert not s.has_work() and s.runner.slots.num_free + s.kv.cached_tokens == s.runner.slots.num_slots
    finally:
        eng.shutdown()


@pytest.mark.parametrize("where", ["forward", "logits"])
def test_failed_decode_with_a_forward_launched_ahead(models, where, monkeypatch) -> None:
    """On an accelerator each plain decode step launches the next one's forward before it reads its tokens
    (server/scheduling/decode_ahead.py): a step that fails with one launched (and while launching the next) frees
    its slots exactly once, and serving goes on."""
    monkeypatch.setattr(ModelRunner, "accelerated", property(lambda self: True))
    s = _scheduler(models, "none")
    fault = Fault(s, where)
    outs: dict[str, list[int]] = {}
    for rid, seed in (("a", 1), ("b", 2)):
        s.add_request(GenerateReq(rid, _prompt(seed), GREEDY))
    _step(s, outs)  # both prefilled in one batch
    _step(s, outs)  # a decode step: the next forward launched ahead
    assert s.decode_ahead is not None
    fault.armed = True
    with pytest.raises(RuntimeError, match="injected"):
        s.step()  # uses the forward launched ahead, fails in its own (forward: launching the next; logits)
    assert sorted(s.fail_step()) == ["a", "b"] and s.decode_ahead is None and not s.has_work()
    _assert_accounting(s)
    assert _all_free(s)
    s.add_request(GenerateReq("c", _prompt(4), GREEDY))
    _drain(s, outs)
    assert outs["c"] == _reference(models, "none", _prompt(4))
    assert _all_free(s)
