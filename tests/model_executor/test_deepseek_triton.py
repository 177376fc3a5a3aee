"""The tiny DeepSeek-V3 / Kimi model with ``attention_backend="triton", moe_backend="triton"`` (Triton's
interpreter on CPU) against the reference backends and transformers: logits in extend, chunked extend,
decode and tree verify; greedy tokens through the Engine with and without DDTree, INT4 experts included.

Tolerances: logits atol 2e-4 / rtol 1e-4 vs transformers (as tests/model_executor/test_deepseek_v3.py) and
atol/rtol 1e-5 vs the reference backends (same float32 arithmetic, other summation order); greedy tokens
exactly equal.
"""

from __future__ import annotations

import pytest
import torch

from ddtree_serve.model_executor.forward_batch import ForwardMode
from ddtree_serve.model_executor.layers.mla import MLAAttention
from ddtree_serve.model_executor.layers.moe_experts import FusedExperts
from ddtree_serve.model_executor.layers.moe_int4 import Int4Experts
from ddtree_serve.model_executor.model_config import ModelConfig
from ddtree_serve.model_executor.model_runner import ModelRunner
from ddtree_serve.model_executor.sampling_params import SamplingParams
from tests.model_executor.test_deepseek_v3 import _extend, _fb, _hf, _hf_logits, _ids
from tests.model_executor.tiny_deepseek import write_reference, write_tiny_deepseek

pytest.importorskip("triton")

TRITON = dict(attention_backend="triton", moe_backend="triton")
REFERENCE = dict(attention_backend="torch", moe_backend="torch")


def _runner(path: str, int4_experts: str = "packed", **backends) -> ModelRunner:
    cfg = ModelConfig.load(path, "float32", "cpu", int4_experts, **backends)
    return ModelRunner(cfg, max_total_tokens=256, max_reqs=2, max_context=128)


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    tiny = write_tiny_deepseek(tmp_path_factory.mktemp("kimi-tri"), int4=True, kimi=True, seed=1)
    return tiny, write_reference(tiny, tmp_path_factory.mktemp("kimi-tri-ref"))


def _tree_logits(r: ModelRunner, prefix: int) -> torch.Tensor:
    toks, parents, depth = [7, 12, 13, 14, 15], [-1, 0, 0, 1, 3], [0, 1, 1, 2, 3]
    mask = torch.zeros(1, 5, 5, dtype=torch.bool)
    for i in range(5):
        j = i
        while j >= 0:
            mask[0, i, j], j = True, parents[j]
    fb = _fb(r, ForwardMode.TARGET_VERIFY, toks, [prefix + d for d in depth], 0, prefix, tree_mask=mask)
    return r.logits(r.forward(fb).hidden)


@pytest.mark.parametrize("int4_experts", ["packed", pytest.param("dequant", marks=pytest.mark.slow)])
def test_triton_backends_match_reference_and_transformers(kimi, int4_experts):
    """INT4-resident (W4A16 kernel) and dense experts: chunked extend, decode steps, then a verify tree."""
    tiny, ref_path = kimi
    tri, ref = _runner(tiny.path, int4_experts, **TRITON), _runner(tiny.path, int4_experts, **REFERENCE)
    layer = tri.model.layers[1]
    assert layer.self_attn.backend == "triton" and layer.mlp.experts.backend == "triton"
    assert isinstance(layer.mlp.experts, Int4Experts) == (int4_experts == "packed")
    ids = _ids(14, 3)
    outs = {}
    for name, r in (("tri", tri), ("ref", ref)):
        steps = [_extend(r, ids[:6]), _extend(r, ids[:12], prefix=6)]
        steps += [_extend(r, ids[: p + 1], prefix=p) for p in (12, 13)]
        outs[name] = (torch.cat(steps), _tree_logits(r, 14))
    torch.testing.assert_close(outs["tri"][0], outs["ref"][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(outs["tri"][1], outs["ref"][1], atol=1e-5, rtol=1e-5)
    hf = _hf(ref_path)
    torch.testing.assert_close(outs["tri"][0], _hf_logits(hf, ids), atol=2e-4, rtol=1e-4)
    for node, seq in [(0, [7]), (4, [7, 12, 14, 15])]:
        torch.testing.assert_close(outs["tri"][1][node], _hf_logits(hf, ids + seq)[-1], atol=2e-4, rtol=1e-4)


def test_engine_greedy_triton_equals_transformers_with_and_without_ddtree(kimi, tmp_path):
    from ddtree_serve.server.engine import Engine
    from tests.model_executor.tiny_deepseek import VOCAB
    from tests.speculative.drafter_utils import write_random_drafter
    from tests.speculative.scripted_drafts import greedy_script, install

    tiny, ref_path = kimi
    prompts = [_ids(7, 11), _ids(4, 12)]
    hf = _hf(ref_path)
    expected = []
    for p in prompts:
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([p]), max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0
            )
        expected.append(out[0, len(p) :].tolist())
    drafter = write_random_drafter(tiny.path, tmp_path / "d", num_layers=1, block_size=4)
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    ddtree = dict(speculative_algorithm="ddtree", draft_model_path=drafter, ddtree_budget=8)
    refs = {tuple(p): e for p, e in zip(prompts, expected, strict=True)}
    for spec in (
        {},
        ddtree,
    ):  # transformers == the reference backends: tests/model_executor/test_deepseek_v3.py
        eng = Engine(
            tiny.path,
            device="cpu",
            dtype="float32",
            max_total_tokens=256,
            int4_experts="packed",
            **TRITON,
            **spec,
        )
        # the scripted draft source (tests/speculative/scripted_drafts.py): accepted depth >= 2 paths
        log = install(eng, greedy_script(refs, VOCAB)) if spec else None
        try:
            got = [o.token_ids for o in eng.generate(input_ids=prompts, sampling_params=sp)]
        finally:
            eng.shutdown()
        assert got == expected, spec
        if log is not None:
            log.assert_accepted()


def test_backend_resolution_and_errors(kimi, default_model_path):
    tiny, _ = kimi
    cfg = ModelConfig.load(tiny.path, "float32", "cpu")
    assert (cfg.attention_backend, cfg.moe_backend) == ("torch", "torch")  # auto on CPU: the reference
    model = _runner(tiny.path, **REFERENCE).model
    assert all(m.backend == "torch" for m in model.modules() if isinstance(m, (MLAAttention, FusedExperts)))
    with pytest.raises(ValueError, match="not wired for MLA"):
        ModelConfig.load(tiny.path, "float32", "cpu", attention_backend="flashinfer")
    with pytest.raises(ValueError, match="moe_backend 'flashinfer' is not wired"):
        ModelConfig.load(tiny.path, "float32", "cpu", moe_backend="flashinfer")
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        ModelConfig.load(tiny.path, "float32", "cpu", attention_backend="cutlass")
    with pytest.raises(ValueError, match="MLA models only"):
        ModelConfig.load(default_model_path, "float32", "cpu", attention_backend="triton")
    with pytest.raises(ValueError, match="routed experts"):
        ModelConfig.load(default_model_path, "float32", "cpu", moe_backend="triton")
    assert ModelConfig.load(default_model_path, "float32", "cpu").moe_backend == "torch"


def test_triton_on_cpu_needs_the_interpreter(kimi, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        ModelConfig.load(kimi[0].path, "float32", "cpu", moe_backend="triton")


def test_cli_flags_reach_the_config():
    import argparse

    from ddtree_serve.server.cli.args import add_server_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_server_arguments(parser)
    args = parser.parse_args(["--model-path", "x", "--attention-backend", "triton", "--moe-backend", "torch"])
    cfg = config_from_args(args)
    assert (cfg.model.attention_backend, cfg.model.moe_backend) == ("triton", "torch")
    with pytest.raises(SystemExit):
        parser.parse_args(["--moe-backend", "marlin"])
