"""The speculative step's host/device boundary under the sync-honest simulated device (ddtree_serve/sim/): how many
times a step synchronises, and how many of those fall between a forward's launch and its read-back point (the
overlap window). The budgets are today's counts (docs/BENCHMARKS.md): a change that adds a sync fails here; one
that removes syncs lowers them. The mutation test shows the count catches a ``.tolist()`` added right after the
verify forward's launch, which bench_scale's timings could not."""

from __future__ import annotations

import pytest
import torch

from ddtree_serve.model_executor.models.simulated import greedy_continuation
from ddtree_serve.server.engine import Engine, SamplingParams
from ddtree_serve.server.io_struct import GenerateReq
from ddtree_serve.sim.checkpoint import write_simulated_pair
from ddtree_serve.sim.device_clock import DeviceClock
from ddtree_serve.sim.device_tracker import DeviceTracker
from ddtree_serve.sim.machines import DeviceCostModel
from ddtree_serve.speculative.spec_worker import SpecWorker

VOCAB = 128
BATCH = 4
# (budget) -> (syncs per step, of them in the window) measured on main; lower them as syncs go
BUDGETS = {None: (1, 0), 16: (1, 0), "auto": (1, 0)}
SAMPLED_BUDGETS = {None: (1, 0), 16: (1, 0), "auto": (1, 0)}  # half the batch seeded sampling
_LONG = dict(max_tokens=64, ignore_eos=True)
# request features on every row: (params, {budget: (syncs per step, in the window)}); penalties, bias and
# min_tokens add none; logprobs add one read for all the asking rows
FEATURES = {
    "penalties": (SamplingParams(temperature=0, presence_penalty=0.5, frequency_penalty=0.3,
                                 repetition_penalty=1.1, **_LONG), {None: (1, 0), 16: (1, 0)}),
    "logit_bias": (SamplingParams(temperature=0, logit_bias={5: 2.0, 7: -100.0}, **_LONG), {None: (1, 0), 16: (1, 0)}),
    "min_tokens": (SamplingParams(temperature=0, min_tokens=40, stop_token_ids=(9,), **_LONG),
                   {None: (1, 0), 16: (1, 0)}),
    "logprobs": (SamplingParams(temperature=0, logprobs=3, **_LONG), {None: (2, 0), 16: (2, 0)}),
    # the simulator's matches are short: the suffix gate keeps the device path (a step it admits reads twice)
    "suffix_drafts": (SamplingParams(temperature=0, **_LONG), {16: (1, 0), "auto": (1, 0)}),
    "grammar": (SamplingParams(temperature=0, regex="[a-d]{8,80}", max_tokens=64),
                {None: (1, 0), 16: (4, 0), "auto": (4, 0)}),
}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return write_simulated_pair(tmp_path_factory.mktemp("sim"), vocab=VOCAB, accept_prob=0.8, tokenizer=True)


def _step_counts(pair, budget, steps: int = 3, sampled: bool = False, every: SamplingParams | None = None,
                 sources: str = "dflash") -> tuple[float, float, list]:
    target, drafter = pair
    spec = dict(speculative_algorithm="ddtree", speculative_draft_model_path=drafter, ddtree_budget=budget,
                speculative_draft_sources=sources) if budget is not None else {}
    eng = Engine(target, device="cpu", dtype="float32", max_running_requests=BATCH, disable_radix_cache=True,
                 max_total_tokens=4096, **spec)
    sched = eng.scheduler
    clock = sched.runner.model.clock
    greedy = every or SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    try:
        prompts = [[i + 1, 2, 3, 4] for i in range(BATCH)]
        for i, p in enumerate(prompts):
            params = greedy
            if sampled and i % 2:
                params = SamplingParams(temperature=0.7, top_p=0.9, top_k=20, seed=i, max_tokens=64, ignore_eos=True)
            sched.add_request(GenerateReq(f"r{i}", p, params))
        while len(sched.running) < BATCH:
            sched.step()
        sched.step()
        clock.reset_counters()
        for _ in range(steps):
            sched.step()
        c = clock.reset_counters()
        outs = {q.rid: list(q.output_ids) for q in sched.running}
    finally:
        eng.shutdown()
    for i, p in enumerate(prompts):  # exact under the tracker too (the greedy rows)
        got = outs[f"r{i}"]
        if not (sampled and i % 2) and every is None:
            assert got == greedy_continuation(p, len(got), VOCAB)
    return len(c.syncs) / steps, c.in_window / steps, c.syncs


@pytest.mark.parametrize("budget", list(BUDGETS))
def test_syncs_per_step_within_budget(pair, budget) -> None:
    syncs, in_window, events = _step_counts(pair, budget)
    most, most_in_window = BUDGETS[budget]
    where = sorted({f"{e.kind} {e.op} {e.where}{' [window]' if e.in_window else ''}" for e in events})
    assert syncs <= most and in_window <= most_in_window, "\n".join(where)


@pytest.mark.parametrize("budget", list(SAMPLED_BUDGETS))
def test_syncs_per_step_with_sampled_rows(pair, budget) -> None:
    syncs, in_window, events = _step_counts(pair, budget, sampled=True)
    most, most_in_window = SAMPLED_BUDGETS[budget]
    where = sorted({f"{e.kind} {e.op} {e.where}{' [window]' if e.in_window else ''}" for e in events})
    assert syncs <= most and in_window <= most_in_window, "\n".join(where)


@pytest.mark.parametrize("feature,budget", [(f, b) for f, (_, budgets) in FEATURES.items() for b in budgets])
def test_syncs_per_step_with_request_features(pair, feature, budget) -> None:
    params, budgets = FEATURES[feature]
    sources = "dflash,suffix" if feature == "suffix_drafts" else "dflash"
    syncs, in_window, events = _step_counts(pair, budget, every=params, sources=sources)
    most, most_in_window = budgets[budget]
    where = sorted({f"{e.kind} {e.op} {e.where}{' [window]' if e.in_window else ''}" for e in events})
    assert syncs <= most and in_window <= most_in_window, "\n".join(where)


def test_a_sync_added_after_the_verify_launch_is_caught(pair, monkeypatch) -> None:
    """The mutation of issue 57: a ``.tolist()`` of the verify logits' argmax right after the verify launch."""
    base, base_window, _ = _step_counts(pair, 16)
    real = SpecWorker._verify_forward

    def mutated(self, tree, idx, cached, host=None, padded=False, params=None, prepared=None):
        logits, captured, slots = real(self, tree, idx, cached, host, padded, params, prepared)
        logits.argmax(-1).tolist()  # the added read
        return logits, captured, slots

    monkeypatch.setattr(SpecWorker, "_verify_forward", mutated)
    syncs, in_window, events = _step_counts(pair, 16)
    assert syncs == base + 1 and in_window == base_window + 1 == 1
    assert any(e.op.endswith("tolist") and e.in_window and "test_sync_budget" in e.where for e in events)


def test_tracker_classifies_reads_shapes_copies_and_launches() -> None:
    clock = DeviceClock(DeviceCostModel())
    tracker = DeviceTracker(clock)
    dev = torch.device("cpu")
    with tracker:
        a = torch.tensor([1, 2, 3], device=dev)  # blocking copy in
        h = torch.tensor([1, 2, 3])  # host
        b = a * 2  # launch
        b[1:]  # view: nothing
        b[b > 2]  # launch (gt) + value-dependent shape
        h.tolist()  # host: nothing
        y = h.to(dev, non_blocking=True)  # asynchronous copy: no sync
        b.to("cpu", non_blocking=True)  # asynchronous copy out: no sync
        y.sum().item()  # launch + read
        b.masked_fill_(b > 4, 0)  # two launches, no sync
        _ = b.shape, len(b)  # metadata: nothing
    kinds = [(e.kind, e.op.rsplit(".", 1)[-1]) for e in clock.counters.syncs]
    assert kinds == [("h2d", "tensor"), ("shape", "__getitem__"), ("read", "item")]
    assert all("tests/sim/test_sync_budget.py:" in e.where for e in clock.counters.syncs)  # our line, not torch's


def test_a_graph_region_costs_one_replay_and_refuses_syncs() -> None:
    """``dispatch.graph_replay``: the ops inside cost the host one graph replay whatever their number and Python
    time; a sync inside is an error (a CUDA graph capture fails on one)."""
    from ddtree_serve.kernels.dispatch import graph_replay

    clock = DeviceClock(DeviceCostModel())
    dev = torch.device("cpu")
    with DeviceTracker(clock):
        a = torch.zeros(64, device=dev)
        clock.reset_counters()
        for _ in range(200):
            a = a + 1
        assert clock.reset_counters().launches == 200
        refunded = clock.refunded_s
        with graph_replay():
            for _ in range(200):
                a = a + 1
        counters = clock.reset_counters()
        assert counters.launches == 1 and not counters.syncs
        assert clock.refunded_s > refunded  # the region's host seconds were taken back (one replay charged)
        with pytest.raises(RuntimeError, match="inside a CUDA graph region"), graph_replay():
            a.sum().item()
