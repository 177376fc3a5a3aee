"""benchmarks/gpu_check.sh on a machine without CUDA (quick: every part NOT AVAILABLE, the JSON written, exit 2,
at most 8 files under $OUT), the parts' order (by value) and time budget (benchmarks/gpu/registry.py), and the Kimi-shaped checkpoint writer (benchmarks/gpu/kimi_checkpoint.py) at tiny sizes: written in the
Hugging Face layout, loaded by the engine's model loader, one forward on CPU."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from benchmarks.gpu.kimi_checkpoint import KimiShape, write_kimi_checkpoint
from benchmarks.gpu.registry import DEADLINE_S, GROUPS, PARTS, PROBE_TIMEOUT_S

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU outcome")
def test_gpu_check_on_cpu_reports_every_part_not_available(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path / "out"), DDTREE_GPU_CHECK_WORK=str(tmp_path / "work"))
    p = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh")], capture_output=True, text=True,
                       env=env, timeout=120, cwd=ROOT)
    assert p.returncode == 2, p.stdout + p.stderr  # documented: CUDA not available
    report = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert report["finished"] and report["exit_code"] == 2
    assert list(report["parts"]) == [s.name for s in PARTS]
    for name, part in report["parts"].items():
        assert part["status"] == "NOT AVAILABLE", name
        assert part["reason"].startswith("CUDA not available"), part
    assert "torch" in report["environment"] and "libraries" in report["environment"]
    assert (tmp_path / "out" / "gpu_check.log").exists()
    files = sorted(str(f.relative_to(tmp_path / "out")) for f in (tmp_path / "out").rglob("*") if f.is_file())
    assert files == ["gpu_check.json", "gpu_check.log", "part_logs.txt"], files  # at most 8 come back


def test_parts_run_by_value_within_the_deadline():
    """Comparisons against a reference first (the seeded sampler and DCP kernel tests, then the kernels, model
    logits, graphs, lossless DDTree), compiles and speed last; the one-GPU parts' timeouts and the probe's add up
    within the deadline, which ends before the lent machine's 9 minutes."""
    names = [p.name for p in PARTS]
    groups = [GROUPS.index(p.group) for p in PARTS]
    assert groups == sorted(groups), names
    assert names[0] == "pytest_reference"
    reference = [p.name for p in PARTS if p.group == "reference"]
    for name in ("triton_kernels", "model_logits", "cuda_graphs", "ddtree_lossless"):
        assert name in reference
    assert [p.name for p in PARTS if p.group == "speed"] == names[-5:-2]
    assert {p.name for p in PARTS if p.group == "compile"} == {"triton_compiles"}
    one_gpu = sum(p.timeout_s for p in PARTS if p.min_gpus == 1)
    assert one_gpu + PROBE_TIMEOUT_S <= DEADLINE_S < 9 * 60 - 10
    assert all(p.min_start_s <= p.timeout_s for p in PARTS)
    for p in PARTS:  # every part's target exists
        module, fn = p.target.split(":")
        assert callable(getattr(importlib.import_module(f"benchmarks.gpu.{module}"), fn)), p.target


def test_tp8_shape_is_kimi_k26_per_rank():
    t = KimiShape.tp8().text_config()
    assert (t["kv_lora_rank"], t["qk_rope_head_dim"], t["qk_nope_head_dim"], t["v_head_dim"]) == (512, 64, 128, 128)
    assert (t["num_attention_heads"], t["hidden_size"], t["n_routed_experts"], t["num_experts_per_tok"]) == \
        (8, 7168, 384, 8)
    assert (t["moe_intermediate_size"], t["intermediate_size"], t["vocab_size"]) == (256, 2304, 20480)
    assert t["num_hidden_layers"] == 2 and t["first_k_dense_replace"] == 1


def test_tiny_kimi_checkpoint_loads_and_runs_on_cpu(tmp_path):
    from ddtree_serve.model_executor.model_config import ModelConfig
    from ddtree_serve.model_executor.model_runner import ModelRunner

    facts = write_kimi_checkpoint(tmp_path / "k", KimiShape.tiny(), "cpu")
    index = json.loads((tmp_path / "k" / "model.safetensors.index.json").read_text())
    files = {f.name for f in (tmp_path / "k").glob("*.safetensors")}
    assert set(index["weight_map"].values()) == files and len(files) == facts["files"] == 3
    names = set(index["weight_map"])
    assert "language_model.model.layers.1.mlp.experts.7.down_proj.weight_packed" in names
    assert "language_model.model.layers.0.mlp.gate_proj.weight" in names  # layer 0 dense
    cfg = ModelConfig.load(str(tmp_path / "k"), "float32", "cpu")
    assert cfg.architecture == "KimiK25ForConditionalGeneration"
    r = ModelRunner(cfg, max_reqs=2, max_context=64, device="cpu", max_total_tokens=128)
    fb = r.prepare_prefill([0], [0], [6], [3, 17, 42, 99, 7, 5])
    logits = r.logits(r.forward(fb).hidden)
    assert logits.shape == (6, 512) and bool(torch.isfinite(logits).all())
    assert float(logits.std()) > 0.5  # the lm_head's gain: logits spread, no near-uniform rows
