"""benchmarks/gpu_check.sh on a machine without CUDA (quick: every part NOT AVAILABLE, the JSON written, exit 2)
and the Kimi-shaped checkpoint writer (benchmarks/gpu/kimi_checkpoint.py) at tiny sizes: written in the
Hugging Face layout, loaded by the engine's model loader, one forward on CPU."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from benchmarks.gpu.kimi_checkpoint import KimiShape, write_kimi_checkpoint
from benchmarks.gpu.registry import PARTS

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
