"""The HTTP server with --tp-size 2 (gloo on CPU) serves a chat request; killing TP rank 1 makes it answer
503 and exit with status 1, leaving no process behind."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import alive, descendants, free_port, start_server, wait_healthy


def _children(pid: int) -> set[int]:
    out = set()
    for d in descendants(pid):
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            out.add(d)
    return out


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def test_tp2_server_chat_then_dead_rank_fails(tmp_path) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = tmp_path / "server.log"
    proc = start_server(["--model-path", "default", "--device", "cpu", "--dtype", "float32", "--tp-size", "2",
                         "--max-total-tokens", "2048", "--port", str(port), "--log-level", "warning"], log)
    try:
        wait_healthy(proc, base, 300, log)
        body = {"model": "default", "max_tokens": 6, "temperature": 0,
                "messages": [{"role": "user", "content": "Say hi."}]}
        r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"]
        # rank 1 is a spawned grandchild of the server (child of the scheduler process)
        direct = _children(proc.pid)
        followers = [p for p in descendants(proc.pid) - direct if "spawn_main" in _cmdline(p)]
        assert len(followers) == 1, (followers, [_cmdline(p) for p in descendants(proc.pid)])
        tree = descendants(proc.pid)
        os.kill(followers[0], signal.SIGKILL)
        # a request after the kill must end (error status or closed connection), never hang or succeed
        try:
            after = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60).status_code
        except httpx.TimeoutException:
            pytest.fail("a chat request hung after a TP rank died")
        except httpx.TransportError:  # the server closed the connection while exiting
            after = None
        assert after != 200, "a chat request succeeded after a TP rank died"
        statuses: list[int] = []
        deadline = time.time() + 60
        while proc.poll() is None and time.time() < deadline:
            try:
                statuses.append(httpx.get(f"{base}/health", timeout=2).status_code)
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        assert proc.wait(30) == 1, log.read_text()[-3000:]
        # once /health has reported the failure it never turns healthy again before the exit
        first_failed = next((i for i, s in enumerate(statuses) if s != 200), len(statuses))
        assert all(s == 503 for s in statuses[first_failed:]), statuses
        assert "rank 1" in log.read_text()
        time.sleep(1.0)
        assert not [p for p in tree if alive(p)], "orphan processes left"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
