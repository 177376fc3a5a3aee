"""SIGTERM while the server is still loading stops every process it started (its own server, not the module's)."""

from __future__ import annotations

import signal
import time

from tests.server.conftest import alive, descendants, free_port, start_server


def test_sigterm_during_load_leaves_no_process(tmp_path) -> None:
    log = tmp_path / "s.log"
    proc = start_server(["--port", str(free_port())], log)
    deadline = time.time() + 60
    kids: set[int] = set()
    while time.time() < deadline and len(kids) < 2:
        kids = descendants(proc.pid)
        time.sleep(0.2)
    time.sleep(1.0)
    kids = descendants(proc.pid)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0, log.read_text()[-2000:]
    time.sleep(0.5)
    assert not [p for p in kids if alive(p)]

