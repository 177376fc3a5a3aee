"""The configuration's GPU class: plan sizes with its memory; serve warns when its GPU is another size."""

from __future__ import annotations

import logging

from ddtree_serve.model_executor.memory import GIB
from ddtree_serve.server.config import ServerConfig
from ddtree_serve.server.machines import GPU_MEMORY_GIB, machine_memory_mismatch
from ddtree_serve.server.memory_sizing import ModelFacts, size_startup_memory

FACTS = ModelFacts(vocab_size=1000, max_context_len=4096, kv_bytes_per_token=70272, budget=8, block_size=8)


def test_mismatch_rule() -> None:
    assert machine_memory_mismatch(None, 96 * GIB) is None
    assert machine_memory_mismatch("b300", int(275040 * 2**20)) is None  # a few percent under the nominal figure
    warning = machine_memory_mismatch("b300", int(95.6 * GIB))
    assert warning and "b300" in warning and "95.6 GiB" in warning
    assert set(GPU_MEMORY_GIB) >= {"b300", "rtx-pro-6000"}


def test_startup_sizing_warns_on_cuda_only(caplog) -> None:
    config = ServerConfig.from_flat({"machine": "b300", "device": "cuda", "max_running_requests": 4,
                                      "cuda_graph_max_bs": 0})
    probe = lambda _dev: (96 * GIB, 80 * GIB)  # noqa: E731  an RTX PRO 6000 with the weights resident
    with caplog.at_level(logging.WARNING):
        sizing = size_startup_memory(config, FACTS, "cuda", None, probe)
    assert sizing.kv.source == "mem_fraction_static" and sizing.kv.total_bytes == 96 * GIB
    assert any("written for b300" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        size_startup_memory(config, FACTS, "cuda", None, lambda _dev: (288 * GIB, 80 * GIB))
        size_startup_memory(config.replace("model", device="cpu"), FACTS, "cpu", None, probe)
    assert not caplog.records
