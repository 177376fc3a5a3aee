"""Vocabulary-parallel logits under TP (gloo, real rank processes) give the gathered path's tokens, token for
token: greedy, seeded sampling with top-k / top-p / min-p, penalties, logit bias, a regex grammar and a logprobs
request, in plain decoding and in DDTree steps with drafts accepted (docs/DESIGN.md 4.16).

Per TP size, the reference is a plain engine with ``vocab_parallel_logits=False`` (every row all-gathered).
The same TP size keeps the hidden states identical across the two modes, so the comparison isolates the logits
pipeline: the sharded argmax, integer thresholds and crossing must pick the gathered row's tokens. The
speculative engines' drafts are scripted around the reference (tests/speculative/scripted_drafts.py), so paths
of depth >= 2 are accepted; speculation is lossless, so they must give the same tokens."""

from __future__ import annotations

import pytest

from ddtree_serve.model_executor.sampling_params import SamplingParams
from ddtree_serve.server.engine import Engine
from tests.model_executor.tiny_deepseek import VOCAB, write_tiny_deepseek
from tests.speculative.drafter_utils import write_random_drafter
from tests.speculative.scripted_drafts import greedy_script, install

N = 10
PROMPTS = [[3, 17, 42, 99, 7], [5, 6, 7], [11, 200, 300, 400, 12, 13], [8, 9, 10, 11], [21, 22, 23], [31, 32]]
PARAMS = [
    SamplingParams(temperature=0, max_tokens=N, ignore_eos=True),
    SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=N, ignore_eos=True),
    SamplingParams(temperature=0.9, top_k=40, min_p=0.02, seed=12, presence_penalty=0.6, frequency_penalty=0.3,
                   repetition_penalty=1.2, logit_bias={5: 2.0, 7: -100.0, 300: 1.5}, max_tokens=N, ignore_eos=True),
    SamplingParams(temperature=0.7, seed=13, regex="(<1[0-9]>)+", max_tokens=N, ignore_eos=True),
    SamplingParams(temperature=0, presence_penalty=1.0, logit_bias={9: 0.5}, logprobs=2, max_tokens=N,
                   ignore_eos=True),
    SamplingParams(temperature=1.0, top_p=0.5, top_k=3, seed=14, logprobs=1, max_tokens=N, ignore_eos=True),
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("vocab_parallel")
    path = str(write_tiny_deepseek(root / "kimi", int4=True, kimi=True).path)
    return path, write_random_drafter(path, root / "drafter", num_layers=1, block_size=4)


def _run(path: str, tp: int, vocab_parallel: bool, refs: list[list[int]] | None = None, drafter: str | None = None):
    """Tokens and logprobs of ``PROMPTS`` under ``PARAMS``; with ``drafter``, a DDTree engine whose drafts are
    scripted around ``refs`` and must be accepted."""
    kw = {}
    if drafter is not None:
        kw = dict(speculative_algorithm="ddtree", draft_model_path=drafter, ddtree_budget=8)
    eng = Engine(path, device="cpu", dtype="float32", max_total_tokens=1024, max_running_requests=8, tp_size=tp,
                 vocab_parallel_logits=vocab_parallel, disable_radix_cache=True, **kw)
    runner = getattr(eng.scheduler, "scheduler", eng.scheduler).runner  # rank 0's
    assert runner.vocab_shard.sharded == vocab_parallel and runner.vocab_shard.width == VOCAB // tp ** vocab_parallel
    log = None
    if drafter is not None:
        log = install(eng, greedy_script({tuple(p): t for p, t in zip(PROMPTS, refs, strict=True)}, VOCAB))
    try:
        outs = eng.generate(input_ids=PROMPTS, sampling_params=PARAMS)
        if log is not None:
            log.assert_accepted()
        return [o.token_ids for o in outs], [o.logprobs for o in outs]
    finally:
        eng.shutdown()


@pytest.mark.parametrize("tp", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_vocab_parallel_equals_gathered(tiny, tp: int) -> None:
    """TP 4 (four rank processes) is marked slow: the shards' code path is TP 2's (the default suite's case);
    only the shard count differs."""
    path, drafter = tiny
    ref, ref_lp = _run(path, tp, vocab_parallel=False)
    assert all(len(t) == N for t in ref)
    assert all(10 <= t < 20 or t == VOCAB - 1 for t in ref[3]) and ref[3][0] != VOCAB - 1, "the grammar held"
    got, got_lp = _run(path, tp, vocab_parallel=True)
    assert got == ref
    assert got_lp == ref_lp  # logprob rows gathered: the same numbers
    spec, spec_lp = _run(path, tp, vocab_parallel=True, refs=ref, drafter=drafter)
    assert spec == ref

