"""Drain on SIGTERM (issue 61), on a real server process (default model): with 32 streams in flight over the
four generation APIs, SIGTERM stops admitting (a new request is a 503 with Retry-After, /health is a 503), a
short request already in flight finishes normally, and when ``--shutdown-timeout`` runs out every stream still
running ends with its API's final event (chat / completions ``finish_reason`` then ``[DONE]``; Messages
``message_delta`` with ``stop_reason`` then ``message_stop``; Responses ``response.incomplete``) before the
process exits with status 0."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time

import httpx
import pytest

from ddtree_serve.server.config import ServerConfig
from ddtree_serve.server.http.errors import APIError
from ddtree_serve.server.http.metrics import ServerMetrics
from ddtree_serve.server.http.serving_common import start_generation
from ddtree_serve.server.io_struct import IpcEndpoints
from ddtree_serve.server.tokenizer_manager import TokenizerManager
from tests.server.conftest import running_server

TIMEOUT_S = 8
LONG = 1500  # output tokens: far more than the drain lets run
COUNT = "Count from 1 to 5000, one number per line."
BODIES = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": COUNT}], "max_tokens": LONG,
                             "ignore_eos": True, "stream": True},
    "/v1/completions": {"prompt": COUNT, "max_tokens": LONG, "ignore_eos": True, "stream": True},
    "/v1/messages": {"messages": [{"role": "user", "content": COUNT}], "max_tokens": LONG, "stream": True},
    "/v1/responses": {"input": COUNT, "max_output_tokens": LONG, "stream": True},
}


SHORT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "ignore_eos": True, "stream": True}


def _stream(base: str, path: str, started: threading.Event, out: list, body: dict | None = None) -> None:
    lines: list[str] = []
    try:
        with httpx.stream("POST", base + path, json=body or BODIES[path], timeout=120) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if line.startswith("data: ") and not started.is_set() and len(lines) > 2:
                    started.set()
                lines.append(line)
        out.append((path, lines, None))
    except Exception as e:  # noqa: BLE001 - recorded, asserted below
        out.append((path, lines, repr(e)))


def _last_data(lines: list[str]) -> list[dict | str]:
    return [json.loads(ln[6:]) if ln != "data: [DONE]" else "[DONE]" for ln in lines if ln.startswith("data: ")]


def _check_well_formed(path: str, lines: list[str]) -> str:
    """The stream ended with its API's final event; the finish / stop reason it gave."""
    data = _last_data(lines)
    if path in ("/v1/chat/completions", "/v1/completions"):
        assert data[-1] == "[DONE]", data[-3:]
        finishes = [c["finish_reason"] for d in data[:-1] for c in d.get("choices", []) if c.get("finish_reason")]
        assert len(finishes) == 1, data[-3:]
        return finishes[0]
    if path == "/v1/messages":
        assert data[-1]["type"] == "message_stop" and data[-2]["type"] == "message_delta", data[-3:]
        return data[-2]["delta"]["stop_reason"]
    assert data[-1]["type"] in ("response.incomplete", "response.completed"), data[-1]
    return data[-1]["response"]["status"]


def test_sigterm_drains_streams_in_flight(tmp_path) -> None:
    with running_server(["--shutdown-timeout", str(TIMEOUT_S)], tmp_path) as srv:
        started = [threading.Event() for _ in range(32)]
        out: list = []
        threads = [threading.Thread(target=_stream, args=(srv.base, list(BODIES)[i % 4], started[i], out))
                   for i in range(32)]
        for t in threads:
            t.start()
        for e in started:
            assert e.wait(180), "a stream did not start"
        # a short request in flight (its first token out) when SIGTERM comes: it finishes normally
        short_started, short_out = threading.Event(), []
        quick = threading.Thread(target=_stream, args=(srv.base, "/v1/chat/completions", short_started, short_out,
                                                       SHORT))
        quick.start()
        assert short_started.wait(120)
        t0 = time.time()
        srv.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        refused = httpx.post(srv.base + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                                      "max_tokens": 2}, timeout=30)
        assert refused.status_code == 503 and refused.headers.get("retry-after"), refused.text
        assert "shutting down" in refused.json()["error"]["message"]
        assert httpx.get(srv.base + "/health", timeout=30).status_code == 503
        for t in [*threads, quick]:
            t.join(TIMEOUT_S + 60)
        assert srv.proc.wait(60) == 0, srv.log.read_text()[-3000:]
        elapsed = time.time() - t0
    assert _check_well_formed("/v1/chat/completions", short_out[0][1]) == "length"  # finished within the drain
    assert len(out) == 32 and not [e for _, _, e in out if e], [e for _, _, e in out if e]
    reasons = {path: set() for path in BODIES}
    for path, lines, _ in out:
        reasons[path].add(_check_well_formed(path, lines))
    assert reasons["/v1/chat/completions"] == {"abort"} and reasons["/v1/completions"] == {"abort"}, reasons
    assert reasons["/v1/messages"] <= {"max_tokens", "end_turn"}, reasons
    assert reasons["/v1/responses"] <= {"incomplete", "completed"}, reasons
    assert TIMEOUT_S <= elapsed < TIMEOUT_S + 30, elapsed
    assert "SIGTERM: draining" in srv.log.read_text() and "shutdown timeout" in srv.log.read_text()


def test_request_admitted_before_the_drain_is_a_503_not_an_error() -> None:
    """A request that passed admission but was still being prepared when SIGTERM came (the drain flag set
    between its admission check and its submission) is refused with the drain's 503 + Retry-After when it is
    submitted, never a 500, and nothing reaches the scheduler."""
    tm = TokenizerManager(ServerConfig(), IpcEndpoints.in_dir("/nonexistent"), None, ServerMetrics("m"))
    tm.ready = True
    tm.draining = True
    with pytest.raises(APIError) as e:
        asyncio.run(start_generation(None, tm, []))  # type: ignore[arg-type] - refused before the request is read
    assert e.value.status == 503 and e.value.headers and e.value.headers.get("Retry-After"), e.value.message
    assert "shutting down" in e.value.message and not tm.states
