"""``--enable-deterministic-inference`` (issue 60): the flag reaches the model runner, which then runs the
batch-invariant attention backend and row-invariant linears (MLA models: the row-invariant MLA attention and
MoE, ddtree_serve/kernels/mla_invariant.py, layers/moe_experts.py); flashinfer is refused under it."""

from __future__ import annotations

import argparse

import pytest

from ddtree_serve.kernels.attention import TorchAttentionBackend
from ddtree_serve.kernels.attention_invariant import InvariantAttentionBackend
from ddtree_serve.model_executor.layers.embedding import ParallelLMHead
from ddtree_serve.model_executor.layers.linear import _Linear
from ddtree_serve.model_executor.model_config import ModelConfig
from ddtree_serve.model_executor.model_runner import ModelRunner
from ddtree_serve.server.cli.args import add_server_arguments, config_from_args


def test_flag_parses_off_by_default() -> None:
    parser = argparse.ArgumentParser()
    add_server_arguments(parser)
    off = config_from_args(parser.parse_args([]))
    on = config_from_args(parser.parse_args(["--enable-deterministic-inference"]))
    assert off.model.enable_deterministic_inference is False
    assert on.model.enable_deterministic_inference is True


@pytest.mark.parametrize("on", [False, True])
def test_runner_switches_attention_and_linears(tiny_llama_factory, on) -> None:
    cfg = ModelConfig.load(tiny_llama_factory("llama"), "bfloat16", deterministic_inference=on)
    assert cfg.deterministic_inference is on and cfg.attention_backend == ("torch" if on else "auto")
    runner = ModelRunner(cfg, max_reqs=2, max_context=64, max_total_tokens=64)
    assert isinstance(runner.backend, InvariantAttentionBackend if on else TorchAttentionBackend)
    linears = [m for m in runner.model.modules() if isinstance(m, _Linear)]
    assert len(linears) == 4 * 3 and all(m.row_invariant is on for m in linears)  # qkv, o, gate_up, down x 3 layers
    heads = [m for m in runner.model.modules() if isinstance(m, ParallelLMHead)]
    assert len(heads) == 1 and heads[0].row_invariant is on


def test_mla_model_runs_the_invariant_path(tmp_path) -> None:
    """An MLA + MoE model (tiny Kimi): the mode keeps the resolved backends (torch on a CPU; triton when asked for,
    whose kernels run their invariant mode) and switches the MLA attention, the router and the routed experts
    with the linears."""
    from ddtree_serve.model_executor.layers.mla import MLAAttention
    from ddtree_serve.model_executor.layers.moe import MoEGate
    from ddtree_serve.model_executor.layers.moe_experts import FusedExperts
    from tests.model_executor.tiny_deepseek import write_tiny_deepseek

    mla = str(write_tiny_deepseek(tmp_path / "kimi", kimi=True).path)
    cfg = ModelConfig.load(mla, "bfloat16", deterministic_inference=True)
    assert (cfg.attention_backend, cfg.moe_backend) == ("torch", "torch")
    triton = ModelConfig.load(mla, "bfloat16", deterministic_inference=True, attention_backend="triton",
                              moe_backend="triton")  # (Triton's interpreter on this CPU: tests/conftest.py)
    assert (triton.attention_backend, triton.moe_backend) == ("triton", "triton")
    runner = ModelRunner(cfg, max_reqs=2, max_context=64, max_total_tokens=64)
    kinds = (MLAAttention, MoEGate, FusedExperts, _Linear, ParallelLMHead)
    switched = [m for m in runner.model.modules() if isinstance(m, kinds)]
    assert all(m.row_invariant for m in switched)
    assert {type(m) for m in switched} >= {MLAAttention, MoEGate, FusedExperts, ParallelLMHead}
    off = ModelRunner(ModelConfig.load(mla, "bfloat16"), max_reqs=2, max_context=64, max_total_tokens=64)
    assert not any(m.row_invariant for m in off.model.modules() if isinstance(m, kinds))


def test_flashinfer_refused(tiny_llama_factory) -> None:
    with pytest.raises(ValueError, match="auto or torch"):
        ModelConfig.load(tiny_llama_factory("llama"), "bfloat16", attention_backend="flashinfer",
                         deterministic_inference=True)
