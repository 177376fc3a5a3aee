"""Seeded speculation is exact: a seeded sampled request gives the same tokens with DDTree as with plain
decoding (float32), at fixed budgets, auto, suffix drafts alone, with penalties, logit bias, a grammar, the
prefix cache and in a mixed greedy / sampled batch, each with drafts accepted (docs/DESIGN.md 4.16).

Every sampled token is ``F^-1(u(seed, t))`` of its processed distribution at output position t, in plain
decoding and at every tree node alike, so equality holds token for token, not only in distribution. Each
speculative engine generates the same requests twice: the second run copies the first through the suffix
index and the prefix cache (an agent's repeated request), so drafts are accepted even where the shipped
drafter's are not.
"""

from __future__ import annotations

import pytest

from ddtree_serve.server.engine import Engine, SamplingParams
from tests.speculative.scripted_drafts import install

N_TOKENS = 20


def _sampled(i: int, **extra) -> SamplingParams:
    return SamplingParams(temperature=0.7, top_p=0.95, seed=100 + i, max_tokens=N_TOKENS, ignore_eos=True, **extra)


VARIANTS = {
    "sampled": [_sampled(i) for i in range(4)],
    "penalties": [_sampled(i, presence_penalty=0.8, frequency_penalty=0.4, repetition_penalty=1.2,
                           top_k=20) for i in range(4)],
    "logit_bias": [_sampled(i, logit_bias={28: 4.0, 30: -100.0}, min_p=0.05) for i in range(4)],
    "grammar": [_sampled(i, regex="[A-Za-z ,]{10,60}\\.") for i in range(4)],
    "mixed": [SamplingParams(temperature=0, max_tokens=N_TOKENS, ignore_eos=True), _sampled(1),
              SamplingParams(temperature=0, max_tokens=N_TOKENS, ignore_eos=True, presence_penalty=1.0),
              _sampled(3, top_k=8)],
}
# their plain outputs: the session fixture ``plain_refs`` (tests/speculative/conftest.py), shared with
# test_device_tree.py and test_padded_trees.py


def _check(spec: Engine, ids: list[list[int]], refs: dict, names: list[str]) -> None:
    log = install(spec, None)  # logs every step's accepted nodes (the engine's own draft sources)
    for name in names:
        accepted = 0
        for run in range(2):
            outs = spec.generate(input_ids=ids, sampling_params=VARIANTS[name])
            assert [o.token_ids for o in outs] == refs[name], (name, run)
            accepted += sum(o.spec_accepted_tokens for o in outs)
        assert accepted > 0, f"{name}: no draft accepted"
    assert max(log.accepted) >= 2, "no path of depth >= 2 accepted"
    st = spec.stats()
    assert st.kv_used_tokens == 0 and st.running == 0 and st.waiting == 0


@pytest.mark.parametrize("budget", [4, 16, 64])
def test_fixed_budget_seeded_equals_plain(plain_refs, default_model_path, budget):
    ids, refs = plain_refs
    spec = Engine(default_model_path, dtype="float32", max_total_tokens=16384, speculative_algorithm="ddtree",
                  draft_model_path="default", ddtree_budget=budget)
    try:
        names = list(VARIANTS) if budget == 16 else ["sampled"]
        _check(spec, ids, refs, names)
    finally:
        spec.shutdown()


@pytest.mark.parametrize("sources", ["auto", "suffix"])
def test_auto_and_suffix_only_seeded_equal_plain(plain_refs, default_model_path, sources):
    """The default configuration (auto budget, dflash + suffix, prefix cache on) and suffix drafts alone."""
    ids, refs = plain_refs
    kw = {"draft_model_path": "default"} if sources == "auto" else {"draft_sources": "suffix"}
    spec = Engine(default_model_path, dtype="float32", max_total_tokens=16384, speculative_algorithm="ddtree",
                  ddtree_budget="auto", **kw)
    try:
        _check(spec, ids, refs, ["sampled", "mixed"] if sources == "auto" else ["sampled"])
    finally:
        spec.shutdown()


def test_unseeded_requests_get_a_concrete_seed(default_model_path):
    """A request without a seed gets one at admission; its sampled tokens are still position-keyed (two
    unseeded requests differ, and the engine's own draws do not depend on the batch)."""
    eng = Engine(default_model_path, dtype="float32", max_total_tokens=4096)
    try:
        sp = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
        a, b = eng.generate(prompts=["Tell me a story.", "Tell me a story."], sampling_params=sp)
        assert a.token_ids != b.token_ids
    finally:
        eng.shutdown()


def test_tiny_deepseek_mla_seeded_equals_plain(tmp_path):
    """The tiny DeepSeek-V3 (MLA, INT4 experts) with suffix drafts: seeded sampled == plain, drafts accepted."""
    from tests.model_executor.tiny_deepseek import write_tiny_deepseek

    path = str(write_tiny_deepseek(tmp_path / "kimi", int4=True, kimi=True).path)
    prompts = [[3, 17, 42, 99, 7], [5, 6, 7, 8]]
    params = [SamplingParams(temperature=0.8, seed=s, max_tokens=24, ignore_eos=True) for s in (1, 2)]
    kw = dict(device="cpu", dtype="float32", max_total_tokens=1024, max_running_requests=8)
    base = Engine(path, **kw)
    ref = [o.token_ids for o in base.generate(input_ids=prompts, sampling_params=params)]
    base.shutdown()
    spec = Engine(path, speculative_algorithm="ddtree", ddtree_budget=6, **kw)
    try:
        log = install(spec, None)
        first = spec.generate(input_ids=prompts, sampling_params=params)
        second = spec.generate(input_ids=prompts, sampling_params=params)
        assert [o.token_ids for o in first] == [o.token_ids for o in second] == ref
        assert all(o.spec_accepted_tokens >= 10 for o in second), [o.spec_accepted_tokens for o in second]
        assert max(log.accepted) >= 2
    finally:
        spec.shutdown()
