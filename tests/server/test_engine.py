"""The offline Engine on the default model: greedy equals transformers, batching/chunking invariance,
seeded sampling, KV accounting, bad input."""

from __future__ import annotations

import pytest
import torch

from ddtree_serve.server.engine import Engine, SamplingParams

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Write a haiku about the sea.",
    "List three prime numbers:",
    "In 1969, the first humans",
]


@pytest.fixture(scope="module")
def engine(default_model_path):
    e = Engine(default_model_path, dtype="float32", max_total_tokens=8192, chunked_prefill_size=64)
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def hf_greedy(default_model_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_path)
    model = AutoModelForCausalLM.from_pretrained(default_model_path, dtype=torch.float32)

    def run(prompt: str, n: int) -> list[int]:
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=n, do_sample=False)
        return out[0, ids.shape[1]:].tolist()

    return run


def _assert_pool_full(engine: Engine) -> None:
    st = engine.stats()
    assert st.kv_used_tokens == 0 and st.running == 0 and st.waiting == 0
    assert engine.scheduler.runner.slots.num_free_rows == engine.config.scheduler.max_running_requests + 1


def test_greedy_matches_transformers_alone_and_batched(engine, hf_greedy):
    refs = [hf_greedy(p, 20) for p in PROMPTS]
    for p, ref in zip(PROMPTS[:2], refs[:2], strict=True):
        (out,) = engine.generate(p, SamplingParams(temperature=0, max_tokens=20))
        assert out.token_ids == ref
    outs = engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=20))
    assert [o.token_ids for o in outs] == refs
    assert [o.finish_reason for o in outs] == ["stop" if len(r) < 20 else "length" for r in refs]
    _assert_pool_full(engine)


def test_chunked_prefill_and_interleaving_do_not_change_output(default_model_path, engine):
    long_prompt = " ".join(PROMPTS * 6)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ref = engine.generate([long_prompt, PROMPTS[0]], params)
    small = Engine(default_model_path, dtype="float32", max_total_tokens=4096, chunked_prefill_size=16)
    # a request joins while another is decoding: stream the first, submit the second mid-way
    got = small.generate([long_prompt, PROMPTS[0]], params)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    stream = small.generate_stream(PROMPTS[0], params)
    first = next(stream)
    mid = small.generate(long_prompt, params)[0]
    rest = [d for d in stream]
    assert mid.token_ids == ref[0].token_ids
    assert first.token_ids + sum((d.token_ids for d in rest), []) == ref[1].token_ids
    assert first.text + "".join(d.text for d in rest) == ref[1].text  # incremental detokenizer
    _assert_pool_full(small)


def test_seeded_sampling_reproducible_and_batch_independent(engine):
    p = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=1234, max_tokens=16, ignore_eos=True)
    a = engine.generate(PROMPTS[0], p)[0].token_ids
    b = engine.generate(PROMPTS[0], p)[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=16, seed=7)
    c = engine.generate(PROMPTS[:3], [p, others, SamplingParams(temperature=0, max_tokens=5)])[0].token_ids
    assert a == b == c
    d = engine.generate(PROMPTS[0], SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=99, max_tokens=16,
                                                   ignore_eos=True))[0].token_ids
    assert d != a


def test_stop_token_and_eos(engine):
    greedy = engine.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0]
    stop_at = greedy.token_ids[5]
    out = engine.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=20, stop_token_ids=(stop_at,)))[0]
    assert out.token_ids == greedy.token_ids[: greedy.token_ids.index(stop_at) + 1]
    assert out.finish_reason == "stop"
    _assert_pool_full(engine)


def test_abort_frees_kv(engine):
    stream = engine.generate_stream(PROMPTS[:3], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    next(stream)
    stream.close()  # the consumer goes away: its requests are aborted
    _assert_pool_full(engine)


def test_logprobs(engine):
    out = engine.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=4, logprobs=2))[0]
    assert len(out.logprobs) == len(out.token_ids)
    for tok, (lp, top) in zip(out.token_ids, out.logprobs, strict=True):
        assert top[0][0] == tok and abs(top[0][1] - lp) < 1e-5 and lp <= 0


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -0.5}, "temperature"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"max_tokens": 100000}, "max_tokens"),
    ],
)
def test_bad_sampling_params_raise(engine, kwargs, field):
    with pytest.raises(ValueError, match=field):
        engine.generate(PROMPTS[0], SamplingParams(**kwargs))
    _assert_pool_full(engine)


def test_bad_prompt_and_model_path(engine):
    with pytest.raises(ValueError, match="prompt"):
        engine.generate("", SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="prompt"):
        engine.generate(input_ids=[[1] * 9000], sampling_params=SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="model_path"):
        Engine("/nonexistent/model")
    _assert_pool_full(engine)


def test_engine_drives_a_scheduler_protocol_over_a_resolved_config(engine, default_model_path):
    from ddtree_serve.server.scheduling.scheduler_factory import SchedulerLike

    assert isinstance(engine.scheduler, SchedulerLike)
    assert engine.config.model.model_path == default_model_path and engine.config.model.device in ("cpu", "cuda")
