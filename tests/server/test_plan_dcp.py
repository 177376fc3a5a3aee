"""``ddtree-serve plan`` with decode context parallelism, on Kimi K2.6's published config (tests/data): each of
the 8 ranks stores 1/8 of the latent KV tokens, so the same pool holds 8x the tokens; the plan reports the
tokens per DCP rank and the longest context at batch 1 and at the preset's batch. Bad sizes and an MHA model
are the server's start-up errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ddtree_serve.server.cli.main import main

DATA = Path(__file__).resolve().parents[1] / "data"
CONFIGS = Path(__file__).resolve().parents[2] / "configs"
NO_DRAFTER = ["--speculative-draft-sources", "suffix", "--speculative-draft-model-path", ""]
PRESET = str(CONFIGS / "kimi-k2.6-8x-rtx-pro-6000.yaml")


@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("kimi-dcp")
    (d / "config.json").write_text((DATA / "kimi-k2.6-config.json").read_text())
    return d


def _plan(kimi_dir: Path, capsys, *extra: str) -> dict:
    # graphs off in both: the default captures without DCP and not with it (default_graph_max_bs)
    assert main(["plan", "--config", PRESET, "--model-path", str(kimi_dir), *NO_DRAFTER, "--json",
                 "--cuda-graph-max-bs", "0", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_dcp8_holds_eight_times_the_tokens(kimi_dir, capsys) -> None:
    base = _plan(kimi_dir, capsys)
    dcp = _plan(kimi_dir, capsys, "--decode-context-parallel-size", "8")
    assert base["kv_bytes_per_token"] == 61 * 576 * 2 and dcp["kv_bytes_per_token"] == 61 * 576 * 2 // 8
    pool = base["kv_tokens"] * base["kv_bytes_per_token"]  # the same bytes per rank give the pool
    assert abs(dcp["kv_tokens"] * dcp["kv_bytes_per_token"] - pool) <= 8 * 61 * 576 * 2
    assert dcp["kv_tokens"] % 8 == 0 and dcp["kv_tokens_per_dcp_rank"] == dcp["kv_tokens"] // 8
    assert 7.9 * base["kv_tokens"] <= dcp["kv_tokens"] <= 8.1 * base["kv_tokens"]
    assert dcp["decode_context_parallel_size"] == 8 and base["decode_context_parallel_size"] == 1
    assert dcp["longest_context_batch_1"] > 262144 > base["longest_context_batch_1"]  # a full K2.6 context fits
    margin = dcp["kv_tokens"] - dcp["longest_context_batch_1"]  # a verify step's temporary slots (budget <= 32)
    assert 0 < margin <= 33 and dcp["longest_context_max_batch"] == dcp["kv_tokens"] // 32 - margin  # 32 requests
    assert "sharded over 8 DCP ranks" in dcp["log_line"] and "longest context" in base["log_line"]


def test_bad_dcp_sizes_and_models_are_start_up_errors(kimi_dir, capsys, tiny_llama_factory) -> None:
    assert main(["plan", "--config", PRESET, "--model-path", str(kimi_dir), *NO_DRAFTER,
                 "--decode-context-parallel-size", "3"]) == 2
    assert "decode_context_parallel_size 3 must divide tp_size 8" in capsys.readouterr().err
    llama = tiny_llama_factory()
    assert main(["plan", "--model-path", str(llama), "--device", "cpu", "--tp-size", "2", "--speculative-algorithm", "none",
                 "--decode-context-parallel-size", "2", "--max-total-tokens", "64"]) == 2
    assert "needs an MLA model" in capsys.readouterr().err
