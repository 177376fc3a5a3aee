"""Penalties and logit_bias end to end (issue 14, item 4): plain decoding with penalties equals a
step-by-step reference written from transformers' logits. DDTree and DFlash decoding with penalties
equal plain decoding token for token (greedy). A large logit_bias forces a token, sampled or greedy."""

from __future__ import annotations

import pytest
import torch

from ddtree_serve.server.engine import Engine, SamplingParams
from tests.speculative.drafter_utils import write_random_drafter

VOCAB = 24

PENALISED = [
    SamplingParams(
        temperature=0, max_tokens=24, ignore_eos=True, presence_penalty=0.6, frequency_penalty=0.3
    ),
    SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, repetition_penalty=1.5),
    SamplingParams(
        temperature=0,
        max_tokens=24,
        ignore_eos=True,
        repetition_penalty=0.7,
        frequency_penalty=-0.4,
        logit_bias={3: 2.0, 5: -1.5},
    ),
    SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),  # no penalty, in the same batch
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests.conftest import write_tiny_llama_family

    root = tmp_path_factory.mktemp("spec-pen")
    target = write_tiny_llama_family(root / "target", "qwen3", vocab=VOCAB, seed=3, num_hidden_layers=4)
    drafter = write_random_drafter(target, root / "drafter", num_layers=1, block_size=5, seed=1, std=0.3)
    return target, drafter


def _engine(target: str, drafter: str | None = None, alg: str = "none", budget: int = 8) -> Engine:
    spec = {} if alg == "none" else {"draft_model_path": drafter, "ddtree_budget": budget}  # none: no settings
    return Engine(target, dtype="float32", max_total_tokens=8192, speculative_algorithm=alg, **spec)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(2)
    return [torch.randint(0, VOCAB - 2, (int(n),), generator=g).tolist() for n in (5, 9, 3, 7)]


def _hf_greedy_with_penalties(target: str, prompt: list[int], p: SamplingParams) -> list[int]:
    """Step-by-step reference: transformers' logits of the whole sequence, the definitions applied by hand
    (bias, repetition over prompt + generated, frequency/presence over generated), argmax."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    out: list[int] = []
    for _ in range(p.max_tokens):
        with torch.no_grad():
            row = m(torch.tensor([prompt + out])).logits[0, -1].double()
        for t, b in (p.logit_bias or {}).items():
            row[t] += b
        for t in range(VOCAB):
            if t in prompt or t in out:
                row[t] = row[t] / p.repetition_penalty if row[t] > 0 else row[t] * p.repetition_penalty
            c = out.count(t)
            row[t] -= c * p.frequency_penalty + (p.presence_penalty if c else 0.0)
        out.append(int(row.argmax()))
    return out


def test_plain_decoding_with_penalties_matches_transformers_reference(tiny):
    target, _ = tiny
    prompts = _prompts()
    e = _engine(target)
    got = e.generate(input_ids=prompts, sampling_params=PENALISED)
    e.shutdown()
    for o, prompt, p in zip(got, prompts, PENALISED, strict=True):
        assert o.token_ids == _hf_greedy_with_penalties(target, prompt, p)
    unpenalised = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)] * 3
    plain = _engine(target).generate(input_ids=prompts[:3], sampling_params=unpenalised)
    assert all(a.token_ids != b.token_ids for a, b in zip(plain, got[:3], strict=True)), (
        "penalties must matter"
    )


@pytest.mark.parametrize(("alg", "budget"), [("ddtree", 8), ("ddtree", 16), ("dflash", 4)])
def test_speculative_greedy_with_penalties_equals_plain(tiny, alg, budget):
    target, drafter = tiny
    prompts = _prompts()
    ref = _engine(target).generate(input_ids=prompts, sampling_params=PENALISED)
    e = _engine(target, drafter, alg, budget)
    got = e.generate(input_ids=prompts, sampling_params=PENALISED)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert sum(o.spec_accepted_tokens for o in got) > 0, "the test must exercise accepted paths"
    st = e.stats()
    assert st.kv_used_tokens == 0 and st.running == 0 and st.waiting == 0


@pytest.mark.parametrize("alg", ["none", "ddtree"])
def test_logit_bias_forces_and_bans_tokens(tiny, alg):
    target, drafter = tiny
    prompts = _prompts()[:2]
    e = _engine(target, drafter if alg != "none" else None, alg)
    forced = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True, seed=1, logit_bias={7: 100.0})
    assert all(o.token_ids == [7] * 10 for o in e.generate(input_ids=prompts, sampling_params=forced))
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    free = e.generate(input_ids=prompts, sampling_params=greedy)
    banned_tok = free[0].token_ids[0]
    banned = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logit_bias={banned_tok: -100.0})
    outs = e.generate(input_ids=prompts, sampling_params=banned)
    assert all(banned_tok not in o.token_ids for o in outs)


def test_logit_bias_id_outside_the_vocabulary_is_rejected(tiny):
    target, _ = tiny
    e = _engine(target)
    with pytest.raises(ValueError, match="out of range"):
        e.generate(input_ids=[[1, 2]], sampling_params=SamplingParams(max_tokens=2, logit_bias={VOCAB: 1.0}))
