"""TP=2 (gloo, 2 processes) equals TP=1 with the prefix cache on: every rank takes the same cache decisions
(match, insert, evict), so a conversation whose turns reuse their history, in a pool small enough to evict,
decodes the same tokens and reports the same cached prompt tokens. DDTree over a random drafter included."""

from __future__ import annotations

import pytest
import torch

from ddtree_serve.model_executor.sampling_params import SamplingParams
from ddtree_serve.server.engine import Engine
from tests.speculative.drafter_utils import write_random_drafter
from tests.speculative.scripted_drafts import greedy_script, install

VOCAB = 64


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests.conftest import write_tiny_llama_family

    root = tmp_path_factory.mktemp("tp-radix")
    target = write_tiny_llama_family(root / "target", "qwen3", vocab=VOCAB, seed=4)
    return target, write_random_drafter(target, root / "drafter", num_layers=1, block_size=4, seed=2)


def _conversation(model: str, refs: dict | None = None, **kw) -> list[list[tuple[list[int], int]]]:
    """Three turns of three growing conversations; ``refs`` (prompt -> plain greedy tokens, filled by a plain
    run): rank 0 drafts with the scripted source around them (tests/speculative/scripted_drafts.py) and must
    accept depth >= 2 paths."""
    eng = Engine(model, device="cpu", dtype="float32", max_total_tokens=96, max_running_requests=4, **kw)
    spec = install(eng, greedy_script(refs, VOCAB)) if kw.get("speculative_algorithm") else None
    g = torch.Generator().manual_seed(0)
    hist = [torch.randint(0, VOCAB - 2, (10 + 4 * i,), generator=g).tolist() for i in range(3)]
    params = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)] * 3
    log = []
    try:
        for _ in range(3):
            outs = eng.generate(input_ids=hist, sampling_params=params)
            log.append([(o.token_ids, o.cached_tokens) for o in outs])
            if spec is None and refs is not None:
                refs.update({tuple(h): o.token_ids for h, o in zip(hist, outs, strict=True)})
            hist = [h + o.token_ids + [7, 8] for h, o in zip(hist, outs, strict=True)]
        local = getattr(eng.scheduler, "scheduler", eng.scheduler)  # TP: rank 0's own scheduler
        assert local.kv.tree.evicted_tokens > 0, "the pool must be small enough to evict"
        if spec is not None:
            spec.assert_accepted()
    finally:
        eng.shutdown()  # TP: the consistency check over every step's outputs runs here
    return log


def test_tp2_equals_tp1_with_prefix_cache(tiny) -> None:
    target, drafter = tiny
    refs: dict = {}
    ref = _conversation(target, refs)
    assert any(c > 0 for turn in ref[1:] for _, c in turn)
    assert _conversation(target, tp_size=2) == ref
    spec = _conversation(target, refs, tp_size=2, speculative_algorithm="ddtree", draft_model_path=drafter,
                         ddtree_budget=6)
    assert [[t for t, _ in turn] for turn in spec] == [[t for t, _ in turn] for turn in ref]
