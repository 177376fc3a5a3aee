"""Decode context parallelism under TP (gloo, 2 processes): TP=2 with ``decode_context_parallel_size=2`` gives
the same greedy tokens as TP=1 on the tiny Kimi (DeepSeek-V3 MLA, INT4 experts), plain and with DDTree, the
prefix cache on: three growing conversations over three turns, each turn's prompt sharing the previous turn's
tokens (cache hits, the same cached-token counts as TP=1), in a pool small enough to evict. Each rank's
cache holds half of the pool's tokens. DDTree runs the scripted draft source (tests/speculative/scripted_drafts.py)
and must accept depth >= 2 paths, so the commit compacts tree nodes whose KV lives on either rank. The plain
engine also decodes a seeded and an unseeded sampled request: every rank must agree (checked at shutdown)."""

from __future__ import annotations

import pytest
import torch

from ddtree_serve.model_executor.sampling_params import SamplingParams
from ddtree_serve.server.engine import Engine
from tests.model_executor.tiny_deepseek import VOCAB, write_tiny_deepseek
from tests.speculative.drafter_utils import write_random_drafter
from tests.speculative.scripted_drafts import greedy_script, install

POOL = 120  # tokens (60 per DCP rank): three conversations of up to ~50 tokens each must evict
SAMPLED = [SamplingParams(temperature=1.0, top_p=0.9, max_tokens=5, seed=7), SamplingParams(temperature=0.8,
                                                                                             max_tokens=5)]


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    root = tmp_path_factory.mktemp("dcp")
    path = str(write_tiny_deepseek(root / "kimi", int4=True, kimi=True).path)
    return path, write_random_drafter(path, root / "drafter", num_layers=1, block_size=4)


def _conversation(model: str, refs: dict, **kw) -> list[list[tuple[list[int], int]]]:
    """Three turns of three conversations -> per turn [(tokens, cached prompt tokens)]. A plain TP=1 run fills
    ``refs`` (prompt -> greedy tokens); a speculative run drafts with the scripted source around them."""
    eng = Engine(model, device="cpu", dtype="float32", max_total_tokens=POOL, max_running_requests=4, **kw)
    spec = install(eng, greedy_script(refs, VOCAB)) if kw.get("speculative_algorithm") else None
    g = torch.Generator().manual_seed(0)
    hist = [torch.randint(1, VOCAB - 2, (10 + 4 * i,), generator=g).tolist() for i in range(3)]
    params = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)] * 3
    log = []
    try:
        local = getattr(eng.scheduler, "scheduler", eng.scheduler)  # TP: rank 0's own scheduler
        dcp = kw.get("decode_context_parallel_size", 1)
        runner = local.runner
        assert runner.num_slots == POOL and runner.kv.k[0].shape[0] == POOL // dcp + 1, "each rank: 1/N of the pool"
        for _ in range(3):
            outs = eng.generate(input_ids=hist, sampling_params=params)
            log.append([(o.token_ids, o.cached_tokens) for o in outs])
            if spec is None and kw.get("tp_size", 1) == 1:
                refs.update({tuple(h): o.token_ids for h, o in zip(hist, outs, strict=True)})
            hist = [h + o.token_ids + [7, 8] for h, o in zip(hist, outs, strict=True)]
        if spec is None and kw.get("tp_size", 1) > 1:  # ranks must agree on sampled tokens too (shutdown check)
            eng.generate(input_ids=hist[:2], sampling_params=SAMPLED)
        assert local.kv.tree.evicted_tokens > 0, "the pool must be small enough to evict"
        if spec is not None:
            spec.assert_accepted()
    finally:
        eng.shutdown()  # TP: the consistency check over every step's outputs runs here
    return log


def test_tp2_dcp2_plain_equals_tp1_and_hits_the_prefix_cache(kimi) -> None:
    """The default-suite check (one TP=2 engine): two prompts, then one of them continued, which hits the prefix
    cache; tokens and cached-token counts equal TP=1's, and the ranks agree on a sampled request (shutdown)."""
    path, _ = kimi
    greedy = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)] * 2
    prompts = [[3, 17, 42, 99, 7, 8, 9], [5, 6, 7]]

    def run(**kw) -> list[tuple[list[int], int]]:
        eng = Engine(path, device="cpu", dtype="float32", max_total_tokens=64, max_running_requests=2, **kw)
        try:
            first = eng.generate(input_ids=prompts, sampling_params=greedy)
            again = [prompts[0] + first[0].token_ids + [11], prompts[1]]
            second = eng.generate(input_ids=again, sampling_params=greedy)
            if kw:
                eng.generate(input_ids=prompts[:1], sampling_params=SAMPLED[:1])
            return [(o.token_ids, o.cached_tokens) for o in (*first, *second)]
        finally:
            eng.shutdown()

    ref = run()
    assert ref[2][1] >= len(prompts[0]) + 5, "the continued prompt must hit the prefix cache"
    assert run(tp_size=2, decode_context_parallel_size=2) == ref


def test_tp2_dcp2_equals_tp1_plain_and_ddtree_with_prefix_cache(kimi) -> None:
    """Three engines of nine turns each: 13 s on 2 idle CPU cores (4 minutes when 7 agents share them)."""
    path, drafter = kimi
    refs: dict = {}
    ref = _conversation(path, refs)
    assert any(c > 0 for turn in ref[1:] for _, c in turn), "later turns must hit the prefix cache"
    dcp = dict(tp_size=2, decode_context_parallel_size=2)
    assert _conversation(path, refs, **dcp) == ref
    spec = _conversation(path, refs, speculative_algorithm="ddtree", draft_model_path=drafter, ddtree_budget=6,
                         **dcp)
    assert [[t for t, _ in turn] for turn in spec] == [[t for t, _ in turn] for turn in ref]


@pytest.mark.slow
def test_tp2_dcp2_triton_kernels_equal_tp1(kimi) -> None:
    """The DCP Triton kernel in the served model (Triton's interpreter on CPU: slow): TP=2 with DCP=2 and the
    Triton MLA kernels decodes TP=1's greedy tokens (torch reference), plain and with DDTree."""
    path, drafter = kimi
    prompts = [[3, 17, 42, 99, 7, 8, 9], [5, 6, 7]]
    greedy = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)] * 2

    def run(**kw) -> list[list[int]]:
        eng = Engine(path, device="cpu", dtype="float32", max_total_tokens=128, max_running_requests=2, **kw)
        spec = install(eng, greedy_script(refs, VOCAB)) if kw.get("speculative_algorithm") else None
        try:
            out = [o.token_ids for o in eng.generate(input_ids=prompts, sampling_params=greedy)]
            if spec is not None:
                spec.assert_accepted()
            return out
        finally:
            eng.shutdown()

    refs: dict = {}
    ref = run()
    refs.update({tuple(p): t for p, t in zip(prompts, ref, strict=True)})
    tri = dict(tp_size=2, decode_context_parallel_size=2, attention_backend="triton")
    assert run(**tri) == ref
    assert run(speculative_algorithm="ddtree", draft_model_path=drafter, ddtree_budget=6, **tri) == ref
