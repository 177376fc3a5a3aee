"""Suffix drafts under TP=2 (gloo) on the tiny Kimi (MLA, INT4 experts): rank 0 proposes them and broadcasts,
every rank verifies the same trees; greedy output equals TP=1 plain decoding and suffix nodes are accepted."""

from __future__ import annotations

from model_executor.sampling_params import SamplingParams
from server.engine import Engine
from tests.model_executor.tiny_deepseek import write_tiny_deepseek
from tests.speculative.drafter_utils import write_random_drafter


def _outs(path: str, prompts: list[list[int]], sp: SamplingParams, **kw):
    eng = Engine(path, device="cpu", dtype="float32", max_total_tokens=1024, max_running_requests=8, **kw)
    try:
        return eng.generate(input_ids=prompts, sampling_params=sp)
    finally:
        eng.shutdown()


def test_tiny_kimi_tp2_suffix_drafts_accept_and_match_tp1(tmp_path) -> None:
    ckpt = write_tiny_deepseek(tmp_path / "kimi", int4=True, kimi=True)
    path = str(ckpt.path)
    heads = [[3, 17, 42, 99, 7], [5, 6, 7, 8]]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    # prompts that hold the model's own continuation of their last tokens, so suffix drafts get accepted
    conts = [o.token_ids for o in _outs(path, heads, sp)]
    prompts = [h + c + h for h, c in zip(heads, conts, strict=True)]
    ref = [o.token_ids for o in _outs(path, prompts, sp)]
    drafter = write_random_drafter(path, tmp_path / "drafter", num_layers=1, block_size=4)
    for kw in ({"ddtree_budget": 6}, {"draft_model_path": drafter, "ddtree_budget": "auto", "ddtree_max_budget": 8}):
        got = _outs(path, prompts, sp, tp_size=2, speculative_algorithm="ddtree", **kw)
        assert [o.token_ids for o in got] == ref, kw
        assert sum(o.spec_accepted_suffix for o in got) > 0, kw
        assert max(o.acceptance_length for o in got) > 2.0, kw  # depth >= 2 paths committed
