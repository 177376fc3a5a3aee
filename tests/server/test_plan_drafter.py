"""``ddtree-serve plan`` shows the DFlash drafter's share per rank (weights, its KV in the pool, its drafted rows in
the workspace), and the long-context RTX PRO 6000 preset's numbers (configs/kimi-k2.6-8x-rtx-pro-6000-long.yaml,
quoted in its comments and docs/DEPLOY.md) are what plan computes: Kimi K2.6's published config (tests/data) and
a drafter of the published K2.5/K2.6 drafter shapes (tests/data/kimi-k2.5-dflash-config.json; rms_norm_eps and
the K2.6 port's layer kinds added: 5 sliding layers of 2048, 1 full)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ddtree_serve.server.cli.main import main

DATA = Path(__file__).resolve().parents[1] / "data"
CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("plan-drafter")
    (root / "k26").mkdir()
    (root / "k26" / "config.json").write_text((DATA / "kimi-k2.6-config.json").read_text())
    cfg = json.loads((DATA / "kimi-k2.5-dflash-config.json").read_text())
    cfg.update(rms_norm_eps=1e-6, layer_types=["sliding_attention"] * 5 + ["full_attention"], use_sliding_window=True,
               sliding_window=2048, is_causal=False)
    (root / "drafter").mkdir()
    (root / "drafter" / "config.json").write_text(json.dumps(cfg))
    return root / "k26", root / "drafter"


def _plan(capsys, preset: str, *extra: str) -> tuple[int, str]:
    code = main(["plan", "--config", str(CONFIGS / preset), *extra])
    return code, capsys.readouterr().out


def test_long_preset_plan_and_drafter_share(dirs, capsys) -> None:
    k26, drafter = dirs
    args = ["--model-path", str(k26), "--speculative-draft-model-path", str(drafter)]
    code, out = _plan(capsys, "kimi-k2.6-8x-rtx-pro-6000-long.yaml", *args, "--json")
    assert code == 0
    plan = json.loads(out)
    share = plan["drafter_share"]
    assert share["kv_bytes_per_token"] == 6 * 2 * 1 * 128 * 2  # layers x (K, V) x 1 KV head per rank x d x bf16
    assert plan["kv_bytes_per_token"] == -(-61 * 584 // 8) + share["kv_bytes_per_token"]  # fp8 latent / DCP 8
    assert share["kv_pool_bytes"] == share["kv_bytes_per_token"] * plan["kv_tokens"]
    assert share["workspace_bytes"] > 0 and share["weights"] == plan["draft_bytes_per_rank"] > 0
    # the preset's comments and docs/DEPLOY.md quote these
    assert (plan["kv_tokens"], plan["kv_bytes_per_token"], plan["context_length"]) == (961320, 7525, 262144)
    assert plan["longest_context_batch_1"] >= 3 * 262144 and plan["longest_context_max_batch"] == 120132
    code, table = _plan(capsys, "kimi-k2.6-8x-rtx-pro-6000-long.yaml", *args)
    assert code == 0 and "drafter KV" in table and "3072 of 7525 B per pool token (41%" in table
    assert "drafter workspace" in table and "56 drafted rows" in table  # 8 requests x (block 8 - 1)


def test_short_preset_with_the_drafter(dirs, capsys) -> None:
    k26, drafter = dirs
    code, out = _plan(capsys, "kimi-k2.6-8x-rtx-pro-6000.yaml", "--model-path", str(k26),
                      "--speculative-draft-model-path", str(drafter), "--json")
    assert code == 0
    plan = json.loads(out)
    assert (plan["kv_tokens"], plan["kv_bytes_per_token"]) == (53765, 70272 + 3072)  # docs/DEPLOY.md (CUDA graphs on)
