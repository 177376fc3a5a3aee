"""Mixed greedy + sampled batches through the speculative engine under both acceptance rules of the
sampling kernel (issue 14, item 1): the pinned AOT sgl-kernel's ``coin <= acc`` and the JIT builds'
``coin < acc``, selected for the PyTorch reference with ``DDTREE_REFERENCE_COIN_RULE``. Greedy requests
of a mixed batch run through the sampling kernel with one-hot rows, and must equal plain greedy decoding
token for token under either rule."""

from __future__ import annotations

import pytest

from ddtree_serve.server.engine import Engine, SamplingParams
from ddtree_serve.speculative.verify import COIN_RULE_ENV

PENALISED = [  # issue 14 item 4 on the real pair: penalties and a bias, greedy
    SamplingParams(
        temperature=0, max_tokens=16, ignore_eos=True, presence_penalty=1.0, frequency_penalty=0.5
    ),
    SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, repetition_penalty=1.3),
    SamplingParams(
        temperature=0, max_tokens=16, ignore_eos=True, frequency_penalty=1.5, logit_bias={28: 3.0}
    ),
    SamplingParams(
        temperature=0, max_tokens=16, ignore_eos=True, repetition_penalty=0.9, presence_penalty=-0.5
    ),
]


@pytest.fixture(scope="module")
def default_pair(default_model_path):
    from benchmarks.common import CHAT_PROMPTS, chat_ids

    base = Engine(default_model_path, dtype="float32", max_total_tokens=16384)
    ids = chat_ids(base.tokenizer, CHAT_PROMPTS)
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    ref = [o.token_ids for o in base.generate(input_ids=ids[:4], sampling_params=greedy)]
    ref_pen = [o.token_ids for o in base.generate(input_ids=ids[:4], sampling_params=PENALISED)]
    base.shutdown()
    spec = Engine(
        default_model_path,
        dtype="float32",
        max_total_tokens=16384,
        speculative_algorithm="ddtree",
        draft_model_path="default",
        ddtree_budget=16,
    )
    yield spec, ids, ref, ref_pen
    spec.shutdown()


@pytest.mark.parametrize("rule", ["le", "lt"])
def test_mixed_batch_greedy_rows_equal_plain_greedy(default_pair, monkeypatch, rule):
    """Four greedy and four sampled requests in one batch (same length, EOS ignored, so every step is
    mixed and takes the sampling kernel): the greedy ones equal plain greedy decoding."""
    spec, ids, ref, _ = default_pair
    monkeypatch.setenv(COIN_RULE_ENV, rule)
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    params = [greedy] * 4 + [
        SamplingParams(temperature=1.0, top_p=0.95, max_tokens=16, ignore_eos=True, seed=s) for s in range(4)
    ]
    outs = spec.generate(input_ids=ids[:4] + ids[4:8], sampling_params=params)
    assert [o.token_ids for o in outs[:4]] == ref
    assert all(len(o.token_ids) == 16 for o in outs)
    assert sum(o.spec_accepted_tokens for o in outs[:4]) > 0, "the greedy rows must accept drafted tokens"
    assert sum(o.spec_accepted_tokens for o in outs[4:]) > 0, "the sampled rows must accept drafted tokens"
    st = spec.stats()
    assert st.kv_used_tokens == 0 and st.running == 0 and st.waiting == 0


def test_mixed_batch_with_penalties_greedy_rows_equal_plain(default_pair):
    """Penalised greedy requests next to penalised sampled ones (shipped drafter, DDTree@16, pinned rule)
    equal plain decoding with the same penalties token for token."""
    spec, ids, _, ref_pen = default_pair
    sampled = [
        SamplingParams(
            temperature=0.8,
            max_tokens=16,
            ignore_eos=True,
            seed=s,
            frequency_penalty=0.7,
            repetition_penalty=1.2,
        )
        for s in range(2)
    ]
    outs = spec.generate(input_ids=ids[:4] + ids[4:6], sampling_params=PENALISED + sampled)
    assert [o.token_ids for o in outs[:4]] == ref_pen
    assert sum(o.spec_accepted_tokens for o in outs[:4]) > 0
