"""TP=2 (gloo, 2 processes) greedy output equals TP=1, with and without DDTree.

Per model, TP=1 without speculation is the reference; TP=2 runs without speculation and with DDTree over
a random drafter (speculative greedy is lossless, so it must match the same reference). Each TP=2 engine
also takes a seeded and an unseeded sampled request: their tokens are not compared to TP=1 (all-reduce
sums in another order), but every rank must agree (the consistency check runs at ``close``)."""

from __future__ import annotations

import pytest

from ddtree_serve.model_executor.sampling_params import SamplingParams
from ddtree_serve.server.engine import Engine
from tests.model_executor.tiny_deepseek import VOCAB, write_tiny_deepseek
from tests.speculative.drafter_utils import write_random_drafter
from tests.speculative.scripted_drafts import greedy_script, install
from tests.speculative.test_adaptive_engine import _set_costs

GREEDY = SamplingParams(temperature=0, max_tokens=8)
SAMPLED = [SamplingParams(temperature=1.0, top_p=0.9, max_tokens=6, seed=7),
           SamplingParams(temperature=0.8, max_tokens=6)]


def _run(model_path: str, prompts: list[list[int]], ref: list[list[int]] | None = None, vocab: int = 0,
         **kw) -> list[list[int]]:
    """Greedy tokens of ``prompts``; with ``ref`` (plain greedy tokens), rank 0's suffix proposer is the
    scripted draft source around them (tests/speculative/scripted_drafts.py) and the engine must accept
    depth >= 2 paths."""
    eng = Engine(model_path, device="cpu", dtype="float32", max_total_tokens=512, max_running_requests=8, **kw)
    log = install(eng, greedy_script({tuple(p): t for p, t in zip(prompts, ref, strict=True)}, vocab)) \
        if ref is not None else None
    if kw.get("ddtree_budget") == "auto":  # rank 0 decides: its costs frozen, a verified token nearly free
        _set_costs(eng, 1e-7)
    try:
        outs = eng.generate(input_ids=prompts, sampling_params=[GREEDY] * len(prompts))
        if kw.get("tp_size", 1) > 1:  # mixed greedy + sampled batch, seeds broadcast by rank 0
            eng.generate(input_ids=prompts[:2], sampling_params=SAMPLED)
        if log is not None:
            log.assert_accepted()
        return [o.token_ids for o in outs]
    finally:
        eng.shutdown()


def _check_model(model_path: str, drafter: str, prompts: list[list[int]], vocab: int, **par) -> None:
    ref = _run(model_path, prompts)
    assert all(len(t) > 0 for t in ref)
    assert _run(model_path, prompts, tp_size=2, **par) == ref
    spec = _run(model_path, prompts, ref, vocab, tp_size=2, speculative_algorithm="ddtree",
                draft_model_path=drafter, ddtree_budget=8, **par)
    assert spec == ref


def test_default_model_tp2_equals_tp1(tmp_path) -> None:
    from ddtree_serve.model_executor.default_model import ensure_default_model

    path = ensure_default_model()
    drafter = write_random_drafter(path, tmp_path / "drafter", num_layers=1, block_size=4)
    _check_model(path, drafter, [[1, 504, 3458, 314, 2137, 30], [1, 19556, 28, 314, 2418]], 49152)


def test_tiny_kimi_tp2_equals_tp1(tmp_path) -> None:
    ckpt = write_tiny_deepseek(tmp_path / "kimi", int4=True, kimi=True)
    path = str(ckpt.path)
    drafter = write_random_drafter(path, tmp_path / "drafter", num_layers=1, block_size=4)
    _check_model(path, drafter, [[3, 17, 42, 99, 7], [5, 6, 7], [11, 200, 300, 400, 12, 13]], VOCAB)


def test_tiny_kimi_tp2_expert_parallel_equals_tp1(tmp_path) -> None:
    """Expert parallelism: 4 whole experts per rank instead of half of every expert's intermediate dim."""
    ckpt = write_tiny_deepseek(tmp_path / "kimi", int4=True, kimi=True)
    path = str(ckpt.path)
    drafter = write_random_drafter(path, tmp_path / "drafter", num_layers=1, block_size=4)
    _check_model(path, drafter, [[3, 17, 42, 99, 7], [5, 6, 7], [11, 200, 300, 400, 12, 13]], VOCAB,
                 expert_parallel=True)


def test_tiny_kimi_tp2_auto_budget(tmp_path) -> None:
    """The adaptive budget under TP: rank 0 decides and broadcasts, so every rank builds the same trees; greedy
    equals TP=1 and the sampled requests agree across ranks (close()). Rank 0's costs are frozen so that it
    drafts (the scripted source's trees), whatever the machine's load."""
    ckpt = write_tiny_deepseek(tmp_path / "kimi", int4=True, kimi=True)
    path = str(ckpt.path)
    drafter = write_random_drafter(path, tmp_path / "drafter", num_layers=1, block_size=4)
    prompts = [[3, 17, 42, 99, 7], [5, 6, 7]]
    ref = _run(path, prompts)
    spec = _run(path, prompts, ref, VOCAB, tp_size=2, speculative_algorithm="ddtree", draft_model_path=drafter,
                ddtree_budget="auto", ddtree_max_budget=8)
    assert spec == ref


def test_dead_follower_fails_clearly() -> None:
    """Killing rank 1 makes rank 0 raise an error naming it (never a hang)."""
    from ddtree_serve.server.tp.errors import TPRankError

    eng = Engine("default", device="cpu", dtype="float32", max_total_tokens=256, tp_size=2)
    try:
        from ddtree_serve.server.scheduling.scheduler_factory import SchedulerLike

        assert isinstance(eng.scheduler, SchedulerLike)
        follower = eng.scheduler.followers[0]
        follower.kill()
        follower.join(10)
        with pytest.raises(TPRankError, match="rank 1"):
            eng.generate(input_ids=[[1, 504, 3458]], sampling_params=GREEDY)
    finally:
        eng.scheduler.close()
