"""The radix prefix cache in the scheduler: outputs identical with and without it (plain, DFlash, DDTree;
greedy and seeded sampled), drafts identical from a cached prefix, prompt logprobs unaffected, and the
slot accounting after eviction, aborts and retractions (free + tree-held + request-held == total)."""

from __future__ import annotations

import pytest
import torch

from ddtree_serve.server.engine import Engine, SamplingParams
from ddtree_serve.server.io_struct import GenerateReq
from tests.speculative.drafter_utils import write_random_drafter

VOCAB = 24


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests.conftest import write_tiny_llama_family

    root = tmp_path_factory.mktemp("radix")
    target = write_tiny_llama_family(root / "target", "qwen3", vocab=VOCAB, seed=3, num_hidden_layers=4)
    drafter = write_random_drafter(target, root / "drafter", num_layers=1, block_size=5, seed=1, std=0.3)
    return target, drafter


def _engine(target: str, drafter: str | None = None, alg: str = "none", **kw) -> Engine:
    kw.setdefault("max_total_tokens", 4096)
    spec = {} if alg == "none" else {"draft_model_path": drafter, "ddtree_budget": 6}  # none: no speculative settings
    return Engine(target, dtype="float32", speculative_algorithm=alg, **spec, **kw)


def _conversation(e: Engine, params: list[SamplingParams], turns: int = 3) -> list[tuple]:
    """Each turn sends the previous history (prompt + output) plus a new user part; returns per turn
    (tokens, cached prompt tokens, verify steps, accepted tokens) of every request."""
    g = torch.Generator().manual_seed(5)
    hist = [torch.randint(0, VOCAB - 2, (9 + 3 * i,), generator=g).tolist() for i in range(len(params))]
    log = []
    for _ in range(turns):
        outs = e.generate(input_ids=hist, sampling_params=params)
        log.append([(o.token_ids, o.cached_tokens, o.spec_verify_steps, o.spec_accepted_tokens) for o in outs])
        hist = [h + o.token_ids + torch.randint(0, VOCAB - 2, (4,), generator=g).tolist()
                for h, o in zip(hist, outs, strict=True)]
    return log


def _accounting(e: Engine) -> None:
    """Every slot is free, held by the tree, or held privately by a request row; the tree is consistent."""
    sch = e.scheduler
    kv, tree = sch.runner.slots, sch.kv.tree
    private = sum(q.num_cached - q.tree_len for q in list(sch.running) + list(sch.waiting) if q.req_pool_idx is not None)
    held = tree.total_size if tree is not None else 0
    if tree is not None:
        tree.check()
    assert kv.num_free + held + private == kv.num_slots


# the sampled request's draws are position-keyed, so its outcome is fixed: temperature 0.3 and seed 1 make the
# random DFlash chain's drafts accepted (the assertion below needs accepted paths in every algorithm)
PARAMS = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
          SamplingParams(temperature=0.3, top_p=0.95, max_tokens=10, seed=1, ignore_eos=True)]


@pytest.mark.parametrize("alg", ["none", "dflash", "ddtree"])
def test_outputs_and_drafts_identical_with_and_without_cache(tiny, alg):
    target, drafter = tiny
    cached = _engine(target, drafter if alg != "none" else None, alg)
    plain = _engine(target, drafter if alg != "none" else None, alg, disable_radix_cache=True)
    got, ref = _conversation(cached, PARAMS), _conversation(plain, PARAMS)
    # tokens, verify steps and accepted drafts all equal: a cached prefix keeps its drafter features
    assert [[(t, s, a) for t, _, s, a in turn] for turn in got] == [[(t, s, a) for t, _, s, a in turn] for turn in ref]
    assert all(c == 0 for turn in ref for _, c, _, _ in turn)
    assert all(c == 0 for _, c, _, _ in got[0])
    assert all(c > 0 for turn in got[1:] for _, c, _, _ in turn), "later turns must reuse the history"
    if alg != "none":
        assert sum(a for turn in got for *_, a in turn) > 0, "the test must exercise accepted paths"
    st = cached.stats()
    assert st.cache_hit_tokens > 0 and st.kv_used_tokens == 0
    _accounting(cached)
    cached.shutdown()
    plain.shutdown()


def test_repeated_prompt_hits_all_but_the_last_token(tiny):
    target, _ = tiny
    e = _engine(target)
    ids = list(range(2, 20))
    p = SamplingParams(temperature=0, max_tokens=4)
    first = e.generate(input_ids=[ids], sampling_params=p)[0]
    again = e.generate(input_ids=[ids], sampling_params=p)[0]
    assert (first.cached_tokens, again.cached_tokens) == (0, len(ids) - 1)
    assert again.token_ids == first.token_ids
    _accounting(e)
    e.shutdown()


def test_prompt_logprobs_requests_score_every_token(tiny):
    target, _ = tiny
    e = _engine(target)
    ids = list(range(3, 15))
    p = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1)
    first = e.generate(input_ids=[ids], sampling_params=p)[0]
    again = e.generate(input_ids=[ids], sampling_params=p)[0]
    assert again.cached_tokens == 0  # not matched: every prompt token goes through a forward
    assert len(again.prompt_logprobs) == len(ids)
    for (t1, lp1, _), (t2, lp2, _) in zip(first.prompt_logprobs, again.prompt_logprobs, strict=True):
        assert t1 == t2 and (lp1 is None) == (lp2 is None) and (lp1 is None or abs(lp1 - lp2) < 1e-4)
    _accounting(e)
    e.shutdown()


def test_eviction_aborts_and_retractions_leak_nothing(tiny):
    """A KV pool a few requests wide: shared prefixes fill the tree, eviction makes room for new prompts,
    decode runs short so requests are retracted, and requests are aborted mid-prefill and mid-decode. After
    every step the slots add up and the tree is consistent; at the end everything is free or evictable."""
    target, drafter = tiny
    for alg in ("none", "ddtree"):
        e = _engine(target, drafter if alg != "none" else None, alg, max_total_tokens=128, max_running_requests=6,
                    chunked_prefill_size=16)
        sch = e.scheduler
        retracted, retract = [], sch._retract_one

        def counted(batch, retract=retract, retracted=retracted):  # counts the scheduler's own retractions
            retracted.append(batch.reqs[-1].rid)
            retract(batch)

        sch._retract_one = counted
        g = torch.Generator().manual_seed(1)
        shared = torch.randint(0, VOCAB - 2, (20,), generator=g).tolist()
        rids = []
        for i in range(10):
            tail = torch.randint(0, VOCAB - 2, (3 + i % 4,), generator=g).tolist()
            rid = f"{alg}-{i}"
            sch.add_request(GenerateReq(rid, shared[: 8 + 2 * i] + tail,
                                        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)))
            rids.append(rid)
        finished, steps = set(), 0
        while sch.has_work():
            for out in sch.step():
                if out.finished:
                    finished.add(out.rid)
            steps += 1
            if steps == 3:
                sch.abort_request(rids[0])  # mid-prefill or just admitted
            if steps == 12:
                sch.abort_request(sch.running[-1].rid if sch.running else rids[1])  # mid-decode
            _accounting(e)
        assert finished == set(rids)
        assert retracted, "the pool must be small enough to retract"
        assert sch.kv.tree.evicted_tokens > 0, "the pool must be small enough to evict"
        assert sch.kv.tree.evictable_size == sch.kv.tree.total_size  # no lock left behind
        assert e.stats().kv_used_tokens == 0
        sch.kv.tree.reset()
        assert sch.runner.slots.num_free == sch.runner.slots.num_slots
        e.shutdown()


def test_eviction_policy_and_disable_flag(tiny, capsys):
    import argparse

    from ddtree_serve.server.cli.args import add_server_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_server_arguments(parser)
    cache = config_from_args(parser.parse_args(["--disable-radix-cache", "--radix-eviction-policy", "lru"])).cache
    assert cache.disable_radix_cache and cache.radix_eviction_policy == "lru"
    with pytest.raises(SystemExit):
        parser.parse_args(["--radix-eviction-policy", "fifo"])
    assert "radix_eviction_policy must be 'lru'; got 'fifo'" in capsys.readouterr().err
    target, _ = tiny
    with pytest.raises(ValueError, match="radix_eviction_policy"):
        Engine(target, radix_eviction_policy="fifo")
    e = _engine(target, disable_radix_cache=True)
    assert e.scheduler.kv.tree is None
    e.shutdown()
