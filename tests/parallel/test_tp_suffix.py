"""Suffix drafts under TP=2 (gloo) on the tiny Kimi (MLA, INT4 experts): rank 0 proposes them and broadcasts,
every rank verifies the same trees; greedy output equals TP=1 plain decoding and suffix nodes are accepted.

Acceptance on a random model: each prompt is generated twice by the same engine; the first output enters the
shared index of recent outputs (as an agent's repeated request would), so the second run's suffix drafts copy it
from its second token on (SuffixDecoding's cross-request case)."""

from __future__ import annotations

from ddtree_serve.model_executor.sampling_params import SamplingParams
from ddtree_serve.server.engine import Engine
from tests.model_executor.tiny_deepseek import write_tiny_deepseek
from tests.speculative.drafter_utils import write_random_drafter
from tests.speculative.scripted_drafts import install

PROMPTS = [[3, 17, 42, 99, 7], [5, 6, 7, 8]]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _twice(path: str, **kw):
    eng = Engine(path, device="cpu", dtype="float32", max_total_tokens=1024, max_running_requests=8, **kw)
    try:
        first = eng.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        return first, eng.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    finally:
        eng.shutdown()


def test_tiny_kimi_tp2_suffix_drafts_accept_and_match_tp1(tmp_path) -> None:
    ckpt = write_tiny_deepseek(tmp_path / "kimi", int4=True, kimi=True)
    path = str(ckpt.path)
    ref, _ = _twice(path)
    ref_ids = [o.token_ids for o in ref]
    drafter = write_random_drafter(path, tmp_path / "drafter", num_layers=1, block_size=4)
    for kw in ({"ddtree_budget": 6}, {"draft_model_path": drafter, "ddtree_budget": 8}):
        first, second = _twice(path, tp_size=2, speculative_algorithm="ddtree", **kw)
        assert [o.token_ids for o in first] == [o.token_ids for o in second] == ref_ids, kw
        assert all(o.spec_accepted_suffix >= 10 for o in second), [o.spec_accepted_suffix for o in second]
        assert max(o.acceptance_length for o in second) > 2.0, kw  # depth >= 2 paths committed


def test_tiny_kimi_tp2_seeded_sampling_equals_tp1_plain(tmp_path) -> None:
    """Seeded sampled requests under TP=2 with suffix drafts: token for token TP=1 plain decoding's output
    (position-keyed draws: every rank draws the same tokens, and speculation changes none), drafts accepted."""
    ckpt = write_tiny_deepseek(tmp_path / "kimi", int4=True, kimi=True)
    path = str(ckpt.path)
    sampled = [SamplingParams(temperature=0.8, top_k=50, seed=s, max_tokens=24, ignore_eos=True) for s in (3, 4)]
    plain = Engine(path, device="cpu", dtype="float32", max_total_tokens=1024, max_running_requests=8)
    try:
        ref = [o.token_ids for o in plain.generate(input_ids=PROMPTS, sampling_params=sampled)]
    finally:
        plain.shutdown()
    eng = Engine(path, device="cpu", dtype="float32", max_total_tokens=1024, max_running_requests=8, tp_size=2,
                 speculative_algorithm="ddtree", ddtree_budget=6)
    try:
        log = install(eng, None)  # rank 0's steps
        first = eng.generate(input_ids=PROMPTS, sampling_params=sampled)
        second = eng.generate(input_ids=PROMPTS, sampling_params=sampled)
    finally:
        eng.shutdown()
    assert [o.token_ids for o in first] == [o.token_ids for o in second] == ref
    assert all(o.spec_accepted_suffix >= 10 for o in second), [o.spec_accepted_suffix for o in second]
    assert max(log.accepted) >= 2
