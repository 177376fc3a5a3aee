"""KV pool sizing and the verify workspace (ddtree_serve/model_executor/memory.py) through the substitutable probe:
fake device totals -> the expected token count, the precedence of the overrides, the CPU default, the
minimum over two real gloo ranks, and the scheduler sizing its pool (target + drafter bytes) from a probe."""

from __future__ import annotations

import functools
import multiprocessing as mp

import pytest

from ddtree_serve.model_executor.memory import (
    CPU_KV_CAP_BYTES,
    GIB,
    LOGIT_ROW_BYTES_PER_ENTRY,
    device_memory,
    size_kv_pool,
    step_budget,
    verify_workspace,
)


def _probe(total: int, used: int, calls: list | None = None):
    def probe(dev):
        if calls is not None:
            calls.append(dev)
        return total, used

    return probe


def _no_probe(dev):
    raise AssertionError("an explicit size must not probe the device")


def test_cuda_pool_is_mem_fraction_of_total_minus_used_minus_workspace() -> None:
    calls: list = []
    s = size_kv_pool(
        "cuda", 70272, 2 * GIB, 10**9, mem_fraction_static=0.9, probe=_probe(96 * GIB, 75 * GIB, calls)
    )
    assert s.tokens == (int(0.9 * 96 * GIB) - 75 * GIB - 2 * GIB) // 70272  # 9.4 GiB of 70 KB tokens
    assert s.source == "mem_fraction_static" and calls and calls[0].type == "cuda"
    assert s.total_bytes == 96 * GIB and s.used_bytes == 75 * GIB
    assert "mem_fraction_static" in s.describe()
    # more memory in use -> fewer tokens; a tighter token limit wins
    assert (
        size_kv_pool(
            "cuda", 70272, 2 * GIB, 10**9, mem_fraction_static=0.9, probe=_probe(96 * GIB, 80 * GIB)
        ).tokens
        < s.tokens
    )
    assert (
        size_kv_pool(
            "cuda", 70272, 2 * GIB, 1000, mem_fraction_static=0.9, probe=_probe(96 * GIB, 75 * GIB)
        ).tokens
        == 1000
    )


def test_overrides_take_precedence_over_the_probe() -> None:
    s = size_kv_pool("cuda", 1000, GIB, 10**9, max_total_tokens=4096, kv_memory_gb=1.0, probe=_no_probe)
    assert (s.tokens, s.source) == (4096, "max_total_tokens")
    s = size_kv_pool("cuda", 1000, GIB, 10**9, kv_memory_gb=0.5, probe=_no_probe)
    assert (s.tokens, s.source) == (GIB // 2 // 1000, "kv_memory_gb")


def test_cpu_default_is_a_capped_share_of_available_host_memory() -> None:
    big = size_kv_pool("cpu", 46080, GIB, 10**9, probe=_probe(64 * GIB, 8 * GIB))
    assert big.source == "host_memory" and big.tokens == CPU_KV_CAP_BYTES // 46080
    small = size_kv_pool("cpu", 46080, GIB, 10**9, probe=_probe(4 * GIB, GIB))
    assert small.tokens == int(0.25 * (3 * GIB - GIB)) // 46080
    total, used = device_memory("cpu")  # the real probe on this host
    assert 0 < used < total


def test_no_room_is_an_error_naming_the_numbers() -> None:
    with pytest.raises(ValueError, match="no memory left for the KV cache"):
        size_kv_pool(
            "cuda", 70272, 2 * GIB, 10**9, mem_fraction_static=0.88, probe=_probe(64 * GIB, 60 * GIB)
        )
    with pytest.raises(ValueError, match="at least 16"):
        size_kv_pool("cuda", 70272, 0, 10**9, kv_memory_gb=1e-6, probe=_no_probe)


def test_workspace_sizes_the_full_batch_or_caps_a_stated_one() -> None:
    row = 49152 * LOGIT_ROW_BYTES_PER_ENTRY
    ws = verify_workspace(49152, 64, 16, 8)  # derived: 64 x 17 verify tokens + 64 x 7 drafted rows
    assert ws.bytes == (64 * 17 + 64 * 7) * row and ws.max_verify_tokens == 64 * 17 and ws.draft_rows == 448
    assert verify_workspace(49152, 64, None, None).max_verify_tokens == 64  # no speculation: decode rows
    stated = verify_workspace(163840, 128, 128, 8, workspace_gb=8.0)
    assert stated.max_verify_tokens == 8 * GIB // (163840 * 16) - 128 * 7
    assert step_budget(128, 128, stated.max_verify_tokens) == stated.max_verify_tokens // 128 - 1
    assert step_budget(16, 1, stated.max_verify_tokens) == 16  # the cap never raises a budget
    assert step_budget(16, 4, 4) == 0  # one verify token per request: root only, a plain decode step
    with pytest.raises(ValueError, match="cannot hold one step"):
        verify_workspace(163840, 128, 16, 8, workspace_gb=0.5)


def _rank_tokens(rank: int, addr: str, totals: tuple[int, ...], out) -> None:
    from ddtree_serve.model_executor.parallel_state import destroy_tp, init_tp
    from ddtree_serve.server.config import ParallelArgs

    tp = init_tp(ParallelArgs(tp_size=2), rank, "cpu", addr)
    try:  # a "CUDA" pool on each rank from its own (fake) device: every rank must end with the minimum
        s = size_kv_pool(
            "cuda",
            1 << 20,
            0,
            10**9,
            mem_fraction_static=0.5,
            tp=tp,
            probe=functools.partial(_fixed, totals[rank]),
        )
        out.put((rank, s.tokens, s.pool_bytes))
    finally:
        destroy_tp(tp)


def _fixed(total: int, dev) -> tuple[int, int]:
    return total, GIB


def test_min_over_two_gloo_ranks() -> None:
    from ddtree_serve.model_executor.parallel_state import free_local_addr

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    totals = (8 * GIB, 6 * GIB)  # rank 1 has the smaller device: 2 GiB of pool -> 2048 tokens of 1 MiB
    addr = free_local_addr()
    procs = [ctx.Process(target=_rank_tokens, args=(r, addr, totals, out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = sorted(out.get(timeout=120) for _ in procs)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    assert got == [(0, 2048, 3 * GIB), (1, 2048, 2 * GIB)]


def test_scheduler_sizes_target_plus_drafter_from_the_probe(tiny_llama_factory, tmp_path) -> None:
    from ddtree_serve.server.config import ServerConfig
    from ddtree_serve.server.scheduling.scheduler import Scheduler
    from tests.speculative.drafter_utils import write_random_drafter

    target = tiny_llama_factory("llama")
    drafter = write_random_drafter(target, tmp_path / "drafter", num_layers=1, block_size=4)
    cfg = ServerConfig.from_flat(
        dict(
            model_path=target,
            dtype="float32",
            device="cpu",
            context_length=256,
            max_running_requests=4,
            speculative_algorithm="ddtree",
            speculative_draft_model_path=drafter,
            speculative_ddtree_budget=6,
        )
    )
    calls: list = []
    total, used = 1 * GIB, GIB - 8 * 1024 * 1024  # 8 MiB available on a fake host
    s = Scheduler(cfg, memory_probe=_probe(total, used, calls))
    per_token = s.runner.kv_bytes_per_token + s.spec.draft_kv_bytes_per_token
    assert s.spec.draft_kv_bytes_per_token > 0 and s.kv_sizing.bytes_per_token == per_token
    assert s.workspace.max_verify_tokens == 4 * 7 and s.spec.max_verify_tokens == 4 * 7
    expect = min(int(0.25 * (total - used - s.workspace.bytes)) // per_token, 5 * 256)
    assert calls and s.runner.num_slots == s.kv_sizing.tokens == expect
    assert s.spec.draft_kv.k[0].shape[0] == expect + 1  # the drafter's cache has one slot per target slot


def test_nccl_and_cuda_graphs_are_reserved_before_the_pool() -> None:
    """NCCL buffers (CUDA, TP) and the CUDA graphs (static inputs counted exactly, pool estimated) come out of
    the measured pool; nothing is reserved off CUDA, and explicit sizes are not touched."""
    from ddtree_serve.model_executor.cuda_graph_runner import graph_batch_sizes
    from ddtree_serve.model_executor.memory import NCCL_RESERVE_BYTES, runtime_reserve

    sizes = graph_batch_sizes(64)
    assert runtime_reserve("cpu", 8, sizes, 9, 262144, 7168, 2).bytes == 0
    assert runtime_reserve("cuda", 1, (), 9, 262144, 7168, 2).bytes == 0
    tp8 = runtime_reserve("cuda", 8, (), 9, 262144, 7168, 2)
    assert tp8.nccl_bytes == NCCL_RESERVE_BYTES and tp8.graph_bytes == 0
    graphs = runtime_reserve("cuda", 8, sizes, 9, 262144, 7168, 2, captured_features=3 * 7168)
    assert graphs.graph_bytes > 64 * 262144 * 8  # at least the graphs' kv_indices [max_bs, max_context]
    wider = runtime_reserve("cuda", 8, sizes, 17, 262144, 7168, 2, captured_features=3 * 7168)
    assert wider.graph_bytes > graphs.graph_bytes  # a larger verify budget captures more tokens
    drafts = runtime_reserve("cuda", 8, sizes, 9, 262144, 7168, 2, captured_features=3 * 7168,
                             draft_logit_columns=15 * 20480)  # block 16, K2.6's vocabulary over 8 ranks
    assert drafts.graph_bytes - graphs.graph_bytes == sum(sizes) * 15 * 20480 * 4  # the graphed drafts' logits
    base = size_kv_pool("cuda", 70272, 2 * GIB, 10**9, mem_fraction_static=0.9, probe=_probe(96 * GIB, 75 * GIB))
    held = size_kv_pool("cuda", 70272, 2 * GIB, 10**9, mem_fraction_static=0.9, probe=_probe(96 * GIB, 75 * GIB),
                        reserve=graphs)
    assert held.pool_bytes == base.pool_bytes - graphs.bytes and held.tokens == held.pool_bytes // 70272
    assert "NCCL 1.00 GiB" in held.describe() and "CUDA graphs" in held.describe()
    fixed = size_kv_pool("cuda", 1000, GIB, 10**9, max_total_tokens=4096, probe=_no_probe, reserve=graphs)
    assert fixed.tokens == 4096
