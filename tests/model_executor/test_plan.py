"""Capacity planning from config.json alone: the served model classes built on the meta device, on Kimi
K2.6's published config (tests/data) and tiny checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ddtree_serve.model_executor.cuda_graph_runner import graph_batch_sizes
from ddtree_serve.model_executor.memory import GIB, runtime_reserve
from ddtree_serve.model_executor.model_config import ModelConfig
from ddtree_serve.model_executor.parallel_state import TPGroup
from ddtree_serve.model_executor.plan import meta_model, module_bytes, rank_models, weight_breakdown
from ddtree_serve.server.cli.main import main

DATA = Path(__file__).resolve().parents[1] / "data"
CONFIGS = Path(__file__).resolve().parents[2] / "configs"
NO_DRAFTER = ["--speculative-draft-sources", "suffix", "--speculative-draft-model-path", ""]


@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("kimi")
    (d / "config.json").write_text((DATA / "kimi-k2.6-config.json").read_text())
    return d


def _short_kimi(tmp_path: Path, layers: int = 3, heads: int = 64, **changes) -> ModelConfig:
    """Kimi K2.6's config cut to a few layers (per-layer quantities scale), packed INT4 experts, BF16."""
    full = json.loads((DATA / "kimi-k2.6-config.json").read_text())
    full["text_config"].update(num_hidden_layers=layers, num_attention_heads=heads)
    tmp_path.mkdir(parents=True, exist_ok=True)
    full.update(changes)
    (tmp_path / "config.json").write_text(json.dumps(full))
    return ModelConfig.load(str(tmp_path), "bfloat16", "cuda", "packed")


def test_b300_preset_plan_kimi_weights_kv_and_pool(kimi_dir, capsys) -> None:
    """The B300 preset with suffix drafts alone: ~69 GiB per GPU at TP 8 (published; we also count the
    replicated q_a/kv_a projections and the float32 router), MLA latent KV 61 x 576 x 2 B per token, and the
    server's rule: 0.90 x 288 GiB - in use (weights + 2 GiB) - the workspace of 128 x 129 verify tokens - NCCL's
    1 GiB reserve."""
    assert main(["plan", "--config", str(CONFIGS / "kimi-k2.6-8x-b300.yaml"), "--model-path", str(kimi_dir),
                 *NO_DRAFTER, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    weights = plan["weight_bytes_per_rank"]
    assert abs(weights / GIB - 69) <= 0.05 * 69
    assert plan["weight_breakdown"]["routed experts"] > 0.9 * weights  # INT4 packed + scales
    assert plan["kv_bytes_per_token"] == 61 * 576 * 2 and plan["draft_bytes_per_rank"] == 0
    assert plan["device_memory_bytes"] == 288 * GIB and plan["memory"].endswith("(machine b300)")
    workspace = 128 * 129 * 163840 * 16
    assert plan["workspace_bytes"] == workspace and plan["max_verify_tokens"] == 128 * 129
    # TP 8 (NCCL); CUDA graphs up to 128 requests x 129 tree tokens (the preset's cuda_graph_max_bs)
    graphs = runtime_reserve("cuda", 8, graph_batch_sizes(128), 129, 262144, 7168, 2).graph_bytes
    assert plan["nccl_reserve_bytes"] == GIB and plan["graph_reserve_bytes"] == graphs > 128 * 262144 * 8
    # the MoonViT tower (replicated, BF16) and its activation peak for the largest image
    assert 0.85e9 < plan["weight_breakdown"]["vision tower+proj"] < 1.0e9
    encoder = plan["encoder_reserve_bytes"]
    # the largest image: in_patch_limit 16384 (no preprocessor_config.json here: the published default) plus the
    # merge padding of a 512-patch side, (16384 + 2 * 512 + 1) patches, with a fused attention kernel
    assert encoder == (16384 + 2 * 512 + 1) * ((6 * 1152 + 4304) * 2 + 2 * 1152 * 4)
    expect = (int(0.90 * 288 * GIB) - weights - 2 * GIB - workspace - GIB - graphs - encoder) // (61 * 576 * 2)
    assert plan["kv_tokens"] == expect and plan["kv_source"] == "mem_fraction_static"
    assert plan["log_line"].startswith(f"KV pool: {expect} tokens x 70272 B")
    # text only (--max-images-per-request 0): no tower, no encoder reserve, the difference goes to the KV pool
    assert main(["plan", "--config", str(CONFIGS / "kimi-k2.6-8x-b300.yaml"), "--model-path", str(kimi_dir),
                 *NO_DRAFTER, "--max-images-per-request", "0", "--json"]) == 0
    text = json.loads(capsys.readouterr().out)
    assert "vision tower+proj" not in text["weight_breakdown"] and text["encoder_reserve_bytes"] == 0
    assert text["weight_bytes_per_rank"] == weights - plan["weight_breakdown"]["vision tower+proj"]
    assert text["kv_tokens"] == (int(0.90 * 288 * GIB) - text["weight_bytes_per_rank"] - 2 * GIB - workspace
                                 - GIB - graphs) // (61 * 576 * 2)
    # The B300 preset on 96 GiB GPUs: serve's start-up error (weights + the 128 x 128 workspace leave no pool).
    assert main(["plan", "--config", str(CONFIGS / "kimi-k2.6-8x-b300.yaml"), "--model-path", str(kimi_dir),
                 *NO_DRAFTER, "--gpu-memory-gb", "96"]) == 2
    assert "no memory left for the KV cache" in capsys.readouterr().err


def test_whole_checkpoint_at_tp1(kimi_dir) -> None:
    cfg = ModelConfig.load(str(kimi_dir), "bfloat16", "cuda", "packed")
    assert abs(module_bytes(meta_model(cfg, TPGroup())) / 1e9 - 595) <= 0.05 * 595  # ~595 GB checkpoint


def test_expert_parallel_holds_whole_experts(tmp_path) -> None:
    """384 experts over 8 ranks: EP holds 48 whole experts, TP-MoE 1/8 of all 384; over 5 ranks rank 0
    holds the largest EP block, 77 experts (80 attention heads here, so that MLA splits 5 ways)."""
    cfg = _short_kimi(tmp_path, heads=80)
    experts = lambda tp: weight_breakdown(meta_model(cfg, tp))["routed experts"]  # noqa: E731
    full = experts(TPGroup())
    assert experts(TPGroup(0, 8, expert_parallel=True)) == full // 8 == experts(TPGroup(0, 8))
    assert experts(TPGroup(0, 5, expert_parallel=True)) == full * 77 // 384


def test_unquantized_experts_count_in_bf16(tmp_path) -> None:
    int4 = weight_breakdown(meta_model(_short_kimi(tmp_path / "a"), TPGroup(0, 8)))["routed experts"]
    dense_cfg = _short_kimi(tmp_path / "b", quantization_config=None)
    dense = weight_breakdown(meta_model(dense_cfg, TPGroup(0, 8)))["routed experts"]
    assert 3.4 < dense / int4 < 3.6  # 16 bits vs 4 bits + a BF16 scale per 32 values


def test_uneven_partitions_plan_every_rank(tiny_llama_factory, capsys) -> None:
    """3 KV heads over 2 ranks: rank 0 holds 2 (more KV per token), rank 1 holds 1; the pool is the
    minimum over ranks, and rank 0's line carries it (the real ranks agree on it: tests/model_executor/
    test_memory.py, two gloo ranks)."""
    from ddtree_serve.server.cli.args import config_from_args
    from ddtree_serve.server.plan import make_plan
    from tests.server.test_plan_vs_startup import _parse

    path = tiny_llama_factory(num_attention_heads=6, num_key_value_heads=3, hidden_size=96)
    cfg = ModelConfig.load(path, "float32", "cpu")
    assert [m.rank for m in rank_models(cfg, None, 2, False)] == [0, 1]
    assert [m.rank for m in rank_models(cfg, None, 1, False)] == [0]
    from ddtree_serve.server.cli import plan as cli_plan

    plan = make_plan(config_from_args(_parse(cli_plan, ["--model-path", path, "--tp-size", "2", "--device", "cpu",
                                                        "--speculative-algorithm", "none"])), 0.01, 0.0)
    r0, r1 = plan.ranks
    assert r0.facts.kv_bytes_per_token == 2 * r1.facts.kv_bytes_per_token and r0.weight_bytes > r1.weight_bytes
    assert r0.kv_tokens != r1.kv_tokens and plan.sizing.kv.tokens == min(r0.kv_tokens, r1.kv_tokens)
    assert plan.sizing.kv.bytes_per_token == r0.facts.kv_bytes_per_token
    assert "rank 1:" in plan.table() and plan.log_line in plan.table()


def test_unknown_device_memory_is_an_error(kimi_dir, capsys) -> None:
    assert main(["plan", "--model-path", str(kimi_dir), "--device", "cuda", "--speculative-algorithm", "none",
                 "--tp-size", "8"]) == 2
    assert "--gpu-memory-gb or --machine" in capsys.readouterr().err
