"""Helpers for tests that run a real server process."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def descendants(pid: int) -> set[int]:
    """All live descendants of ``pid`` (from /proc)."""
    parent_of: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        parent_of[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    out, frontier = set(), {pid}
    while frontier:
        kids = {c for c, p in parent_of.items() if p in frontier}
        out |= kids
        frontier = kids
    return out


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def read_metrics(base: str, label: str | None = None) -> dict:
    """The server's /metrics: each sample name -> its value summed over labels; with ``label``, keyed by
    (name, that label's value) instead."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict = {}
    for fam in text_string_to_metric_families(httpx.get(base + "/metrics", timeout=30).text):
        for s in fam.samples:
            key = s.name if label is None else (s.name, s.labels.get(label))
            out[key] = out.get(key, 0.0) + s.value
    return out


def start_server(args: list[str], log_path: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """``ddtree-serve serve ARGS`` with its output in ``log_path``; ``env``: extra environment variables."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    log = open(log_path, "w")  # noqa: SIM115 - closed with the process
    return subprocess.Popen([sys.executable, "-m", "ddtree_serve.server.cli.main", "serve", *args], cwd=REPO, stdout=log,
                            stderr=subprocess.STDOUT, env=env)


def wait_healthy(proc: subprocess.Popen, base: str, timeout: float, log_path: Path) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"server not healthy after {timeout}s:\n{log_path.read_text()[-3000:]}")


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM, then kill after 30 s."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


@dataclass(frozen=True)
class ServerHandle:
    proc: subprocess.Popen
    base: str  # http://127.0.0.1:<port>
    log: Path


@contextmanager
def running_server(args: list[str], log_dir: Path, timeout: float = 240, name: str = "server") -> Iterator[ServerHandle]:
    """A real ``ddtree-serve serve`` process on a free port (``--port`` is added), healthy on entry, stopped
    on exit; its output goes to ``log_dir/<name>.log``."""
    port = free_port()
    log = log_dir / f"{name}.log"
    proc = start_server(["--port", str(port), *args], log)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_healthy(proc, base, timeout, log)
        yield ServerHandle(proc, base, log)
    finally:
        stop_server(proc)


@pytest.fixture(scope="package")
def shared_default_server(tmp_path_factory):
    """tests/server/test_server.py's default server (``serve_default``: same arguments) for the modules that only
    send it requests and read it (test_chat_fields.py, test_metrics.py): one start (~13 s) for both instead of
    one per module; stopped after the package's last test. test_server.py keeps a server of its own (its last
    test kills it)."""
    from tests.server.test_server import serve_default

    with serve_default(tmp_path_factory) as srv:
        yield srv
