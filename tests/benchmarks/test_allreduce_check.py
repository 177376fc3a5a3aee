"""benchmarks/allreduce_check.py (run by benchmarks/gpu_check.sh over NCCL) on CPU: the script itself, two gloo
ranks through the server's TP group, small shapes. Every size's all-reduce and logits all-gather is exact and
timed; one rank is "cannot run" (exit 3, not a pass)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

SCRIPT = "benchmarks/allreduce_check.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    return subprocess.run([sys.executable, SCRIPT, "--device", "cpu", *args], env=env, capture_output=True,
                          text=True, timeout=300)


def test_two_gloo_ranks_exact_and_timed(tmp_path) -> None:
    """The sizes of a checkpoint's config (a multimodal wrapper's text_config, bfloat16 as Kimi's)."""
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"hidden_size": 96, "vocab_size": 101,
                                                                      "torch_dtype": "bfloat16"}}))
    out = tmp_path / "allreduce.json"
    res = _run("--world-size", "2", "--model-path", str(tmp_path), "--tokens", "1,5,32", "--iters", "3",
               "--warmup", "1", "--out", str(out))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "TP collectives exact on every rank" in res.stdout
    report = json.loads(out.read_text())
    assert (report["spec"]["hidden"], report["spec"]["vocab"], report["spec"]["dtype"]) == (96, 101, "bfloat16")
    assert report["backend"] == "gloo" and report["errors"] == [] and report["wrong_ranks"] == []
    rows = {(r["op"], r["tokens"]): r for r in report["results"]}
    assert set(rows) == {(op, t) for op in ("all_reduce", "all_gather") for t in (1, 5, 32)}
    assert rows["all_reduce", 32]["shape"] == [32, 96] and rows["all_reduce", 32]["bytes"] == 32 * 96 * 2
    assert rows["all_gather", 5]["shape"] == [5, 51]  # ceil(101 / 2): the LM head's padded shard
    assert all(r["exact"] and r["mean_us"] > 0 and r["busbw_gbps"] > 0 for r in rows.values())


def test_one_rank_cannot_run() -> None:
    res = _run("--world-size", "1")
    assert res.returncode == 3 and "NOT RUN" in res.stdout
