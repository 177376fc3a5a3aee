"""The adaptive budget ("auto") end to end: lossless greedy on the default model with the shipped drafter,
plain decode steps that keep the drafter's context so speculation resumes, exact sampled verification."""

from __future__ import annotations

import numpy as np

from ddtree_serve.server.engine import Engine, SamplingParams
from tests.speculative.scripted_drafts import install
from tests.speculative.test_spec_engine import (
    VOCAB,
    _assert_pool_full,
    _exact_law,
    _law_script,
    _prompts,
    assert_follows_law,
    tiny,
)

__all__ = ["tiny"]  # the module fixture, shared


def _auto(target: str, drafter: str | None, **kw) -> Engine:
    return Engine(
        target,
        dtype="float32",
        max_total_tokens=16384,
        speculative_algorithm="ddtree",
        draft_model_path=drafter,
        ddtree_budget="auto",
        **kw,
    )


def test_auto_is_the_default_budget(tiny):
    target, drafter = tiny
    e = Engine(
        target,
        dtype="float32",
        max_total_tokens=4096,
        speculative_algorithm="ddtree",
        draft_model_path=drafter,
        ddtree_max_budget=12,
    )
    spec = e.scheduler.spec
    assert spec.controller is not None and spec.budget == 12 and spec.controller.cost.probed
    assert spec.max_step_tokens == 13


def test_auto_greedy_lossless_shipped_drafter(default_model_path):
    from benchmarks.common import CHAT_PROMPTS, chat_ids

    base = Engine(default_model_path, dtype="float32", max_total_tokens=16384)
    ids = chat_ids(base.tokenizer, CHAT_PROMPTS)[:4]
    sp = SamplingParams(temperature=0, max_tokens=40)
    ref = base.generate(input_ids=ids, sampling_params=sp)
    base.shutdown()
    e = _auto(default_model_path, "default", ddtree_max_budget=8)  # small trees: CPU time
    # decisions forced (costs frozen, a verified token nearly free): the test is about exactness, so every
    # step must draft, whatever the machine's load; the shipped drafter's own trees must accept depth-2 paths
    _set_costs(e, 1e-7)
    log = install(e, None)
    got = e.generate(input_ids=ids, sampling_params=sp)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    log.assert_accepted()
    counts = e.scheduler.spec.controller.stats()["budget_counts"]
    assert sum(counts.values()) == sum(o.spec_verify_steps + o.spec_plain_steps for o in got)  # 0 = plain
    assert sum(n for b, n in counts.items() if b > 0) == sum(o.spec_verify_steps for o in got)
    assert all(0 <= b <= 64 for b in counts)
    _assert_pool_full(e)


def _set_costs(engine: Engine, verify_per_token: float) -> None:
    """Freeze the cost model at hand-set values: draft 1 ms, a step 10 ms + ``verify_per_token`` per verified
    token (a plain step of bs requests verifies bs tokens, a tree step bs + its nodes)."""
    sch = getattr(engine, "scheduler", engine)  # an Engine, a TPScheduler or a Scheduler
    ctl = getattr(sch, "scheduler", sch).spec.controller
    cost = ctl.cost
    cost.lr = 0.0
    cost.draft.y[:] = 1e-3
    cost.plain.y[:] = 1e-2 + verify_per_token * cost.plain.x
    for table, bs in zip(cost.verify, cost.verify_bs, strict=True):
        table.y[:] = 1e-2 + verify_per_token * (bs + table.x)
    ctl._spec_rates.clear()  # (plan_draft's cached predictions)


def test_plain_steps_keep_the_drafter_context(tiny):
    """With verification priced out, every step is a plain decode step (budget 0), still lossless; priced in
    again, speculation resumes on the context the plain steps wrote and accepts drafts."""
    target, drafter = tiny
    prompts = _prompts(6, seed=2)
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ref = Engine(target, dtype="float32", max_total_tokens=16384).generate(
        input_ids=prompts, sampling_params=sp
    )
    e = _auto(target, drafter)
    ctl = e.scheduler.spec.controller
    _set_costs(e, 1.0)  # a token costs 100x a step's base: never worth it
    got = e.generate(input_ids=prompts, sampling_params=sp)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert set(ctl.stats()["budget_counts"]) == {0} and sum(o.spec_accepted_tokens for o in got) == 0
    # priced out for the first 10 tokens of each request, then free: the plain steps wrote the drafter
    # context that the speculative steps then draft from (a drafter without it would accept nothing here)
    ctl.chosen.clear()
    _set_costs(e, 1.0)
    toks: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    for d in e.generate_stream(input_ids=prompts, sampling_params=sp):
        toks[d.index].extend(d.token_ids)
        if min(len(t) for t in toks.values()) >= 10:
            _set_costs(e, 0.0)
    assert [toks[i] for i in range(len(prompts))] == [o.token_ids for o in ref]
    counts = ctl.stats()["budget_counts"]
    assert counts.get(0, 0) >= 9 * len(prompts) and max(counts) > 0
    assert e.scheduler.total_spec_tokens > e.scheduler.total_verify_steps  # drafts were accepted
    _assert_pool_full(e)


def test_all_plain_fast_path_is_the_plain_decode_step(tiny):
    """Steps whose budgets are all 0 take the worker's plain fast path: the same forward and sampler as the
    scheduler's plain decode, so with the same seeds the tokens are the SAME draws (greedy and sampled,
    with logit bias, penalties, top-k / top-p / min-p) and the logprobs the same numbers; the tree path
    never runs, yet the drafter's context is written (the exploration steps draft from it)."""
    target, drafter = tiny
    prompts = _prompts(8, seed=5)
    params = [
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2, repetition_penalty=1.3),
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logit_bias={5: 3.0}, presence_penalty=0.5),
        *(SamplingParams(temperature=0.9, seed=s, max_tokens=20, ignore_eos=True, top_k=6, top_p=0.9,
                         min_p=0.02, frequency_penalty=0.3, logprobs=1 if s % 2 else None) for s in range(6)),
    ]
    ref = Engine(target, dtype="float32", max_total_tokens=16384).generate(
        input_ids=prompts, sampling_params=params
    )
    e = _auto(target, drafter)
    _set_costs(e, 1.0)  # every step plain (explorations draft, then choose budget 0)
    got = e.generate(input_ids=prompts, sampling_params=params)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert [o.logprobs for o in got] == [o.logprobs for o in ref]
    spec = e.scheduler.spec
    assert set(spec.controller.stats()["budget_counts"]) == {0}
    assert "plain" in spec.timer.totals and "verify_forward" not in spec.timer.totals  # no tree bookkeeping
    assert "draft" in spec.timer.totals  # the explorations drafted (from the context the plain steps wrote)
    _assert_pool_full(e)


def test_sampled_auto_matches_target_distribution(tiny):
    """As ``test_sampled_ddtree_matches_target_distribution`` (same N, tolerances and prompt), with the
    budget chosen per step: the joint of tokens 2-3 matches the exact target joint; some samples go through
    accepted depth-2 paths (scripted trees, ``_law_script``, merged with the drafter's)."""

    target, drafter = tiny
    prompt = [3, 7, 1, 9]
    exact, p2, p3 = _exact_law(target, prompt, 1.0, -1, 1.0)  # [V, V]
    n = 3000
    e = _auto(target, drafter, max_running_requests=512)
    _set_costs(e, 5e-7)  # a price at which batch 512 mixes plain steps and trees of many sizes (deterministic)
    log = install(e, _law_script(p2, p3))  # scripted depth-2 trees merged with the drafter's pops
    # max_tokens 4: t2 and t3 can both be tree nodes (a depth-2 path) of the first speculative step
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=4, ignore_eos=True) for s in range(n)]
    outs = e.generate(input_ids=[prompt] * n, sampling_params=params)
    assert sum(o.spec_accepted_tokens for o in outs) > n // 10, (
        "acceptance too low to exercise the sampled walk"
    )
    assert sum(a >= 2 for a in log.accepted) > 0, "no sample went through a depth-2 path"
    chosen = e.scheduler.spec.controller.stats()["budget_counts"]
    assert chosen.get(0, 0) > 0 and len([b for b in chosen if b > 0]) >= 2, chosen  # plain steps and trees
    plain = Engine(target, dtype="float32", max_total_tokens=16384, max_running_requests=512).generate(
        input_ids=[prompt] * n, sampling_params=params
    )
    tv = assert_follows_law(outs, plain, exact)
    assert VOCAB == exact.shape[0] and np.isfinite(tv)
    _assert_pool_full(e)


def test_accept_thresholds_reach_verification(tiny, caplog):
    """SGLang's lossy thresholds: single = 0 accepts the first child at every depth (every tree path of the
    chain is taken); the default 1.0 is exact and accepts far less on this random drafter."""
    target, drafter = tiny
    prompts = _prompts(8, seed=4)
    sp = [SamplingParams(temperature=1.0, seed=i, max_tokens=16, ignore_eos=True) for i in range(8)]
    kw = dict(
        dtype="float32",
        max_total_tokens=16384,
        speculative_algorithm="ddtree",
        draft_model_path=drafter,
        ddtree_budget=4,
    )
    exact = Engine(target, **kw).generate(input_ids=prompts, sampling_params=sp)
    with caplog.at_level("WARNING"):
        lossy = Engine(target, speculative_accept_threshold_single=0.0, **kw)
    assert "LOSSY" in caplog.text
    out = lossy.generate(input_ids=prompts, sampling_params=sp)
    acc_exact = sum(o.spec_accepted_tokens for o in exact) / sum(o.spec_verify_steps for o in exact)
    acc_lossy = sum(o.spec_accepted_tokens for o in out) / sum(o.spec_verify_steps for o in out)
    assert acc_lossy > acc_exact + 0.5
    assert all(3 < o.mean_budget <= 4 for o in exact)  # 4 nodes, fewer only near max_tokens


def test_auto_drafts_within_the_free_slots(tiny, caplog):
    """Auto reserves no KV for speculation: in a pool too small for every request's largest tree (8 x 33
    slots on top of up to 328 held), all requests run at once without retraction, the trees are capped at
    the slots that are free (or the step is plain), and the output stays plain decoding's."""
    target, drafter = tiny
    prompts = _prompts(8, seed=4)
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    ref = Engine(target, dtype="float32", max_total_tokens=16384).generate(input_ids=prompts, sampling_params=sp)
    e = Engine(target, dtype="float32", max_total_tokens=400, speculative_algorithm="ddtree",
               draft_model_path=drafter, ddtree_budget="auto", ddtree_max_budget=32, disable_radix_cache=True)
    spec = e.scheduler.spec
    assert spec.min_step_tokens == 1 and spec.max_step_tokens == 33
    _set_costs(e, 0.0)  # tree tokens are free: every step wants the largest trees
    room = []
    decode = spec.decode
    spec.decode = lambda reqs, eos: (room.append((len(reqs), e.scheduler.runner.slots.num_free)), decode(reqs, eos))[1]
    with caplog.at_level("INFO", logger="ddtree_serve.server.scheduling.scheduler"):
        got = e.generate(input_ids=prompts, sampling_params=sp)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert "retracted" not in caplog.text
    assert max(bs for bs, _ in room) == 8 and min(free for _, free in room) < 8 * 33  # a fixed 32 would not fit
    counts = spec.controller.stats()["budget_counts"]
    assert max(counts) > 0  # it drafted where the slots allowed
    _assert_pool_full(e)
