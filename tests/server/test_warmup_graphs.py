"""issue 33 item 4: the start-up warm-up captures every CUDA graph serving replays and runs the Triton kernel
shapes, so that nothing is captured (or compiled) at first use.

Real schedulers over the tiny Kimi checkpoint (Triton MLA under the interpreter) with the CUDA-graph runner
on the CPU capture stand-in (tests/model_executor/graph_capture_standin.py: warm-ups run, capture records,
replay runs the static batch). After ``warm_up`` the runner is frozen with decode graphs (and, with DDTree,
full-tree verify graphs) at every padded batch size; serving batches of 1..``MAX_BS`` requests, plain and
DDTree (scripted drafts: accepted depth >= 2 paths), replays those graphs at every padded size, captures
nothing new, and DDTree's greedy tokens equal plain greedy's. The kernel-shape forwards write the padding
slot only.
"""

from __future__ import annotations

import pytest
import torch

from ddtree_serve.model_executor.cuda_graph_runner import (
    CudaGraphRunner,
    graph_batch_sizes,
    serving_graph_keys,
)
from ddtree_serve.model_executor.forward_batch import ForwardMode
from ddtree_serve.model_executor.sampling_params import SamplingParams
from ddtree_serve.server.config import ServerConfig
from ddtree_serve.server.io_struct import GenerateReq
from ddtree_serve.server.scheduling.scheduler import Scheduler
from ddtree_serve.server.warmup import kernel_shape_plan, run_kernel_shapes, warm_up
from tests.model_executor.graph_capture_standin import RecordingCapture
from tests.model_executor.tiny_deepseek import VOCAB, write_tiny_deepseek
from tests.speculative.scripted_drafts import greedy_script, install

pytest.importorskip("triton")

MAX_BS = 4  # padded sizes 1, 2, 4
BUDGET = 3  # verify graphs at q = 4
MAX_TOKENS = 6
PROMPTS = [[3, 17, 42, 99, 7], [11, 200, 300, 12], [5, 6, 7], [40, 41, 42, 43, 44, 45]]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from tests.speculative.drafter_utils import write_random_drafter

    path = str(write_tiny_deepseek(tmp_path_factory.mktemp("kimi"), int4=True, kimi=True, seed=3).path)
    return path, write_random_drafter(path, tmp_path_factory.mktemp("drafter"), num_layers=1, block_size=4)


def _scheduler(models, spec: bool) -> tuple[Scheduler, RecordingCapture]:
    """A scheduler whose runner replays through the capture stand-in (``--cuda-graph-max-bs`` needs CUDA)."""
    path, drafter = models
    extra = dict(speculative_algorithm="ddtree", speculative_draft_model_path=drafter,
                 speculative_ddtree_budget=BUDGET) if spec else {}
    s = Scheduler(ServerConfig.from_flat(dict(
        model_path=path, dtype="float32", device="cpu", attention_backend="triton", moe_backend="torch",
        context_length=64, max_running_requests=MAX_BS, max_total_tokens=1024, **extra)))
    r, capture = s.runner, RecordingCapture()
    r.graphs = CudaGraphRunner(r.model, r.kv, r.backend, graph_batch_sizes(MAX_BS), r.max_context, "cpu",
                               capture=capture)
    return s, capture


def _serve(s: Scheduler, n: int) -> list[list[int]]:
    """Greedy tokens of ``PROMPTS[:n]`` submitted together (one batch of ``n`` running requests)."""
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for i in range(n):
        s.add_request(GenerateReq(f"b{n}-{i}", PROMPTS[i], sp))
    out: dict[str, list[int]] = {f"b{n}-{i}": [] for i in range(n)}
    while s.has_work():
        for o in s.step():
            out[o.rid] += o.token_ids
    return [out[f"b{n}-{i}"] for i in range(n)]


def test_serving_graph_keys() -> None:
    sizes = graph_batch_sizes(8)  # 1, 2, 4, 8
    dec, ver = ForwardMode.DECODE, ForwardMode.TARGET_VERIFY
    assert serving_graph_keys(sizes, (), None) == [(dec, 1, (), b) for b in sizes]
    keys = serving_graph_keys(sizes, (1, 0), 5)
    assert keys[len(sizes):] == [(ver, 6, (1, 0), b) for b in sizes]
    # a verify workspace of 20 tokens: budget 5 up to 3 requests, then 4 (4 requests), 3 (5), 2 (6), 1 (7-8)
    capped = serving_graph_keys(sizes, (), 5, max_verify_tokens=20)[len(sizes):]
    assert capped == [(ver, 6, (), 1), (ver, 6, (), 2), (ver, 5, (), 4), (ver, 6, (), 4), (ver, 2, (), 8),
                      (ver, 3, (), 8), (ver, 4, (), 8)]
    assert serving_graph_keys(sizes, (), 5, max_verify_tokens=8)[-1] == (ver, 2, (), 4)  # 8 // 4 - 1 = 1 node


def test_warm_up_captures_every_graph_and_serving_captures_none(models) -> None:
    outs = {}
    for spec in (False, True):
        s, capture = _scheduler(models, spec)
        graphs = s.runner.graphs
        report = warm_up(s)
        keys = serving_graph_keys(graphs.batch_sizes, s.spec.capture_layer_ids if spec else (),
                                  BUDGET if spec else None, s.spec.max_verify_tokens if spec else None)
        assert report.graphs == len(keys) == len(graphs.graphs) == (6 if spec else 3)
        assert set(graphs.graphs) == {(m, q, tuple(ids), b) for m, q, ids, b in keys}
        assert graphs.frozen and graphs.captures == report.graphs == capture.events.count("capture")
        log = None
        if spec:  # scripted drafts around plain greedy: accepted depth >= 2 paths in the verify graphs
            refs = {tuple(p): t for p, t in zip(PROMPTS, outs[False][MAX_BS], strict=True)}
            log = install(s, greedy_script(refs, VOCAB))
        graphs.replays.clear()
        outs[spec] = {n: _serve(s, n) for n in range(1, MAX_BS + 1)}
        assert graphs.captures == report.graphs and capture.events.count("capture") == report.graphs
        # every padded size replayed: plain decode; with DDTree the full-tree verify of each batch's first step
        mode = ForwardMode.TARGET_VERIFY if spec else ForwardMode.DECODE
        assert {k[3] for k, n in graphs.replays.items() if k[0] == mode and n} == set(graphs.batch_sizes), mode
        if log is not None:
            log.assert_accepted()
    assert outs[True] == outs[False]  # lossless, batch by batch


def test_kernel_shapes_touch_only_the_padding_slot(models) -> None:
    s, _ = _scheduler(models, True)
    r = s.runner
    plan = kernel_shape_plan(r.max_context, BUDGET, long_contexts=False)
    assert {(m, q) for m, _, q, _ in plan} == {(ForwardMode.EXTEND, 16), (ForwardMode.DECODE, 1),
                                              (ForwardMode.TARGET_VERIFY, BUDGET + 1)}
    assert {k % 16 == 0 for *_, k in plan} == {True, False} and {b * q for _, b, q, _ in plan} >= {1, 16}
    g = torch.Generator().manual_seed(0)
    for k in r.kv.k:  # live KV everywhere
        k.copy_(torch.randn(k.shape, generator=g))
    before = [k.clone() for k in r.kv.k]
    seen = []
    inner = r.model.forward
    r.model.forward = lambda fb, kv, backend: seen.append((fb.mode, fb.batch_size, fb.max_q,
                                                            fb.kv_indices.shape[1])) or inner(fb, kv, backend)
    try:
        ran = run_kernel_shapes(r, s.spec.capture_layer_ids, BUDGET)
    finally:
        del r.model.forward
    assert list(ran) == plan == seen
    for b, a in zip(before, r.kv.k, strict=True):
        assert torch.equal(a[1:], b[1:])  # slot 0 is the padding slot
