"""/v1/completions with ``echo`` + ``logprobs`` over real HTTP: OpenAI's legacy layout over prompt +
completion, for text, token-id and list prompts, ``max_tokens`` 0, streaming; prompt logprobs equal
transformers' (both float32) and a DDTree server returns the same as a plain one, its completion logprobs
taken from tree verification with accepted drafts (a fixed budget of 8, so every step drafts; a copy-heavy
prompt, so the suffix drafts are accepted; asserted from ``spec_stats``). Both servers prefill in 16-token
chunks, so the long prompt is scored across several chunks."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from tests.server.conftest import free_port, start_server, stop_server, wait_healthy

CHUNK = 16
TOL = 1e-4  # float32, absolute, per token: our forward vs transformers' (measured ~2e-5)
MODEL = "smollm"
LONG = (
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n"
    "for i in range(10):\n    print(i, fibonacci(i))  # the first ten Fibonacci numbers, one per line"
)
PROMPTS = ["The capital of France is", LONG, "Question: What is 2 + 2?\nAnswer: 4"]
# greedy continues the list, which the suffix index holds from the prompt: drafts that verification accepts
COPY = "one, two, three, four, five, six, seven, eight.\n" * 3 + "one, two, three,"
DDTREE_BUDGET = "8"  # fixed: every decode step verifies a tree (the auto budget may decode plainly)


def _start(tmp_path_factory, algorithm: str):
    port = free_port()
    log = tmp_path_factory.mktemp(f"server-{algorithm}") / "server.log"
    args = [
        "--port",
        str(port),
        "--served-model-name",
        MODEL,
        "--max-total-tokens",
        "4096",
        "--dtype",
        "float32",
        "--chunked-prefill-size",
        str(CHUNK),
        "--speculative-algorithm",
        algorithm,
    ]
    if algorithm != "none":
        args += ["--speculative-draft-model-path", "default", "--speculative-ddtree-budget", DDTREE_BUDGET]
    return start_server(args, log), f"http://127.0.0.1:{port}", log


@pytest.fixture(scope="module")
def servers(tmp_path_factory, default_model_path):
    started = [_start(tmp_path_factory, a) for a in ("none", "ddtree")]
    try:
        with ThreadPoolExecutor(2) as ex:
            list(ex.map(lambda s: wait_healthy(s[0], s[1], 300, s[2]), started))
        yield {"plain": started[0][1], "ddtree": started[1][1]}
    finally:
        for proc, _, _ in started:
            stop_server(proc)


@pytest.fixture(scope="module")
def hf(default_model_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_path)
    model = AutoModelForCausalLM.from_pretrained(default_model_path, dtype=torch.float32)

    def logprobs(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)  # [L, V]

    return tok, logprobs


def _post(base: str, **body) -> httpx.Response:
    return httpx.post(f"{base}/v1/completions", json={"model": MODEL, "temperature": 0, **body}, timeout=300)


def _ok(base: str, **body) -> dict:
    r = _post(base, **body)
    assert r.status_code == 200, r.text
    return r.json()


def _check_layout(choice: dict, n_prompt: int, n_gen: int, k: int) -> None:
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"])
    assert len(lp["tokens"]) == n_prompt + n_gen
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None  # no context for the first token
    assert all(isinstance(v, float) and v <= 0 for v in lp["token_logprobs"][1:])
    assert all(len(t) <= k for t in lp["top_logprobs"][1:])
    assert "".join(lp["tokens"]) == choice["text"]
    offsets = [0]
    for t in lp["tokens"][:-1]:
        offsets.append(offsets[-1] + len(t))
    assert lp["text_offset"] == offsets


def test_echo_layout_and_prompt_logprobs_equal_transformers(servers, hf):
    tok, hf_logprobs = hf
    for prompt in PROMPTS[:2]:  # a short prompt and one prefilled in several chunks
        ids = tok.encode(prompt)
        res = _ok(servers["plain"], prompt=prompt, echo=True, logprobs=2, max_tokens=2)
        choice = res["choices"][0]
        assert choice["text"].startswith(prompt)
        _check_layout(choice, len(ids), 2, 2)
        assert res["usage"]["prompt_tokens"] == len(ids) and res["usage"]["completion_tokens"] == 2
        ref = hf_logprobs(ids)
        got = choice["logprobs"]["token_logprobs"][1 : len(ids)]
        assert got == pytest.approx([ref[p - 1, ids[p]].item() for p in range(1, len(ids))], abs=TOL)
        for p in range(1, len(ids)):
            top = choice["logprobs"]["top_logprobs"][p]
            assert max(top.values()) == pytest.approx(ref[p - 1].max().item(), abs=TOL)
        # the completion part is what the same request returns without echo (that one reuses the echo
        # request's cached prompt KV from the prefix cache: a different forward, equal within TOL)
        plain = _ok(servers["plain"], prompt=prompt, logprobs=2, max_tokens=2)["choices"][0]
        assert choice["text"] == prompt + plain["text"]
        assert choice["logprobs"]["tokens"][len(ids) :] == plain["logprobs"]["tokens"]
        assert choice["logprobs"]["token_logprobs"][len(ids) :] == pytest.approx(
            plain["logprobs"]["token_logprobs"], abs=TOL
        )


def test_ddtree_server_scores_like_plain(servers, hf):
    """The prompt part comes from the same prefill forward on both servers: equal to float32 rounding. The
    completion part comes from tree verification (drafts accepted: the copy prompt) vs plain decode forwards:
    equal within TOL."""
    tok, _ = hf
    accepted = {}
    for prompt, max_tokens in ((PROMPTS[0], 4), (PROMPTS[1], 4), (COPY, 12)):
        n = len(tok.encode(prompt))
        res = [_ok(servers[s], prompt=prompt, echo=True, logprobs=3, max_tokens=max_tokens) for s in ("plain", "ddtree")]
        a, b = (r["choices"][0] for r in res)
        stats = res[1]["spec_stats"]
        assert stats["verify_steps"] > 0 and stats["plain_steps"] <= 1, stats  # a fixed budget drafts every step
        accepted[prompt] = stats["accepted_tokens"]
        assert a["text"] == b["text"]  # lossless greedy
        la, lb = a["logprobs"], b["logprobs"]
        assert la["tokens"] == lb["tokens"] and la["text_offset"] == lb["text_offset"]
        assert la["token_logprobs"][0] is None and lb["token_logprobs"][0] is None
        for lo, hi, tol in ((1, n, 1e-6), (n, n + max_tokens, TOL)):
            assert la["token_logprobs"][lo:hi] == pytest.approx(lb["token_logprobs"][lo:hi], abs=tol)
            for x, y in zip(la["top_logprobs"][lo:hi], lb["top_logprobs"][lo:hi], strict=True):
                assert sorted(x.values()) == pytest.approx(sorted(y.values()), abs=tol)
    assert accepted[COPY] >= 2, accepted  # the compared logprobs include tokens of accepted drafts


def test_token_id_prompts_and_lists(servers, hf):
    tok, _ = hf
    base = servers["plain"]
    ids = [tok.encode(p) for p in PROMPTS]
    singles = [_ok(base, prompt=i, echo=True, logprobs=1, max_tokens=1)["choices"][0] for i in ids]
    for i, c in zip(ids, singles, strict=True):
        _check_layout(c, len(i), 1, 1)
    for body in (dict(prompt=ids), dict(prompt=PROMPTS)):
        res = _ok(base, echo=True, logprobs=1, max_tokens=1, **body)
        got = sorted(res["choices"], key=lambda c: c["index"])
        assert len(got) == len(PROMPTS)
        for g, s in zip(got, singles, strict=True):
            assert g["logprobs"]["tokens"] == s["logprobs"]["tokens"]
            # batched prefill (three prompts in one forward) rounds differently from one prompt alone
            assert g["logprobs"]["token_logprobs"][1:] == pytest.approx(
                s["logprobs"]["token_logprobs"][1:], abs=TOL
            )


def test_max_tokens_zero(servers, hf):
    tok, hf_logprobs = hf
    base = servers["ddtree"]
    ids = tok.encode(PROMPTS[1])
    res = _ok(base, prompt=PROMPTS[1], echo=True, logprobs=1, max_tokens=0)
    c = res["choices"][0]
    assert c["text"] == PROMPTS[1] and c["finish_reason"] == "length"
    assert res["usage"]["completion_tokens"] == 0
    _check_layout(c, len(ids), 0, 1)
    ref = hf_logprobs(ids)
    assert c["logprobs"]["token_logprobs"][1:] == pytest.approx(
        [ref[p - 1, ids[p]].item() for p in range(1, len(ids))], abs=TOL
    )
    echo_only = _ok(base, prompt=["a b", "c"], echo=True, max_tokens=0)
    assert [c["text"] for c in echo_only["choices"]] == ["a b", "c"]
    assert all(c["logprobs"] is None and c["finish_reason"] == "length" for c in echo_only["choices"])
    r = _post(base, prompt="Hello", max_tokens=0)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_stream_echo_logprobs(servers):
    base = servers["plain"]
    full = _ok(base, prompt=PROMPTS[0], echo=True, logprobs=2, max_tokens=4)["choices"][0]
    chunks = []
    with httpx.stream(
        "POST",
        f"{base}/v1/completions",
        timeout=300,
        json={
            "model": MODEL,
            "prompt": PROMPTS[0],
            "echo": True,
            "logprobs": 2,
            "max_tokens": 4,
            "temperature": 0,
            "stream": True,
        },
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    first = chunks[0]["choices"][0]
    assert first["text"] == PROMPTS[0] and first["logprobs"]["token_logprobs"][0] is None
    text, tokens, lps, offsets = "", [], [], []
    for ch in chunks:
        for c in ch["choices"]:
            text += c["text"]
            if c.get("logprobs"):
                tokens += c["logprobs"]["tokens"]
                lps += c["logprobs"]["token_logprobs"]
                offsets += c["logprobs"]["text_offset"]
    assert text == full["text"] and tokens == full["logprobs"]["tokens"]
    assert offsets == full["logprobs"]["text_offset"]
    assert lps[0] is None and lps[1:] == pytest.approx(full["logprobs"]["token_logprobs"][1:])


def test_lm_eval_request_shape(servers, hf):
    """What lm-eval's ``local-completions`` sends for loglikelihood (token ids of context + continuation,
    ``echo``, ``logprobs`` 1, ``max_tokens`` 1, a batch of prompts) and how it reads the answer
    (``token_logprobs[ctxlen:-1]``): equals the continuation's loglikelihood under transformers."""
    tok, hf_logprobs = hf
    pairs = [
        ("The capital of France is", " Paris"),
        ("The capital of France is", " a banana"),
        ("Question: What is 2 + 2?\nAnswer:", " 4"),
    ]
    reqs = [(tok.encode(c), tok.encode(x)) for c, x in pairs]
    res = _ok(
        servers["ddtree"], prompt=[c + x for c, x in reqs], echo=True, logprobs=1, max_tokens=1, seed=1234
    )
    for choice, (ctx, cont) in zip(sorted(res["choices"], key=lambda c: c["index"]), reqs, strict=True):
        got = sum(choice["logprobs"]["token_logprobs"][len(ctx) : -1])
        ref = hf_logprobs(ctx + cont)
        want = sum(ref[len(ctx) + j - 1, t].item() for j, t in enumerate(cont))
        assert got == pytest.approx(want, abs=TOL * len(cont))
