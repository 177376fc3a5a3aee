"""The start-up warm-up (ddtree_serve/server/warmup.py) runs every forward path serving uses and leaves no trace.

Real schedulers over a tiny random Llama: without speculation the warm-up runs the target's extend and
decode forwards; with DDTree at a fixed budget it runs the drafter and the tree-verify forward too. After
it, no KV is held, nothing is cached, the statistics read zero and the first real request's output equals
the output of a scheduler that never warmed up. ``make_scheduler`` (what the server builds before it
reports ready, and the Engine) warms up.
"""

from __future__ import annotations

import logging

import pytest

from ddtree_serve.model_executor.sampling_params import SamplingParams
from ddtree_serve.server.config import ServerConfig
from ddtree_serve.server.io_struct import GenerateReq
from ddtree_serve.server.scheduling.scheduler import Scheduler
from ddtree_serve.server.warmup import warm_up


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from tests.conftest import write_tiny_llama_family
    from tests.speculative.drafter_utils import write_random_drafter

    target = write_tiny_llama_family(tmp_path_factory.mktemp("tiny-llama"), "llama")
    return target, write_random_drafter(target, tmp_path_factory.mktemp("drafter"), num_layers=1, block_size=4)


def _config(models, spec: bool) -> ServerConfig:
    target, drafter = models
    extra = dict(speculative_algorithm="ddtree", speculative_draft_model_path=drafter,
                 speculative_ddtree_budget=4) if spec else {}
    return ServerConfig.from_flat(dict(model_path=target, dtype="float32", device="cpu", context_length=256,
                                       max_running_requests=4, max_total_tokens=2048, **extra))


def _generate(s: Scheduler) -> list[int]:
    s.add_request(GenerateReq("r", [5, 17, 42, 99], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)))
    out = []
    while s.has_work():
        out += [t for o in s.step() for t in o.token_ids]
    return out


@pytest.mark.parametrize("spec,paths", [(False, ("target:extend", "target:decode")),
                                        (True, ("target:extend", "drafter", "target:target_verify"))])
def test_warm_up_runs_the_serving_paths_and_leaves_no_trace(models, spec, paths) -> None:
    cold = Scheduler(_config(models, spec))
    s = Scheduler(_config(models, spec))
    report = warm_up(s)
    assert set(paths) <= set(report.paths), report.paths
    slots = s.runner.slots
    assert slots.num_free == slots.num_slots and slots.num_free_rows == slots.max_rows
    assert not s.has_work() and s.kv.cached_tokens == 0
    stats = s.stats()
    assert stats.spec_verify_steps == stats.cache_query_tokens == 0
    if spec and s.spec.suffix is not None and s.spec.suffix.shared is not None:
        assert s.spec.suffix.shared.num_tokens == 0  # aborted, not finished: nothing joined the suffix index
    assert _generate(s) == _generate(cold)


def test_make_scheduler_warms_up_before_it_returns(models, caplog) -> None:
    from ddtree_serve.server.scheduling.scheduler_factory import make_scheduler
    from ddtree_serve.server.startup import resolve_config

    with caplog.at_level(logging.INFO, logger="ddtree_serve.server.warmup"):
        s = make_scheduler(resolve_config(_config(models, False)))
    assert any("warm-up ran target:extend, target:decode" in r.message for r in caplog.records)
    s.close()
