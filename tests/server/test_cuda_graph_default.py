"""CUDA graphs are on by default where the forward can be captured (``startup.resolve_cuda_graphs``,
``cuda_graph_runner.default_graph_max_bs``): on CUDA for the MLA model on the Triton kernels, up to the running
requests (at most 256); eager on CPU, on other backends and under decode context parallelism; an explicit value
stays as given. ``plan`` resolves alike, so it reserves the graphs serving captures. No GPU is needed: the
configs resolve their kernel backends for ``device: cuda`` without touching one."""

from __future__ import annotations

import json
import logging

import pytest

from ddtree_serve.model_executor.cuda_graph_runner import DEFAULT_GRAPH_MAX_BS, default_graph_max_bs
from ddtree_serve.server.cli.main import main
from ddtree_serve.server.config import ServerConfig
from ddtree_serve.server.startup import resolve_cuda_graphs, target_model_config
from tests.model_executor.tiny_deepseek import write_tiny_deepseek

pytest.importorskip("triton")


@pytest.fixture(scope="module")
def kimi(tmp_path_factory) -> str:
    return write_tiny_deepseek(tmp_path_factory.mktemp("kimi-graphs"), int4=True, kimi=True).path


def _resolved(kimi: str, **flat) -> int | None:
    config = ServerConfig.from_flat({"model_path": kimi, **flat})
    return resolve_cuda_graphs(config, target_model_config(config)).model.cuda_graph_max_bs


def test_default_on_where_the_forward_captures(kimi, caplog) -> None:
    with caplog.at_level(logging.INFO):
        assert _resolved(kimi, device="cuda", max_running_requests=32) == 32
    assert any("CUDA graphs up to batch 32: on by default" in r.getMessage() for r in caplog.records)
    assert _resolved(kimi, device="cuda", max_running_requests=1000) == DEFAULT_GRAPH_MAX_BS == 256
    # eager where a capture is not wired: CPU, the torch kernels, decode context parallelism
    assert _resolved(kimi, device="cpu") == 0
    assert _resolved(kimi, device="cuda", attention_backend="torch") == 0
    assert _resolved(kimi, device="cuda", tp_size=2, decode_context_parallel_size=2) == 0
    # given: as given (0 = off; an uncapturable model with N > 0 is the runner's start-up error)
    assert _resolved(kimi, device="cuda", cuda_graph_max_bs=0) == 0
    assert _resolved(kimi, device="cpu", cuda_graph_max_bs=8) == 8
    cfg = target_model_config(ServerConfig.from_flat({"model_path": kimi, "device": "cuda",
                                                       "moe_backend": "torch"}))
    bound, why = default_graph_max_bs(None, cfg, "cuda", 64)
    assert bound == 0 and "moe_backend 'torch'" in why


def test_plan_reserves_the_default_graphs(kimi, capsys) -> None:
    """The same configuration planned with the default and with graphs off: the default reserves the graphs'
    memory and its KV pool is smaller by it."""
    base = ["plan", "--model-path", kimi, "--device", "cuda", "--gpu-memory-gb", "0.01", "--overhead-gb", "0", "--max-running-requests", "8",
            "--speculative-algorithm", "ddtree", "--speculative-draft-sources", "suffix",
            "--speculative-ddtree-budget", "8", "--json"]
    assert main(base) == 0
    on = json.loads(capsys.readouterr().out)
    assert main([*base, "--cuda-graph-max-bs", "0"]) == 0
    off = json.loads(capsys.readouterr().out)
    assert off["graph_reserve_bytes"] == 0 < on["graph_reserve_bytes"]
    assert on["kv_tokens"] < off["kv_tokens"]
