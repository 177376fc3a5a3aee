"""``--sampling-defaults`` (issue 61): a request's missing sampling fields come from the checkpoint's
generation_config.json (``model``, the default) or OpenAI's defaults (``openai``). Without a server: which
values are read and how they fill a request; on a real server: the default model with a generation_config that
sets temperature 0 answers requests without ``temperature`` greedily on every API, and /model_info shows the
defaults."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from ddtree_serve.server.http.chat_bridge import chat_request
from ddtree_serve.server.http.serving_common import sampling_fields
from ddtree_serve.server.sampling_defaults import describe, model_sampling_defaults, sampling_defaults
from tests.server.conftest import running_server

GEN = {"bos_token_id": 1, "do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.05,
       "repetition_penalty": 1.1, "max_new_tokens": 99}


def _model_dir(tmp_path: Path, gen: dict) -> Path:
    (tmp_path / "generation_config.json").write_text(json.dumps(gen))
    return tmp_path


def test_generation_config_values_are_read(tmp_path) -> None:
    d = _model_dir(tmp_path, GEN)
    want = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1}
    assert model_sampling_defaults(str(d)) == want
    assert sampling_defaults("model", str(d)) == want and sampling_defaults("openai", str(d)) == {}
    assert "temperature=0.6" in describe("model", want) and "OpenAI" in describe("openai", {})
    assert model_sampling_defaults(str(tmp_path / "missing")) == {} and model_sampling_defaults(None) == {}
    _model_dir(tmp_path, {"top_k": 0, "top_p": 1.5, "temperature": "hot", "min_p": None})
    assert model_sampling_defaults(str(tmp_path)) == {"top_k": -1}  # HF's 0 = off; invalid values left out


def test_missing_fields_take_the_defaults() -> None:
    defaults = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1}
    msgs = [{"role": "user", "content": "hi"}]
    assert sampling_fields(chat_request({"messages": msgs}), defaults) == defaults
    assert sampling_fields(chat_request({"messages": msgs}), {}) == {
        "temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}
    sent = chat_request({"messages": msgs, "temperature": 0, "top_k": None, "repetition_penalty": 1.0})
    assert sampling_fields(sent, defaults) == {**defaults, "temperature": 0, "repetition_penalty": 1.0}


@pytest.fixture(scope="module")
def greedy_model(tmp_path_factory) -> Path:
    """The default model's files (linked) with a generation_config.json that sets temperature 0."""
    from ddtree_serve.model_executor.default_model import ensure_default_model

    src = Path(ensure_default_model())
    dst = tmp_path_factory.mktemp("greedy-model")
    for f in src.iterdir():
        if f.name != "generation_config.json":
            (dst / f.name).symlink_to(f)
    gen = json.loads((src / "generation_config.json").read_text())
    (dst / "generation_config.json").write_text(json.dumps({**gen, "temperature": 0.0, "top_k": 40}))
    return dst


def test_a_server_applies_the_checkpoint_defaults(greedy_model, tmp_path) -> None:
    msgs = [{"role": "user", "content": "Write a poem about the sea."}]
    with running_server(["--model-path", str(greedy_model), "--served-model-name", "m", "--dtype", "float32"],
                        tmp_path) as srv:
        info = httpx.get(srv.base + "/model_info", timeout=30).json()
        assert info["preferred_sampling_params"] == {"temperature": 0.0, "top_k": 40}
        assert "sampling defaults from generation_config.json: temperature=0.0, top_k=40" in srv.log.read_text()

        def chat(**kw) -> str:
            body = {"messages": msgs, "max_tokens": 24, **kw}
            return httpx.post(srv.base + "/v1/chat/completions", json=body, timeout=120).json()[
                "choices"][0]["message"]["content"]

        def messages() -> dict:
            return httpx.post(srv.base + "/v1/messages", json={"messages": msgs, "max_tokens": 24},
                              timeout=120).json()

        def responses() -> dict:
            return httpx.post(srv.base + "/v1/responses", json={"input": msgs[0]["content"], "max_output_tokens": 24},
                              timeout=120).json()

        greedy = chat(temperature=0)
        # the other eight requests at once (one batch instead of eight in turn; float32: a greedy row in a batch
        # equals greedy alone, and a seeded row's draws do not depend on the batch)
        with ThreadPoolExecutor(8) as ex:
            plain = [ex.submit(chat) for _ in range(2)]
            null = ex.submit(chat, temperature=None)
            seeded = [ex.submit(chat, temperature=1.0, seed=s) for s in range(4)]
            m_fut, r_fut = ex.submit(messages), ex.submit(responses)
        assert plain[0].result() == plain[1].result() == greedy  # no temperature: the checkpoint's 0
        assert null.result() == greedy  # null means the default
        sampled = {f.result() for f in seeded}
        assert sampled != {greedy}  # a request's own value wins
        m = m_fut.result()
        assert m["content"][0]["text"] == greedy
        r = r_fut.result()
        assert r["output"][0]["content"][0]["text"] == greedy
        assert r["temperature"] == 0.0 and r["top_p"] == 1.0  # the values in force are echoed


@pytest.mark.slow  # a second server start
def test_sampling_defaults_openai_ignores_the_checkpoint(greedy_model, tmp_path) -> None:
    msgs = [{"role": "user", "content": "Write a poem about the sea."}]
    with running_server(["--model-path", str(greedy_model), "--sampling-defaults", "openai", "--dtype", "float32"],
                        tmp_path, name="openai") as srv:
        assert httpx.get(srv.base + "/model_info", timeout=30).json()["preferred_sampling_params"] is None
        assert "sampling defaults: OpenAI's (--sampling-defaults openai)" in srv.log.read_text()
        body = {"messages": msgs, "max_tokens": 24}
        texts = {httpx.post(srv.base + "/v1/chat/completions", json={**body, "seed": s}, timeout=120).json()[
            "choices"][0]["message"]["content"] for s in range(4)}
        greedy = httpx.post(srv.base + "/v1/chat/completions", json={**body, "temperature": 0}, timeout=120).json()[
            "choices"][0]["message"]["content"]
        assert texts != {greedy}  # OpenAI's temperature 1: sampled
