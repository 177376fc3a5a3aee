"""The overlap window (issue 47 item 4) in the real scheduler process over real ZMQ: the test plays the tokenizer
manager (PUSH to the scheduler) and the detokenizer (PULL from it). On the simulated device (ddtree_serve/sim/),
DDTree and plain greedy outputs equal the synthetic target's known continuation at batch 1, 32 and 128 with the
overlap on (the default: the previous step's outputs are sent, and new requests taken in, while the device runs)
and off (``--disable-overlap-schedule``); every request finishes once, and no output arrives after its end."""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import pytest
import zmq

from ddtree_serve.model_executor.models.simulated import greedy_continuation
from ddtree_serve.model_executor.sampling_params import SamplingParams
from ddtree_serve.server.config import ServerConfig
from ddtree_serve.server.io_struct import (
    BatchTokenOut,
    DetokenizeReq,
    GenerateReq,
    IpcEndpoints,
    SchedulerReady,
    TokenizedGenerateReq,
)
from ddtree_serve.server.scheduling.scheduler_process import run_scheduler_process
from ddtree_serve.server.startup import resolve_config
from ddtree_serve.sim.checkpoint import write_simulated_pair

VOCAB, N_TOKENS = 256, 20


def _serve(tmp_path, target: str, drafter: str, batch: int, overlap: bool, spec: bool) -> dict[str, list[int]]:
    flat = dict(model_path=target, device="cpu", dtype="float32", max_running_requests=batch,
                max_total_tokens=batch * 64 + 1024, disable_radix_cache=True, disable_overlap_schedule=not overlap)
    if spec:
        flat.update(speculative_algorithm="ddtree", speculative_draft_model_path=drafter, ddtree_budget=16,
                    speculative_draft_sources="dflash")
    config = resolve_config(ServerConfig.from_flat(flat, short_names=True))
    endpoints = IpcEndpoints.in_dir(str(tmp_path))
    ctx = zmq.Context()
    outs = ctx.socket(zmq.PULL)
    outs.bind(endpoints.detokenizer_input)
    proc = mp.get_context("spawn").Process(target=run_scheduler_process, args=(config, endpoints, os.getpid()))
    proc.start()
    got: dict[str, list[int]] = {}
    finished: set[str] = set()
    widest = 0  # most tokens one step gave one request (>= 3: a draft path of depth >= 2 was accepted)
    try:
        assert outs.poll(120_000) and isinstance(outs.recv_pyobj(), SchedulerReady)
        push = ctx.socket(zmq.PUSH)
        push.connect(endpoints.scheduler_input)
        params = SamplingParams(temperature=0, max_tokens=N_TOKENS, ignore_eos=True)
        prompts = {f"r{i}": [(5 * i + j) % 200 + 1 for j in range(4 + i % 3)] for i in range(batch)}
        for i, (rid, ids) in enumerate(prompts.items()):
            push.send_pyobj(TokenizedGenerateReq(GenerateReq(rid, ids, params), DetokenizeReq(rid)))
            if i == batch // 2:
                time.sleep(0.2)  # the rest arrive while steps run (taken in inside the window when it is on)
        deadline = time.monotonic() + 300
        while len(finished) < batch and time.monotonic() < deadline:
            if not outs.poll(1000):
                continue
            msg = outs.recv_pyobj()
            if isinstance(msg, BatchTokenOut):
                for o in msg.outputs:
                    assert o.error is None, o.error
                    assert o.rid not in finished, f"output for {o.rid} after its end"
                    got.setdefault(o.rid, []).extend(o.token_ids)
                    widest = max(widest, len(o.token_ids))
                    if o.finished:
                        finished.add(o.rid)
        push.close(0)
    finally:
        proc.terminate()
        proc.join(30)
        outs.close(0)
        ctx.term()
    assert finished == set(prompts)
    assert got == {rid: greedy_continuation(ids, N_TOKENS, VOCAB) for rid, ids in prompts.items()}
    assert widest >= 3 if spec else widest == 1, widest
    return got


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return write_simulated_pair(tmp_path_factory.mktemp("sim"), vocab=VOCAB, accept_prob=0.8)


@pytest.mark.parametrize("batch", [1, 32, 128])
@pytest.mark.parametrize("overlap", [True, False])
def test_ddtree_outputs_with_and_without_overlap(tmp_path, pair, batch: int, overlap: bool) -> None:
    _serve(tmp_path, *pair, batch=batch, overlap=overlap, spec=True)


def test_plain_outputs_with_overlap(tmp_path, pair) -> None:
    _serve(tmp_path, *pair, batch=32, overlap=True, spec=False)
