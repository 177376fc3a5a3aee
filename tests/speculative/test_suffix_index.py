"""Suffix drafts (ddtree_serve/speculative/suffix_index.py): the n-gram continuation index, the shared index's cap and
eviction, the per-request tries and their scores, and release."""

from __future__ import annotations

import math

import numpy as np

from ddtree_serve.speculative.suffix_index import (
    SEPARATOR,
    NgramIndex,
    SharedIndex,
    SuffixConfig,
    SuffixProposer,
)


def _recount(idx: NgramIndex) -> dict[tuple[int, ...], list[int]]:
    """The table ``idx`` must hold, rebuilt from its tokens by brute force."""
    want: dict[tuple[int, ...], list[int]] = {}
    toks = idx.tokens
    for j in range(len(toks)):
        for n in range(idx.min_match, min(idx.max_match, j) + 1):
            key = tuple(toks[j - n:j])
            if SEPARATOR not in key:
                want.setdefault(key, []).append(idx.base + j)
    return want


def test_ngram_index_positions_and_no_self_match():
    idx = NgramIndex(1, 3)
    idx.extend([1, 2, 3, 1, 2])
    assert idx.lookup((1, 2)) == [2]  # followed by position 2 (token 3); the trailing "1 2" has no follower yet
    assert idx.lookup((2,)) == [2]
    assert idx.lookup((3, 1, 2)) == []  # the current suffix is never its own match
    idx.extend([3])
    assert idx.lookup((1, 2)) == [2, 5]
    assert idx.table == _recount(idx)


def test_shared_index_is_capped_and_evicts_oldest_first():
    shared = SharedIndex(SuffixConfig(min_match=2, max_match=4, cache_tokens=40))
    rng = np.random.default_rng(0)
    outputs = [rng.integers(0, 50, size=int(rng.integers(5, 15))).tolist() for _ in range(20)]
    for out in outputs:
        shared.add(out)
        assert shared.num_tokens <= 40
        assert shared.index.table == _recount(shared.index)  # no entry points at an evicted token
    last = outputs[-1]
    assert shared.index.tokens[-len(last) - 1:] == last + [SEPARATOR]  # the newest output is kept whole
    first = outputs[0]
    assert all(p >= shared.index.base for v in shared.index.table.values() for p in v)
    assert shared.index.base > 0 and len(first) < shared.index.base  # the first outputs were evicted
    too_long = list(range(100))
    shared.add(too_long)  # longer than the cap: its tail is kept
    assert shared.num_tokens <= 40 and shared.index.tokens[-2] == 99


def test_proposer_trie_counts_and_scores():
    p = SuffixProposer(SuffixConfig(max_depth=3, min_match=2, max_match=4, cache_tokens=0))
    # "7 8" occurs twice before the end, followed by 1 2 3 and by 1 5 6; the text ends with "7 8"
    prompt = [7, 8, 1, 2, 3, 9, 7, 8, 1, 5, 6, 4, 7, 8]
    got = p.propose(["r"], [prompt], [[]], [10])
    n = int(got.counts[0])
    nodes = {(int(got.parents[0, i]), int(got.tokens[0, i])): i + 1 for i in range(n)}
    # the shared first token 1 (both occurrences) then two branches of depth 3
    assert n == 5 and got.tokens[0, 0] == 1 and got.parents[0, 0] == 0
    c = 2 / 3  # a match of 2 tokens: c = n / (n + 1)
    assert math.isclose(got.logws[0, 0], math.log(1.0 * c))
    two = nodes[(1, 2)]
    five = nodes[(1, 5)]
    assert math.isclose(got.logws[0, two - 1], math.log(0.5 * c**2))
    assert nodes[(two, 3)] and nodes[(five, 6)]
    assert all(got.parents[0, i] < i + 1 for i in range(n))  # parents first
    assert np.all(np.diff(got.logws[0, :n]) <= 1e-12)  # pop order: descending scores
    # the longest match wins: "9 7 8" matches once more specifically than "7 8"
    got = p.propose(["s"], [[9, 7, 8, 1, 2, 3, 7, 8, 1, 5, 6, 9, 7, 8]], [[]], [10])
    assert got.tokens[0, : int(got.counts[0])].tolist() == [1, 2, 3]
    # max_depths cut the trie
    assert p.propose(["t"], [prompt], [[]], [1]).counts[0] == 1


def test_outputs_extend_the_index_incrementally_and_release():
    p = SuffixProposer(SuffixConfig(max_depth=4, min_match=2, max_match=3, cache_tokens=100))
    prompt, out = [5, 6, 7, 8], [5, 6]
    got = p.propose(["a"], [prompt], [out], [5])
    assert got.tokens[0, : int(got.counts[0])].tolist() == [7, 8, 5, 6]
    out.append(7)
    got = p.propose(["a"], [prompt], [out], [5])
    assert got.tokens[0, : int(got.counts[0])].tolist() == [8, 5, 6, 7]
    assert len(p.own["a"].tokens) == 7
    p.release("a", None)  # an abort: nothing joins the shared index
    assert not p.own and p.shared.num_tokens == 0
    p.propose(["b"], [[1, 2]], [[3, 4, 1, 2, 9]], [4])
    p.release("b", [3, 4, 1, 2, 9])  # finished: its output is shared
    assert not p.own and p.shared.num_tokens == 6
    # another request whose text ends with "3 4" finds the continuation in the shared index
    got = p.propose(["c"], [[8, 3, 4]], [[]], [3])
    assert got.tokens[0, : int(got.counts[0])].tolist() == [1, 2, 9]
    p.release("c")
    assert not p.own


def test_long_prompt_is_indexed_over_several_steps(monkeypatch):
    import ddtree_serve.speculative.suffix_index as si

    monkeypatch.setattr(si, "INDEX_CHUNK", 8)
    p = SuffixProposer(SuffixConfig(max_depth=3, min_match=2, max_match=3, cache_tokens=0))
    prompt = [1, 2, 3, 4] + list(range(10, 30)) + [1, 2]  # "1 2" was followed by 3 4 at the start
    got = p.propose(["r"], [prompt], [[]], [3])
    assert len(p.own["r"].tokens) == 8 and got.tokens[0, : int(got.counts[0])].tolist() == [3, 4, 10]
    for _ in range(3):
        p.propose(["r"], [prompt], [[]], [3])
    assert p.own["r"].tokens == prompt and p.own["r"].table == _recount(p.own["r"])
    out = list(range(40, 60))
    p.propose(["r"], [prompt], [out], [3])  # the output is indexed in chunks too, past one chunk's length
    assert len(p.own["r"].tokens) == len(prompt) + 8
    for _ in range(2):
        p.propose(["r"], [prompt], [out], [3])
    assert p.own["r"].tokens == prompt + out


def test_request_record_scales_its_suffix_drafts():
    from ddtree_serve.speculative.budget import BudgetConfig, BudgetController
    from ddtree_serve.speculative.step_cost import StepCostModel

    p = SuffixProposer(SuffixConfig(max_depth=2, min_match=2, max_match=2, cache_tokens=0))
    texts = [[1, 2, 3, 1, 2], [4, 5, 6, 4, 5]]
    got = p.propose(["copy", "chat"], texts, [[], []], [2, 2])
    assert got.evidence.tolist() == [[0.0, 0.0], [0.0, 0.0]]
    p.observe(["copy", "chat"], np.array([1.5, 0.0]), np.array([1.5, 1.5]))  # one accepts, one rejects
    p.observe(["copy", "chat"], np.array([0.0, 0.0]), np.array([0.0, 0.0]))  # no suffix node: no change
    got = p.propose(["copy", "chat"], texts, [[], []], [2, 2])
    assert got.evidence.tolist() == [[1.5, 1.5], [0.0, 1.5]]
    ctl = BudgetController(BudgetConfig(prior=4.0), 4, StepCostModel(4, 8))
    ratios = ctl.suffix_ratios(np.array([False, False]), got)  # shared prior ratio 1 (no evidence yet)
    assert ratios.tolist() == [1.0, 4.0 / 5.5]
    p.observe(["chat"], np.array([0.0]), np.array([1.0]))
    assert p.evidence["chat"].tolist() == [0.0, 0.8 * 1.5 + 1.0]  # decayed, then added
    p.release("chat")
    assert "chat" not in p.evidence and "copy" in p.evidence


def test_a_long_copy_drafts_as_deep_as_its_match():
    """A repeated answer held by the shared index: the match is measured past max_match (the run), followed
    step by step, scored with its true length, and drafts up to SPEC_FACTOR x that length deep."""
    import ddtree_serve.speculative.suffix_index as si

    cfg = SuffixConfig(max_depth=64, min_match=2, max_match=4, cache_tokens=1000)
    p = SuffixProposer(cfg)
    answer = [100 + (i * 7919) % 997 for i in range(200)]  # no repeated 2-gram
    p.shared.add(answer)
    out = answer[:10]
    got = p.propose(["r"], [[1, 2, 3]], [out], [50])
    n = int(got.counts[0])
    assert got.tokens[0, :n].tolist() == answer[10:30]  # 10 tokens matched: 2 x 10 levels
    assert got.match_lens[0, 0] == 10 and got.parents[0, :n].tolist() == list(range(n))
    assert math.isclose(got.logws[0, 19], 20 * math.log(10 / 11))
    out += answer[10:17]  # a step accepted 6 drafts + the bonus: the run continues
    got = p.propose(["r"], [[1, 2, 3]], [out], [50])
    assert got.match_lens[0, 0] == 17 and got.tokens[0, : int(got.counts[0])].tolist() == answer[17:51]
    assert p.runs["r"].length == 17
    out += answer[17:120]  # far past MATCH_KEY_CAP: one calibration key; the request's max depth bounds it
    got = p.propose(["r"], [[1, 2, 3]], [out], [50])
    assert got.match_lens[0, 0] == si.MATCH_KEY_CAP and int(got.counts[0]) == 50
    assert got.tokens[0, :50].tolist() == answer[120:170]
    out.append(5)  # the text leaves the copy: no match, the run ends
    assert p.propose(["r"], [[1, 2, 3]], [out], [50]).counts[0] == 0 and "r" not in p.runs
    p.release("r")


def test_a_full_length_match_that_is_no_longer_keeps_every_occurrence():
    """An n-gram match of max_match tokens whose occurrences agree no further: scored as before (all
    occurrences' continuations, c = n / (n + 1) with n = max_match)."""
    p = SuffixProposer(SuffixConfig(max_depth=8, min_match=2, max_match=3, cache_tokens=0))
    prompt = [9, 1, 2, 3, 4, 5, 8, 1, 2, 3, 6, 7, 0, 1, 2, 3]  # "1 2 3" twice, preceded by 9 and by 8
    got = p.propose(["r"], [prompt], [[]], [8])
    n = int(got.counts[0])
    assert got.match_lens[0, 0] == 3 and sorted(got.tokens[0, :2].tolist()) == [4, 6]
    assert math.isclose(got.logws[0, 0], math.log(0.5 * 3 / 4))
    assert n == 12  # two branches of SPEC_FACTOR x 3 = 6 levels


def test_a_text_that_repeats_itself_drafts_past_its_own_end():
    """A periodic text's newest occurrence of its suffix sits just before the end: its continuation runs into
    the text itself and goes on with the draft's own tokens (what the copy would emit), not cut at the end."""
    p = SuffixProposer(SuffixConfig(max_depth=64, min_match=2, max_match=4, cache_tokens=0))
    out = [7, 8] * 6
    got = p.propose(["r"], [[1, 2]], [out], [9])
    assert got.tokens[0, : int(got.counts[0])].tolist() == [7, 8, 7, 8, 7, 8, 7, 8, 7]
    assert got.match_lens[0, 0] == 10 and got.parents[0, :9].tolist() == list(range(9))  # 12 tokens, period 2
    p.release("r")
