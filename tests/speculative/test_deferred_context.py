"""Deferred drafter-context writes of plain decode steps: the drafter's cache after a flush equals the cache
that writing at every step gives, slots freed and reused while writes wait included."""

from __future__ import annotations

import torch

from ddtree_serve.model_executor.kv_cache import KVCache
from ddtree_serve.model_executor.model_config import ModelConfig
from ddtree_serve.model_executor.model_runner import load_model
from ddtree_serve.model_executor.parallel_state import TPGroup
from ddtree_serve.server.engine import Engine, SamplingParams
from ddtree_serve.speculative.deferred_context import DeferredContext
from tests.speculative.test_adaptive_engine import _set_costs
from tests.speculative.test_spec_engine import _assert_pool_full, _prompts, tiny

__all__ = ["tiny"]  # the module fixture, shared


def _drafter(path: str) -> torch.nn.Module:
    cfg = ModelConfig.load(path, "float32")
    return load_model(cfg, TPGroup(), torch.device("cpu"))


def test_flush_keeps_the_last_write_of_a_reused_slot(tiny):
    """Chunks written through DeferredContext give the cache of the same writes made one by one, in order:
    slot 1 written twice (a freed slot taken again) keeps its second features; ``max_tokens`` flushes."""
    _, drafter_path = tiny
    drafter = _drafter(drafter_path)
    width = len(drafter.target_layer_ids) * drafter.config.hidden_size
    g = torch.Generator().manual_seed(0)
    chunks = [(torch.randn(n, width, generator=g), torch.tensor(pos), torch.tensor(slots))
              for n, pos, slots in [(3, [0, 1, 2], [0, 1, 2]), (2, [3, 0], [3, 1]), (1, [4], [5])]]
    layout = drafter.kv_cache_layout()
    ref, got = (KVCache(layout, 8, torch.float32, torch.device("cpu")) for _ in range(2))
    for c, p, s in chunks:
        drafter.write_context(c, p, s, ref)
    deferred = DeferredContext(lambda c, p, s: drafter.write_context(c, p, s, got), max_tokens=6)
    for c, p, s in chunks[:2]:
        deferred.add(c, p, s)
    assert deferred.pending == 5 and all((k == 0).all() for k in got.k)  # nothing written yet
    deferred.add(*chunks[2])  # 6 tokens: flushed
    assert deferred.pending == 0 and not deferred.chunks
    for a, b in zip(ref.k + ref.v, got.k + got.v, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    drafter.write_context(*chunks[0], ref)  # slot 1 back to its first features: a real difference
    assert not torch.allclose(ref.k[0][1], got.k[0][1])


def test_engine_plain_steps_defer_and_match_immediate_writes(tiny):
    """Every step plain (no exploration): the worker defers the drafter context of its plain steps; requests
    finishing at different steps free slots that the others' next tokens take while the writes wait. After
    the flush the drafter's cache equals that of an engine writing at every step, and the tokens agree."""
    target, drafter = tiny
    prompts = _prompts(6, seed=7)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 20, 7, 14, 5, 18)]
    caches, outputs, reused = [], [], []
    for max_tokens in (1, 1 << 20):  # written at every step; deferred until the drafter next runs
        e = Engine(target, dtype="float32", max_total_tokens=96, speculative_algorithm="ddtree",  # a small pool:
                   draft_model_path=drafter, ddtree_budget="auto", ddtree_max_budget=4,  # freed slots come back
                   disable_radix_cache=True)
        spec = e.scheduler.spec
        spec.deferred.max_tokens = max_tokens
        _set_costs(e, 1.0)  # every step plain ...
        spec.controller.curve_steps[:] = 1  # ... a curve of zeros: no first draft to learn one ...
        spec.controller.explore_balance[:] = -float("inf")  # ... and no exploration: the drafter never runs
        outputs.append([o.token_ids for o in e.generate(input_ids=prompts, sampling_params=params)])
        slots = torch.cat([s for _, _, s in spec.deferred.chunks]) if spec.deferred.chunks else torch.tensor([])
        reused.append(slots.numel() - slots.unique().numel())
        spec.flush_context()
        caches.append([t.clone() for t in spec.draft_kv.k + spec.draft_kv.v])
        assert set(spec.controller.stats()["budget_counts"]) == {0} and "draft" not in spec.timer.totals
        _assert_pool_full(e)
    assert outputs[0] == outputs[1]
    assert reused[0] == 0 and reused[1] > 0  # slots were reused while their writes waited
    for a, b in zip(*caches, strict=True):  # float32 rounding only: a batched write projects more rows at once,
        # and a CPU BLAS may sum by the row count (AMD EPYC: 1.7e-6 abs); a wrong slot differs by O(1)
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    # a direct write (a prefill's context, a tree step's commit) lands after the writes still waiting
    feats = torch.randn(2, 3, len(spec.drafter.target_layer_ids) * spec.drafter.config.hidden_size)  # [2, T, F]
    pos, slots = torch.tensor([0, 1, 2]), torch.tensor([5, 6, 7])
    spec.deferred.add(feats[0], pos, slots)
    spec._write_context(feats[1], pos, slots)
    spec.flush_context()
    expect = KVCache(spec.drafter.kv_cache_layout(), 16, torch.float32, torch.device("cpu"))
    spec.drafter.write_context(feats[1], pos, slots, expect)
    torch.testing.assert_close(spec.draft_kv.k[0][slots], expect.k[0][slots], rtol=1e-6, atol=1e-6)
