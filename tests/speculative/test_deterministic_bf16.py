"""Lossless in bfloat16 with ``enable_deterministic_inference`` (issue 60, docs/DESIGN.md 4.18): greedy and seeded
sampled DDTree output equals plain decoding token for token, with drafts accepted, at budgets 4/16/64 and
auto, batched, with chunked prefill and the prefix cache on.

Run in native bfloat16 (this CPU has AVX512-BF16; torch computes bf16 GEMMs in oneDNN). With the mode on every
kernel of the target forward is row-invariant, so equality is exact by construction, not a matter of luck at
near-ties: the outputs are long (32 tokens) over 12 prompts, and the scripted draft source
(tests/speculative/scripted_drafts.py) proposes trees around the plain continuation with rejected siblings at
every step, so every step verifies a real tree (accepted depth >= 2 paths, masked siblings, scattered
ancestor columns). The tiny Llama keeps this in the default suite; the default model's version is slow.
"""

from __future__ import annotations

import random

import pytest

from ddtree_serve.server.engine import Engine, SamplingParams
from tests.conftest import write_tiny_llama_family
from tests.speculative.scripted_drafts import greedy_script, install

N_TOKENS = 32
VOCAB = 256
_rng = random.Random(60)
GREEDY_PROMPTS = [[_rng.randrange(1, VOCAB - 2) for _ in range(_rng.randrange(20, 70))] for _ in range(6)]
SEEDED_PROMPTS = [[_rng.randrange(1, VOCAB - 2) for _ in range(_rng.randrange(20, 70))] for _ in range(6)]
GREEDY = SamplingParams(temperature=0, max_tokens=N_TOKENS, ignore_eos=True)
SEEDED = [SamplingParams(temperature=0.9, top_p=0.95, seed=600 + i, max_tokens=N_TOKENS, ignore_eos=True)
          for i in range(len(SEEDED_PROMPTS))]
BF16 = dict(device="cpu", dtype="bfloat16", max_total_tokens=8192, enable_deterministic_inference=True)


@pytest.fixture(scope="module")
def tiny_and_refs(tmp_path_factory):
    """The tiny Llama (bf16 at load) and its plain greedy / seeded outputs (prefix cache off, one prefill)."""
    path = write_tiny_llama_family(tmp_path_factory.mktemp("tiny-det"), "llama", vocab=VOCAB, seed=60)
    base = Engine(path, disable_radix_cache=True, **BF16)
    try:
        greedy = [o.token_ids for o in base.generate(input_ids=GREEDY_PROMPTS, sampling_params=GREEDY)]
        seeded = [o.token_ids for o in base.generate(input_ids=SEEDED_PROMPTS, sampling_params=SEEDED)]
    finally:
        base.shutdown()
    return path, greedy, seeded


def check_equal_plain(spec: Engine, greedy: list[list[int]], seeded: list[list[int]], min_depth: int = 2) -> None:
    """Two rounds of both request sets (the second meets the prefix cache) equal the plain outputs, with
    depth >= ``min_depth`` paths accepted and nodes rejected."""
    refs = {tuple(p): t for p, t in zip(GREEDY_PROMPTS + SEEDED_PROMPTS, greedy + seeded, strict=True)}
    log = install(spec, greedy_script(refs, VOCAB))
    for run in range(2):
        outs = spec.generate(input_ids=GREEDY_PROMPTS, sampling_params=GREEDY)
        assert [o.token_ids for o in outs] == greedy, ("greedy", run)
        outs = spec.generate(input_ids=SEEDED_PROMPTS, sampling_params=SEEDED)
        assert [o.token_ids for o in outs] == seeded, ("seeded", run)
    log.assert_accepted(min_depth=min_depth)


@pytest.mark.parametrize("budget", [16, pytest.param(4, marks=pytest.mark.slow), pytest.param(64, marks=pytest.mark.slow),
                                    pytest.param("auto", marks=pytest.mark.slow)])
def test_bf16_ddtree_equals_plain_with_deterministic_inference(tiny_and_refs, budget):
    """Budgets 4/16/64/auto, batch of 6, prefill chunks of 16 tokens, prefix cache on (budget 16 in the default
    suite, the others slow: each takes minutes on a shared 2-core CPU). The auto budget shrinks its trees on
    this random model (its acceptance estimate), so only depth-1 acceptance is required there."""
    path, greedy, seeded = tiny_and_refs
    spec = Engine(path, speculative_algorithm="ddtree", ddtree_budget=budget, draft_sources="suffix",
                  chunked_prefill_size=16, **BF16)
    try:
        check_equal_plain(spec, greedy, seeded, min_depth=1 if budget == "auto" else 2)
    finally:
        spec.shutdown()


def test_plain_is_batch_and_chunk_invariant(tiny_and_refs):
    """Plain decoding alone: one request at a time, small prefill chunks and the prefix cache give the batched
    outputs (the mode's promise without speculation)."""
    path, greedy, seeded = tiny_and_refs
    eng = Engine(path, chunked_prefill_size=8, **BF16)
    try:
        for p, ref in zip(GREEDY_PROMPTS[:3], greedy[:3], strict=True):
            assert eng.generate(input_ids=[p], sampling_params=GREEDY)[0].token_ids == ref
        outs = eng.generate(input_ids=SEEDED_PROMPTS, sampling_params=SEEDED)  # after the cache holds nothing of them
        assert [o.token_ids for o in outs] == seeded
        outs = eng.generate(input_ids=SEEDED_PROMPTS[::-1], sampling_params=SEEDED[::-1])  # cache hits, other order
        assert [o.token_ids for o in outs] == seeded[::-1]
    finally:
        eng.shutdown()


@pytest.mark.slow
def test_tp2_bf16_ddtree_equals_tp2_plain(tiny_and_refs):
    """TP 2 (one KV head per rank; the row-parallel all-reduce sums the ranks' partials in a fixed order):
    speculative == plain under the same TP size (TP 2 and TP 1 differ by that sum, so TP 2 has its own refs)."""
    path = tiny_and_refs[0]
    base = Engine(path, tp_size=2, disable_radix_cache=True, **BF16)
    try:
        greedy = [o.token_ids for o in base.generate(input_ids=GREEDY_PROMPTS, sampling_params=GREEDY)]
        seeded = [o.token_ids for o in base.generate(input_ids=SEEDED_PROMPTS, sampling_params=SEEDED)]
    finally:
        base.shutdown()
    spec = Engine(path, tp_size=2, speculative_algorithm="ddtree", ddtree_budget=16, draft_sources="suffix",
                  chunked_prefill_size=16, **BF16)
    try:
        check_equal_plain(spec, greedy, seeded)
    finally:
        spec.shutdown()
