"""Real agent clients against a real server (issue 61; slow): a pinned Claude Code release from npm, installed
into ~/.cache/ddtree-serve/clients/, runs in print mode (``claude -p``) against the default model served with
the hermes tool-call parser, and must exit 0 with an answer printed.

    PYTHONPATH=$PWD python -m pytest -q -m slow tests/server/test_real_clients.py -s

Skipped (not failed) where npm is missing or the package cannot be installed (no registry access). Claude
Code runs with its tools off (``--tools ""``) and a one-line system prompt: its 24 tool definitions (64 KB)
do not fit the default model's 8,192-token context once the server writes them into the prompt (docs/API.md,
"Tools the model can see"; a prompt over the context is a 400, not a silent drop), and after its own long
system prompt the 135M model rambles on past what CPU decoding finishes in minutes. What is tested is the
protocol: Claude Code's requests (system-role messages, thinking, output_config.effort, context_management,
max_tokens 32000) are served and its print mode ends with exit status 0.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import running_server

CLAUDE_CODE = "2.1.197"  # pinned: the release this test was written against
CACHE = Path.home() / ".cache" / "ddtree-serve" / "clients"


def _install(package: str, version: str, binary: str) -> Path:
    """``package@version`` installed into the cache (once); the path of its ``binary``, or a skip."""
    if shutil.which("npm") is None:
        pytest.skip("npm is not installed")
    prefix = CACHE / f"{package.replace('/', '+')}-{version}"
    exe = prefix / "node_modules" / ".bin" / binary
    if not exe.exists():
        prefix.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--prefix", str(prefix),
                               f"{package}@{version}"], capture_output=True, text=True, timeout=900)
        if done.returncode != 0 or not exe.exists():
            pytest.skip(f"npm could not install {package}@{version}: {done.stderr[-500:]}")
    return exe


@contextmanager
def _agent_server(tmp_path: Path) -> Iterator:
    """The default model served as the agent clients' tests need it (hermes tool calls, float32)."""
    from ddtree_serve.model_executor.default_model import ensure_default_model

    ensure_default_model()
    args = ["--tool-call-parser", "hermes", "--served-model-name", "default", "--dtype", "float32"]
    with running_server(args, tmp_path, timeout=600) as srv:
        yield srv


@pytest.mark.slow
def test_claude_code_print_mode(tmp_path) -> None:
    claude = _install("@anthropic-ai/claude-code", CLAUDE_CODE, "claude")
    with _agent_server(tmp_path) as srv:
        home = tmp_path / "home"
        home.mkdir()
        env = {**os.environ, "HOME": str(home), "ANTHROPIC_BASE_URL": srv.base, "ANTHROPIC_API_KEY": "sk-local",
               "ANTHROPIC_MODEL": "default", "ANTHROPIC_SMALL_FAST_MODEL": "default",
               "ANTHROPIC_DEFAULT_HAIKU_MODEL": "default", "ANTHROPIC_DEFAULT_SONNET_MODEL": "default",
               "ANTHROPIC_DEFAULT_OPUS_MODEL": "default", "DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1",
               "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}
        # a short system prompt: the 135M model then answers in a line and stops (EOS) rather than rambling to
        # the room left (Claude Code's own max_tokens, 32000, lowered to it); a reply cut there is Claude Code's
        # "API Error: ... exceeded the output token maximum", exit status 1
        done = subprocess.run([str(claude), "-p", "say hi", "--model", "default", "--tools", "",
                               "--system-prompt", "You are a helpful assistant. Answer in one short sentence."], env=env,
                              cwd=tmp_path, capture_output=True, text=True, timeout=600)
        log = srv.log.read_text()
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-2000:], log[-3000:])
    assert done.stdout.strip(), done.stderr[-2000:]
    assert "POST /v1/messages" in log


CODEX = "0.171.0"  # pinned: the release this test was written against


@pytest.mark.slow
def test_codex_exec(tmp_path) -> None:
    """Codex CLI's ``codex exec`` through a custom provider with ``wire_api = "responses"``: its requests
    (developer messages, a namespace tool (multi_agent_v1) and a built-in one (web_search),
    ``include: ["reasoning.encrypted_content"]``, ``reasoning.summary``, ``store: false``) are served and it
    prints an answer with exit status 0."""
    codex = _install("@openai/codex", CODEX, "codex")
    with _agent_server(tmp_path) as srv:
        home = tmp_path / "codex"
        home.mkdir()
        (home / "config.toml").write_text(
            'model = "default"\nmodel_provider = "ddtree"\n\n[model_providers.ddtree]\nname = "ddtree"\n'
            f'base_url = "{srv.base}/v1"\nwire_api = "responses"\nenv_key = "DDTREE_KEY"\n')
        env = {**os.environ, "HOME": str(tmp_path), "CODEX_HOME": str(home), "DDTREE_KEY": "sk-local"}
        # Codex's own base instructions (17 KB) and goal tools do not fit the default model's 8,192 tokens
        # beside its other tools (written into the prompt: docs/API.md): a one-line instructions file instead
        (home / "instructions.md").write_text("You are a helpful assistant. Answer in one short sentence.\n")
        done = subprocess.run([str(codex), "exec", "--skip-git-repo-check", "-s", "read-only", "--disable", "goals",
                               "-c", f"model_instructions_file={home / 'instructions.md'}", "say hi"], env=env,
                              cwd=tmp_path, capture_output=True, text=True, timeout=900)
        log = srv.log.read_text()
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-3000:], log[-3000:])
    assert done.stdout.strip(), done.stderr[-2000:]
    assert "POST /v1/responses" in log


GUIDELLM = "0.8.1"  # pinned: the release issue 61 was measured with


def _install_python(package: str, version: str, binary: str) -> Path:
    """``package==version`` installed into its own virtual environment in the cache (once; torch pinned to the
    build these tests run with, so pip does not pull another); the path of its ``binary``, or a skip."""
    import torch

    prefix = CACHE / f"{package}-{version}"
    exe = prefix / "bin" / binary
    if not exe.exists():
        steps = [[sys.executable, "-m", "venv", str(prefix)],
                 [str(prefix / "bin" / "pip"), "install", "-q", f"torch=={torch.__version__.split('+')[0]}"],
                 [str(prefix / "bin" / "pip"), "install", "-q", f"{package}=={version}"]]
        for step in steps:
            done = subprocess.run(step, capture_output=True, text=True, timeout=1800)
            if done.returncode != 0:
                shutil.rmtree(prefix, ignore_errors=True)
                pytest.skip(f"could not install {package}=={version}: {done.stderr[-500:]}")
    return exe


def _inflight(base: str) -> float:
    text = httpx.get(base + "/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("ddtree_num_inflight_http_reqs{"))


@pytest.mark.slow
def test_guidellm_sweep(tmp_path) -> None:
    """guidellm's sweep (synchronous, throughput at up to 16 streams, then two constant rates between them;
    30 s each, 128 prompt / 64 output tokens, streamed chat completions) against the default server with
    speculation on: every benchmark finishes with 0 errored requests, requests succeed, and when guidellm
    has gone (its unfinished streams cut by the client) the server holds no request and stays healthy."""
    guidellm = _install_python("guidellm", GUIDELLM, "guidellm")
    from ddtree_serve.model_executor.default_model import ensure_default_model

    model = ensure_default_model()
    with running_server(["--served-model-name", "default"], tmp_path, timeout=600) as srv:
        report = tmp_path / "guidellm.json"
        done = subprocess.run([str(guidellm), "run", "--backend", f"kind=openai_http,target={srv.base}",
                               "--profile", "kind=sweep,sweep_size=4,max_concurrency=16",
                               "--constraint", "kind=max_duration,seconds=30",
                               "--data", "kind=synthetic_text,prompt_tokens=128,output_tokens=64",
                               "--tokenizer", f"kind=hf_auto,model={model}",
                               "--output", f"kind=json,path={report}", "--disable-progress"],
                              env={**os.environ, "HF_HUB_OFFLINE": "1", "GUIDELLM__MAX_WORKER_PROCESSES": "2"}, cwd=tmp_path, capture_output=True,
                              text=True, timeout=900)
        assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
        benchmarks = json.loads(report.read_text())["benchmarks"]
        for _ in range(120):
            if _inflight(srv.base) == 0:
                break
            time.sleep(0.5)
        assert _inflight(srv.base) == 0, srv.log.read_text()[-3000:]
        assert httpx.get(srv.base + "/health", timeout=30).status_code == 200
    counts = [{k: len(v) for k, v in b["requests"].items() if isinstance(v, list)} for b in benchmarks]
    kinds = [b["config"]["strategy"]["type_"] for b in benchmarks]
    assert len(benchmarks) == 4 and kinds[:2] == ["synchronous", "throughput"], (kinds, counts)
    assert all(c["errored"] == 0 for c in counts), counts
    assert all(c["successful"] > 0 for c in counts), counts
