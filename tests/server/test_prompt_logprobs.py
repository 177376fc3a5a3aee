"""Prompt logprobs (``SamplingParams.prompt_logprobs``) on the offline Engine, default model, float32:
equal to transformers' log-softmax of its own logits at every position, with prefill chunked in 16-token
pieces; computed only for the requests that ask. (Over HTTP, and ddtree == plain: test_echo_logprobs.py.)"""

from __future__ import annotations

import pytest
import torch

from ddtree_serve.server.engine import Engine, SamplingParams

CHUNK = 16  # chunked_prefill_size: the long prompt below is prefilled in several chunks
TOL = 1e-4  # float32, absolute, per token (measured max |diff| ~2e-5 between our forward and transformers')
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n"
    "for i in range(10):\n    print(i, fibonacci(i))  # the first ten Fibonacci numbers, one per line",
    "Question: What is 2 + 2?\nAnswer: 4",
    "Hi",
]


@pytest.fixture(scope="module")
def engine(default_model_path):
    e = Engine(
        default_model_path,
        dtype="float32",
        max_total_tokens=4096,
        chunked_prefill_size=CHUNK,
        speculative_algorithm="none",
    )
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def hf_logprobs(default_model_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(default_model_path, dtype=torch.float32)

    def run(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].float()  # [L, V]
        return torch.log_softmax(logits, dim=-1)

    return run


def _check_against_hf(out, hf_logprobs, k: int) -> None:
    ids = out.prompt_token_ids
    pl = out.prompt_logprobs
    assert pl is not None and len(pl) == len(ids)
    assert pl[0] == (ids[0], None, None)  # the first token has no context
    ref = hf_logprobs(ids)  # [L, V]
    for p in range(1, len(ids)):
        tok, lp, top = pl[p]
        assert tok == ids[p]
        assert lp == pytest.approx(ref[p - 1, ids[p]].item(), abs=TOL), f"position {p}"
        assert len(top) == k
        ref_top = ref[p - 1].topk(k).values.tolist()
        assert [v for _, v in top] == pytest.approx(ref_top, abs=TOL)
        for t, v in top:  # each alternative's logprob is that token's logprob, whatever the order of ties
            assert v == pytest.approx(ref[p - 1, t].item(), abs=TOL)


def test_prompt_logprobs_equal_transformers_chunked(engine, hf_logprobs):
    outs = engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=0, prompt_logprobs=3))
    assert len(outs[1].prompt_token_ids) > 3 * CHUNK  # prefilled in at least four chunks
    for out in outs:
        assert out.token_ids == [] and out.finish_reason == "length"  # max_tokens 0: scored, not generated
        _check_against_hf(out, hf_logprobs, 3)


def test_prompt_logprobs_with_generation_and_generated_logprobs_agree(engine, hf_logprobs):
    """Scoring prompt + its greedy continuation gives the generated tokens' logprobs: one log-softmax."""
    p = SamplingParams(temperature=0, max_tokens=3, logprobs=2, prompt_logprobs=2)
    gen = engine.generate(PROMPTS[:2], p)
    for out in gen:
        assert len(out.token_ids) == 3
        _check_against_hf(out, hf_logprobs, 2)
    full = [o.prompt_token_ids + o.token_ids for o in gen]
    scored = engine.generate(input_ids=full, sampling_params=SamplingParams(max_tokens=0, prompt_logprobs=2))
    for g, s in zip(gen, scored, strict=True):
        tail = s.prompt_logprobs[-3:]
        assert [t for t, _, _ in tail] == g.token_ids
        assert [lp for _, lp, _ in tail] == pytest.approx([lp for lp, _ in g.logprobs], abs=TOL)


def test_only_requests_that_ask_are_scored(engine):
    """A batch mixing scored and plain requests: plain ones get no prompt logprobs, and the vocabulary
    projection runs over exactly the scored prompts' rows plus one row per sampled token."""
    runner = engine.scheduler.runner
    real = runner.logits
    rows: list[int] = []

    def counting(hidden: torch.Tensor) -> torch.Tensor:
        rows.append(hidden.shape[0])
        return real(hidden)

    runner.logits = counting
    try:
        params = [
            SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1 if i % 2 else None)
            for i in range(len(PROMPTS))
        ]
        outs = engine.generate(PROMPTS, params)
    finally:
        del runner.logits
    scored_rows = sum(len(o.prompt_token_ids) - 1 for i, o in enumerate(outs) if i % 2)
    assert sum(rows) == scored_rows + sum(len(o.token_ids) for o in outs)
    for i, o in enumerate(outs):
        assert (o.prompt_logprobs is not None) == bool(i % 2)


@pytest.mark.parametrize(
    "start, n, prompt_len, scored, want",
    [
        (0, 16, 40, 0, range(0, 16)),  # first chunk: row q predicts prompt token q + 1
        (16, 16, 40, 16, range(16, 32)),
        (
            32,
            8,
            40,
            32,
            range(32, 39),
        ),  # last chunk: the last row predicts a generated token, not a prompt one
        (0, 5, 5, 0, range(0, 4)),
        (0, 1, 1, 0, range(0, 0)),  # a one-token prompt has nothing to score
        (0, 40, 40, 39, range(39, 39)),  # already scored (a retracted request prefilled again)
    ],
)
def test_chunk_rows(start, n, prompt_len, scored, want):
    from ddtree_serve.model_executor.prompt_logprobs import chunk_rows

    assert chunk_rows(start, n, prompt_len, scored) == want


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(prompt_logprobs=21), "prompt_logprobs"),
        (dict(prompt_logprobs=-1), "prompt_logprobs"),
    ],
)
def test_bad_params(engine, kw, field):
    with pytest.raises(ValueError, match=field):
        engine.generate(["Hello"], SamplingParams(**kw))
