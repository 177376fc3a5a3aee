"""Capacity planning from config.json alone, on Kimi K2.6's published config (tests/data)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from model_executor.plan import GIB, make_plan

KIMI = Path(__file__).resolve().parents[1] / "data" / "kimi-k2.6-config.json"


def test_kimi_k26_tp8_weights_and_kv_per_token():
    plan = make_plan(KIMI, tp_size=8, gpu_memory_gb=96)
    # Published: ~69 GiB per GPU at TP 8. Tolerance +-5%: we also count the replicated q_a/kv_a
    # projections and the float32 router on every rank (~71.3 GiB).
    assert abs(plan.weight_bytes_per_rank / GIB - 69) <= 0.05 * 69
    # MLA latent, BF16: 61 layers x (512 + 64) x 2 bytes = 70272 B (~70 KB) per token, on every rank.
    assert plan.kv_bytes_per_token == 61 * 576 * 2
    assert plan.weight_breakdown["routed experts"] > 0.9 * plan.weight_bytes_per_rank  # INT4 packed + scales
    total_tp1 = make_plan(KIMI, tp_size=1, gpu_memory_gb=1000).weight_bytes_per_rank
    assert abs(total_tp1 / 1e9 - 595) <= 0.05 * 595  # ~595 GB checkpoint


def test_expert_parallel_plan_holds_whole_experts():
    """384 experts over 8 ranks split evenly: EP holds 48 whole experts, TP-MoE 1/8 of all 384, the same
    bytes up to the 16-byte ``weight_shape`` of each packed tensor (EP holds 8x fewer); over 5 ranks the largest EP block (77 experts) is what must fit."""
    tp_moe, ep = make_plan(KIMI, 8, 96), make_plan(KIMI, 8, 96, expert_parallel=True)
    diff = tp_moe.weight_breakdown["routed experts"] - ep.weight_breakdown["routed experts"]
    assert diff == 60 * (384 - 48) * 3 * 16  # 60 MoE layers x fewer experts x 3 tensors x weight_shape
    ep5 = make_plan(KIMI, 5, 96, expert_parallel=True).weight_breakdown["routed experts"]
    full = make_plan(KIMI, 1, 1000).weight_breakdown["routed experts"]
    assert ep5 == full * 77 // 384


def test_kv_capacity_and_budget_table_are_consistent():
    small, big = make_plan(KIMI, 8, 96), make_plan(KIMI, 8, 288, verify_workspace_gb=40)
    assert 0 < small.kv_tokens < big.kv_tokens
    # The server's rule (model_executor/memory.py): mem_fraction x total - in use (weights + 2 GiB overhead)
    # - the workspace (64 requests x (16 + 1) verify tokens + 64 x 7 drafted rows, 16 B per vocab entry).
    workspace = (64 * 17 + 64 * 7) * 163840 * 16
    assert small.workspace_bytes == workspace and small.max_verify_tokens == 64 * 17
    expect = (int(96 * GIB * 0.88) - small.weight_bytes_per_rank - 2 * GIB - workspace) // small.kv_bytes_per_token
    assert small.kv_tokens == expect
    for row in small.rows:
        assert row.max_batch == min(row.kv_bound, row.workspace_bound)
        assert row.max_batch * (small.context_len + row.budget + 1) <= small.kv_tokens
    assert small.best is not None and big.best.budget * big.best.max_batch > small.best.budget * small.best.max_batch
    assert make_plan(KIMI, 8, 64).best is None  # 64 GiB x 0.88 cannot hold ~71 GiB of weights
    assert "largest budget x batch" in small.table()


def test_plan_counts_unquantized_experts_in_bf16(tmp_path):
    cfg = json.loads(KIMI.read_text())
    del cfg["quantization_config"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    dense = make_plan(tmp_path, 8, 96).weight_breakdown["routed experts"]
    int4 = make_plan(KIMI, 8, 96).weight_breakdown["routed experts"]
    assert 3.4 < dense / int4 < 3.6  # 16 bits vs 4 bits + a BF16 scale per 32 values


def test_plan_command_prints_table_and_json(capsys):
    from server import cli_plan

    parser = argparse.ArgumentParser()
    cli_plan.add_arguments(parser)
    assert cli_plan.run(parser.parse_args(["--model-path", str(KIMI.parent / KIMI.name), "--tp-size", "8"])) == 0
    out = capsys.readouterr().out
    assert "weights per rank" in out and "KV bytes per token" in out and "70272" in out
    assert cli_plan.run(parser.parse_args(["--model-path", str(KIMI), "--gpu-memory-gb", "288", "--json"])) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["kv_bytes_per_token"] == 70272 and data["best"]["max_batch"] > 0
    with pytest.raises(ValueError):
        cli_plan.run(parser.parse_args(["--model-path", "/nonexistent"]))


def test_plan_subcommand_through_cli_when_registered(capsys):
    cli = pytest.importorskip("server.cli")
    if "plan" not in cli.subcommand_modules():
        pytest.skip("server.cli does not list the plan subcommand yet")
    assert cli.main(["plan", "--model-path", str(KIMI), "--tp-size", "8", "--gpu-memory-gb", "96"]) == 0
    assert "KV token capacity" in capsys.readouterr().out
