"""GPU check: CUDA-graph replay of decode and verify forwards equals the eager forward (tiny Kimi INT4,
Triton backends), directly, in KV written to a fresh pool, after capturing a new batch size with live KV in
the pool, and through the Engine's greedy tokens with and without DDTree."""

from __future__ import annotations

import pytest
import torch

from ddtree_serve.model_executor.sampling_params import SamplingParams
from ddtree_serve.server.engine import Engine
from tests.model_executor.tiny_deepseek import VOCAB, write_tiny_deepseek
from tests.speculative.drafter_utils import write_random_drafter
from tests.speculative.scripted_drafts import greedy_script, install

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_graph_replay_equals_eager(tmp_path):
    from ddtree_serve.model_executor.cuda_graph_runner import CudaGraphRunner
    from ddtree_serve.model_executor.forward_batch import ForwardMode, build_forward_batch
    from ddtree_serve.model_executor.model_config import ModelConfig
    from ddtree_serve.model_executor.model_runner import ModelRunner

    path = write_tiny_deepseek(tmp_path, int4=True, kimi=True, moe_intermediate_size=64).path
    cfg = ModelConfig.load(
        path, "float32", "cuda", "packed", attention_backend="triton", moe_backend="triton"
    )
    r = ModelRunner(cfg, max_reqs=8, max_context=64, device="cuda", max_total_tokens=512)
    graphs = CudaGraphRunner(r.model, r.kv, r.backend, (1, 2, 4, 8), 64, "cuda")
    dev = torch.device("cuda")
    lens = torch.tensor([9, 4, 6], device=dev)
    for b, n in enumerate(lens.tolist()):
        slots = r.slots.place(torch.tensor([b]), torch.tensor([0]), torch.tensor([n]))
        r.forward(
            build_forward_batch(
                ForwardMode.EXTEND,
                torch.arange(n, device=dev) + 3 * b,
                torch.arange(n, device=dev),
                slots,
                r.slots.table,
                torch.tensor([b], device=dev),
                torch.tensor([0]),
                torch.tensor([n]),
            )
        )
    idx = torch.arange(3, device=dev)
    for mode, q in ((ForwardMode.DECODE, 1), (ForwardMode.TARGET_VERIFY, 4)):
        slots = r.slots.place_block(idx, lens, q)  # [3, q]
        tree = torch.tril(torch.ones(q, q, dtype=torch.bool, device=dev)).expand(3, q, q).contiguous()
        fb = build_forward_batch(
            mode,
            torch.arange(3 * q, device=dev) + 7,
            (lens[:, None] + torch.arange(q, device=dev)).reshape(-1),
            slots.reshape(-1),
            r.slots.table,
            idx,
            lens,
            torch.full((3,), q),
            tree_mask=tree,
        )
        with torch.inference_mode():
            want = r.forward(fb).hidden
            for _ in range(2):  # first call captures, second replays
                got = graphs.forward(fb).hidden
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_graph_kv_equals_eager_kv_in_a_fresh_pool(tmp_path):
    """The CPU test's check (tests/model_executor/test_cuda_graph_runner.py) with real CUDA graphs: the
    graph path writes the eager path's KV into slots the eager path never wrote, and nothing else."""
    from tests.model_executor.test_cuda_graph_runner import check_fresh_pool_kv

    check_fresh_pool_kv(tmp_path, "cuda", True)


def test_capture_after_use_leaves_live_kv_alone(tmp_path):
    """issue 33 item 2 with real CUDA graphs: capturing a new batch size for a used query length writes
    nothing outside the step's own slots (and the padding slot)."""
    from tests.model_executor.test_cuda_graph_runner import check_capture_after_use

    check_capture_after_use(tmp_path, "cuda", True)


def test_engine_with_cuda_graphs_keeps_greedy_tokens(tmp_path):
    path = str(write_tiny_deepseek(tmp_path / "k", int4=True, kimi=True, moe_intermediate_size=64).path)
    drafter = write_random_drafter(path, tmp_path / "d", num_layers=1, block_size=4)
    prompts = [[3, 17, 42, 99, 7], [11, 200, 300, 12], [5, 6, 7]]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs: list[list[list[int]]] = []
    for graphs in (0, 4):
        for spec in ({}, dict(speculative_algorithm="ddtree", draft_model_path=drafter, ddtree_budget=8)):
            eng = Engine(
                path,
                device="cuda",
                dtype="float32",
                max_total_tokens=512,
                attention_backend="triton",
                moe_backend="triton",
                cuda_graph_max_bs=graphs,
                **spec,
            )
            # the scripted draft source around the first (eager, plain) run's tokens: accepted depth-2 paths
            log = install(eng, greedy_script({tuple(p): t for p, t in zip(prompts, outs[0], strict=True)},
                                             VOCAB)) if spec else None
            try:
                outs.append([o.token_ids for o in eng.generate(input_ids=prompts, sampling_params=sp)])
            finally:
                eng.shutdown()
            if log is not None:
                log.assert_accepted()
    assert all(o == outs[0] for o in outs)
