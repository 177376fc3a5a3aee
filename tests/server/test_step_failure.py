"""A scheduler step that raises, on a real server: its requests get an error, everyone else is served.

The server runs with the test-only fault hook (``DDTREE_TEST_FAIL_ON_TOKEN``, ddtree_serve/server/scheduling/fault_injection.py):
every step whose batch holds the token " kangaroo" raises in its target forward. A prompt holding it fails in prefill
(HTTP 500 before any output); a request forced to generate it (``logit_bias``) fails in the next
decode/verify step after it was streamed (an error event ends the stream). The server must stay healthy
through more failures than the old "three strikes and exit" rule allowed, keep streaming a request that
was running meanwhile, serve the next request, and hold no KV afterwards.
"""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ddtree_serve.server.scheduling.fault_injection import TEST_FAULT_ENV
from tests.server.conftest import free_port, start_server, wait_healthy

BAD_WORD = " kangaroo"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from ddtree_serve.model_executor.default_model import ensure_default_model
    from ddtree_serve.server.process_utils import load_tokenizer

    path = ensure_default_model()
    bad = load_tokenizer(path, True).encode(BAD_WORD, add_special_tokens=False)
    assert len(bad) == 1, bad
    port = free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    proc = start_server(["--port", str(port), "--max-total-tokens", "4096", "--max-running-requests", "4"], log,
                        env={TEST_FAULT_ENV: str(bad[0])})
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, base, 300, log)
        yield {"proc": proc, "base": base, "log": log, "bad": bad[0]}
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except Exception:  # noqa: BLE001
            proc.kill()


def _chat(base: str, content: str, **kw) -> httpx.Response:
    body = {"model": "default", "messages": [{"role": "user", "content": content}], "max_tokens": 4,
            "temperature": 0, **kw}
    return httpx.post(base + "/v1/chat/completions", json=body, timeout=300)


def _kv_used(base: str) -> float:
    for fam in text_string_to_metric_families(httpx.get(base + "/metrics", timeout=30).text):
        if fam.name == "ddtree_kv_used_tokens":
            return sum(s.value for s in fam.samples)
    raise AssertionError("no ddtree_kv_used_tokens")


def _events(lines: list[str]) -> list[dict]:
    return [json.loads(ln[6:]) for ln in lines if ln.startswith("data: ") and ln != "data: [DONE]"]


def test_failed_steps_fail_their_requests_and_the_server_goes_on(server) -> None:
    base = server["base"]
    # a healthy stream, already decoding while the failures happen
    healthy: list[str] = []
    first = threading.Event()

    def stream_healthy() -> None:
        body = {"model": "default", "messages": [{"role": "user", "content": "Count from one to fifty."}],
                "max_tokens": 64, "temperature": 0, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=600) as r:
            for line in r.iter_lines():
                if line:
                    healthy.append(line)
                    first.set()

    t = threading.Thread(target=stream_healthy)
    t.start()
    assert first.wait(300)
    for i in range(5):  # more than the 3 consecutive failures that used to end the server
        r = _chat(base, f"Tell me about the{BAD_WORD}, part {i}.", stream=bool(i % 2))
        assert r.status_code == 500, r.text
        err = r.json()["error"]
        assert "scheduler step" in err["message"] and err["type"] == "internal_error" and err["code"] == "500"
        assert httpx.get(base + "/health", timeout=30).status_code == 200
    assert t.is_alive()  # the failures happened while the healthy request was running
    t.join(600)
    events = _events(healthy)
    assert events and events[-1]["choices"][0]["finish_reason"] == "length" and healthy[-1] == "data: [DONE]"
    assert not any("error" in e for e in events)

    # a failure after output was streamed: the first token is forced to be the bad one
    with httpx.stream("POST", base + "/v1/chat/completions", timeout=300,
                      json={"model": "default", "messages": [{"role": "user", "content": "Name an animal."}],
                            "max_tokens": 8, "temperature": 0, "stream": True,
                            "stream_options": {"include_usage": True},
                            "logit_bias": {str(server["bad"]): 100}}) as r:
        assert r.status_code == 200
        lines = [ln for ln in r.iter_lines() if ln]
    events = _events(lines)
    assert any(BAD_WORD.strip() in (e["choices"][0]["delta"].get("content") or "") for e in events if e.get("choices"))
    # the error event is last, then [DONE]: no usage chunk after a failure (OpenAI sends usage on success only)
    assert "scheduler step" in events[-1]["error"]["message"] and lines[-1] == "data: [DONE]"
    assert not any("usage" in e for e in events), events

    ok = _chat(base, "Say hello.")
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] in ("stop", "length")
    deadline = time.time() + 30
    while _kv_used(base) != 0 and time.time() < deadline:  # stats arrive when the scheduler goes idle
        time.sleep(0.5)
    assert _kv_used(base) == 0
    assert server["proc"].poll() is None
    assert "failed 1 request(s) of the failed step" in server["log"].read_text()
