"""``ddtree-serve plan`` prints the line the server's start-up logs for KV sizing, on the same arguments and
presets: the real scheduler is built on CPU (tiny random checkpoints in place of the presets' models, a given
device-memory figure) and its log line is compared with plan's, built from config.json on the meta device."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import pytest
import torch

from ddtree_serve.model_executor.memory import GIB
from ddtree_serve.model_executor.model_config import ModelConfig
from ddtree_serve.model_executor.model_runner import load_model
from ddtree_serve.model_executor.parallel_state import TPGroup
from ddtree_serve.model_executor.plan import module_bytes
from ddtree_serve.server.cli import plan as cli_plan
from ddtree_serve.server.cli import serve as cli_serve
from ddtree_serve.server.cli.args import config_from_args
from ddtree_serve.server.machines import GPU_MEMORY_GIB
from ddtree_serve.server.scheduling.scheduler import Scheduler
from ddtree_serve.server.startup import resolve_config
from ddtree_serve.speculative.worker_shape import drafter_model_config
from tests.model_executor.tiny_deepseek import write_tiny_deepseek
from tests.speculative.drafter_utils import write_random_drafter

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
PRESETS = sorted(p.name for p in CONFIGS.glob("*.yaml"))
OVERHEAD_GB = 0.25  # memory in use besides the weights (binary-exact, so both sides agree to the byte)
# What the presets ask of a GPU machine that 2 CPU cores cannot give a test: the CPU device, one rank, a
# short context, few requests and a fixed budget (the auto budget's start-up probe runs real forwards).
SMALL = ["--device", "cpu", "--tp-size", "1", "--decode-context-parallel-size", "1", "--context-length", "256",
         "--max-running-requests", "4", "--speculative-ddtree-budget", "6"]


def _parse(module, argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    return parser.parse_args(argv)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    from tests.conftest import write_tiny_llama_family

    root = tmp_path_factory.mktemp("plan-vs-startup")
    llama = write_tiny_llama_family(root / "llama")
    kimi = write_tiny_deepseek(root / "kimi", int4=True, kimi=True).path
    return {"llama": llama, "llama_drafter": str(write_random_drafter(llama, root / "llama-dflash", block_size=4)),
            "kimi": kimi, "kimi_drafter": str(write_random_drafter(kimi, root / "kimi-dflash", block_size=8))}


def _resident_bytes(argv: list[str]) -> int:
    """The bytes the server's target and drafter really hold once loaded (a separate load of the same files)."""
    cfg = resolve_config(config_from_args(_parse(cli_serve, argv)))
    m = cfg.model
    target_cfg = ModelConfig.load(m.model_path, m.dtype, m.device, m.int4_experts, m.attention_backend, m.moe_backend)
    target = load_model(target_cfg, TPGroup(), torch.device("cpu"))
    draft = cfg.speculative.draft_model_path
    drafter = load_model(drafter_model_config(draft, target_cfg, "cpu"), TPGroup(), torch.device("cpu"))
    return module_bytes(target) + module_bytes(drafter)


def _modes(preset: str) -> list[str]:
    """How the preset's KV pool is sized: its own max_total_tokens, or the device memory: its machine class's
    or a --gpu-memory-gb figure."""
    text = (CONFIGS / preset).read_text()
    if "max_total_tokens:" in text:
        return ["max_total_tokens"]
    return ["machine", "gpu_memory_gb"] if "machine:" in text else ["gpu_memory_gb"]


@pytest.mark.parametrize(("preset", "mode"), [(p, m) for p in PRESETS for m in _modes(p)])
def test_plan_prints_the_servers_startup_kv_line(preset, mode, checkpoints, caplog, capsys) -> None:
    kind = "kimi" if preset.startswith("kimi") else "llama"
    argv = ["--config", str(CONFIGS / preset), "--model-path", checkpoints[kind],
            "--speculative-draft-model-path", checkpoints[kind + "_drafter"], *SMALL]
    plan_argv = [*argv, "--overhead-gb", str(OVERHEAD_GB)]
    config = resolve_config(config_from_args(_parse(cli_serve, argv)))
    probed = []
    if mode == "max_total_tokens":
        total = in_use = 0
    else:
        in_use = _resident_bytes(argv) + int(OVERHEAD_GB * GIB)
        if mode == "machine":  # the GPU class the preset names: plan reads its memory
            total = int(GPU_MEMORY_GIB[config.cache.machine] * GIB)
        else:  # 2 MiB free: the CPU rule's quarter of them decides, not the token cap
            gpu_gb = (in_use + 2 * (1 << 20)) / GIB
            plan_argv += ["--gpu-memory-gb", repr(gpu_gb)]
            total = int(gpu_gb * GIB)

    def probe(device):
        assert mode != "max_total_tokens", "a preset with max_total_tokens must not probe the device"
        probed.append(device)
        return total, in_use

    with caplog.at_level(logging.INFO):
        scheduler = Scheduler(config, memory_probe=probe)
    server_lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("KV pool:")]
    assert len(server_lines) == 1 and bool(probed) == (mode != "max_total_tokens")

    assert cli_plan.run(_parse(cli_plan, plan_argv)) == 0
    plan_lines = [line.strip() for line in capsys.readouterr().out.splitlines() if line.strip().startswith("KV pool:")]
    assert plan_lines == server_lines
    source = {"max_total_tokens": "max_total_tokens"}.get(mode, "host_memory")
    assert f"(from {source};" in server_lines[0]
    # The numbers behind the line, to the byte (the line rounds to 0.01 GiB).
    assert cli_plan.run(_parse(cli_plan, [*plan_argv, "--json"])) == 0
    plan = json.loads(capsys.readouterr().out)
    kv, ws = scheduler.kv_sizing, scheduler.workspace
    assert (plan["kv_tokens"], plan["kv_bytes_per_token"], plan["device_memory_bytes"], plan["in_use_bytes"],
            plan["workspace_bytes"], plan["max_verify_tokens"]) == (
        kv.tokens, kv.bytes_per_token, kv.total_bytes, kv.used_bytes, ws.bytes, ws.max_verify_tokens)
    if mode == "gpu_memory_gb":
        assert kv.tokens < 5 * 256  # sized by the memory figure, below the (requests + 1) x context cap


def test_plan_of_the_default_model_downloads_nothing(tmp_path, monkeypatch, capsys) -> None:
    """`ddtree-serve plan` on the default model reads the shipped config.json when the model was never
    converted (issue 46 item 7): nothing is fetched, the cache stays empty; the budget table honours the
    configured bound of the auto budget (and shows a fixed budget alone)."""
    monkeypatch.setenv("DDTREE_SERVE_CACHE", str(tmp_path / "cache"))
    assert cli_plan.run(_parse(cli_plan, ["--gpu-memory-gb", "24", "--speculative-ddtree-max-budget", "24",
                                          "--json"])) == 0
    plan = json.loads(capsys.readouterr().out)
    assert not (tmp_path / "cache").exists()
    assert [r["budget"] for r in plan["rows"]] == [8, 16, 24]
    assert cli_plan.run(_parse(cli_plan, ["--gpu-memory-gb", "24", "--speculative-ddtree-budget", "6",
                                          "--json"])) == 0
    assert [r["budget"] for r in json.loads(capsys.readouterr().out)["rows"]] == [6]
