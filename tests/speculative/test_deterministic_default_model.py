"""The default model (SmolLM2-135M, Llama-shaped) in bfloat16 with ``enable_deterministic_inference``: greedy and
seeded DDTree with the shipped drafter equal plain decoding token for token at budgets 4/16/64/auto, batched, with
chunked prefill and the prefix cache on (each configuration serves the prompts twice: the second meets the
cache and the suffix index). Slow: minutes per budget on a 2-core CPU. tests/speculative/test_deterministic_bf16.py
is the default-suite version on a tiny Llama.
"""

from __future__ import annotations

import pytest

from ddtree_serve.server.engine import Engine, SamplingParams
from tests.speculative.scripted_drafts import install

pytestmark = pytest.mark.slow
N_TOKENS = 40
BF16 = dict(dtype="bfloat16", max_total_tokens=16384, enable_deterministic_inference=True)
GREEDY = SamplingParams(temperature=0, max_tokens=N_TOKENS, ignore_eos=True)
SEEDED = [SamplingParams(temperature=0.8, top_p=0.95, seed=60 + i, max_tokens=N_TOKENS, ignore_eos=True)
          for i in range(6)]


@pytest.fixture(scope="module")
def plain(default_model_path):
    from benchmarks.common import CHAT_PROMPTS, chat_ids

    base = Engine(default_model_path, disable_radix_cache=True, **BF16)
    try:
        ids = chat_ids(base.tokenizer, CHAT_PROMPTS)[:6]
        greedy = [o.token_ids for o in base.generate(input_ids=ids, sampling_params=GREEDY)]
        seeded = [o.token_ids for o in base.generate(input_ids=ids, sampling_params=SEEDED)]
    finally:
        base.shutdown()
    return ids, greedy, seeded


@pytest.mark.parametrize("budget", [4, 16, 64, "auto"])
def test_default_model_bf16_ddtree_equals_plain(plain, default_model_path, budget):
    ids, greedy, seeded = plain
    spec = Engine(default_model_path, speculative_algorithm="ddtree", draft_model_path="default",
                  ddtree_budget=budget, chunked_prefill_size=24, **BF16)
    try:
        log = install(spec, None)  # the engine's own drafts (DFlash + suffix), logged
        for run in range(2):
            assert [o.token_ids for o in spec.generate(input_ids=ids, sampling_params=GREEDY)] == greedy, run
            assert [o.token_ids for o in spec.generate(input_ids=ids, sampling_params=SEEDED)] == seeded, run
        assert sum(log.accepted) > 0 and max(log.accepted) >= 2, log.accepted
    finally:
        spec.shutdown()
