"""Grammar masks (ddtree_serve/model_executor/grammar/) against brute force, with the default model's real tokenizer:
per-node tree masks equal the mask after each node's own path, pruning keeps exactly the nodes the grammar
allows, drafter masking leaves the matcher where it was, and SamplingParams rejects what cannot compile."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from ddtree_serve.model_executor.grammar import (
    GrammarState,
    mask_draft_logits,
    mask_logits,
    prune_popped,
    tree_bitmask,
)
from ddtree_serve.model_executor.grammar.masks import DRAFT_MASK_TOPK
from ddtree_serve.model_executor.grammar.state import stop_only_row
from ddtree_serve.model_executor.sampling_params import SamplingParams
from ddtree_serve.speculative.ddtree import PoppedNodes, assemble_tree
from tests.kernels.tree_helpers import random_tree
from tests.model_executor.conftest import GRAMMAR_EOS as EOS
from tests.model_executor.conftest import GRAMMAR_VOCAB as VOCAB

REGEX = r"[ab]{0,3}c"  # then EOS


@pytest.fixture(scope="module")
def alphabet(tok):
    """Tokens of the test trees: single letters, a two-letter token and EOS."""
    return [tok.convert_tokens_to_ids(t) for t in ("a", "b", "c", "ab", "x")] + [EOS]


def brute_row(backend, kind, text, path: list[int]) -> torch.Tensor | None:
    """The mask after ``path`` from a fresh matcher (None if the grammar rejects the path); [W] int32."""
    s = GrammarState(backend.compile(kind, text), (EOS,), VOCAB)
    row = torch.full((1, (VOCAB + 31) // 32), -1, dtype=torch.int32)
    for t in path:
        if s.terminated or not s.matcher.accept_token(t):
            return None
    s.fill(row, 0)
    return row[0]


def make_tree(parents: list[int], tokens: list[int], copies: int = 1):
    """A DraftTree (ddtree_serve/speculative/ddtree.py layout) of one (parents, tokens) tree, ``copies`` times."""
    n = len(parents) - 1
    popped = PoppedNodes(np.tile(np.array(tokens[1:]), (copies, 1)), np.tile(np.array(parents[1:]), (copies, 1)),
                         np.zeros((copies, n), dtype=np.int64), np.zeros((copies, n)), np.full(copies, n))
    depth = [0] * len(parents)
    for i in range(1, len(parents)):
        depth[i] = depth[parents[i]] + 1
    popped.depths[:] = np.array(depth[1:])
    return assemble_tree(popped, torch.full((copies,), n), torch.full((copies,), tokens[0]),
                         torch.zeros(copies, dtype=torch.int64), "cpu")


def path_of(parents: list[int], tokens: list[int], i: int) -> list[int]:
    out = []
    while i > 0:
        out.append(tokens[i])
        i = parents[i]
    return out[::-1]


@pytest.mark.parametrize("seed", range(6))
def test_tree_masks_equal_per_path_masks(backend, alphabet, seed):
    rng = random.Random(seed)
    parents, local = random_tree(rng, 12, len(alphabet))
    tokens = [alphabet[t] for t in local]
    tree = make_tree(parents, tokens)
    prefix = [alphabet[0]] if seed % 2 else []  # a matcher that has already accepted output
    s = GrammarState(backend.compile("regex", REGEX), (EOS,), VOCAB)
    s.accept(prefix)
    bm = tree_bitmask([s], tree.candidates, tree.parents, tree.retrive_next_token, tree.retrive_next_sibling,
                      VOCAB)[0]  # [D, W]
    assert s.accepted == len(prefix) and brute_row(backend, "regex", REGEX, prefix).equal(
        _row(s)), "the walk must leave the matcher where it was"
    stop_only = torch.zeros(1, bm.shape[1], dtype=torch.int32)
    stop_only_row(stop_only, 0, (EOS,))
    reachable = 0
    for i in range(len(parents)):
        path = prefix + path_of(parents, tokens, i)
        want = brute_row(backend, "regex", REGEX, path)
        anc = path_of(parents, tokens, parents[i]) if i else []
        below_stop = EOS in anc
        if want is None or below_stop:
            assert bm[i].eq(-1).all(), f"node {i} is unreachable: no mask"
        elif tokens[i] == EOS and i > 0:
            assert bm[i].equal(stop_only[0])
        else:
            reachable += 1
            assert bm[i].equal(want), f"node {i} path {path}"
    assert reachable >= 2


def _row(s: GrammarState) -> torch.Tensor:
    row = torch.full((1, (VOCAB + 31) // 32), -1, dtype=torch.int32)
    s.fill(row, 0)
    return row[0]


@pytest.mark.parametrize("seed", range(4))
def test_prune_keeps_exactly_the_allowed_nodes(backend, alphabet, seed):
    rng = random.Random(10 + seed)
    parents, local = random_tree(rng, 14, len(alphabet))
    tokens = [alphabet[t] for t in local]
    n = len(parents) - 1
    popped = PoppedNodes(np.array([tokens[1:]]), np.array([parents[1:]]), np.ones((1, n), dtype=np.int64),
                         np.log(np.linspace(0.9, 0.1, n))[None], np.array([n]))
    s = GrammarState(backend.compile("regex", REGEX), (EOS,), VOCAB)
    budget = 5
    out = prune_popped(popped, [s], torch.tensor([budget]))
    allowed = [i for i in range(1, n + 1) if brute_row(backend, "regex", REGEX, path_of(parents, tokens, i)) is not None
               and EOS not in path_of(parents, tokens, parents[i])]
    m = int(out.counts[0])
    assert m == min(budget, len(allowed))
    kept_paths = []
    for j in range(m):  # rebuilt paths through the renumbered parents
        path, k = [], j + 1
        while k > 0:
            path.append(int(out.tokens[0, k - 1]))
            k = int(out.parents[0, k - 1])
        kept_paths.append(path[::-1])
    assert kept_paths == [path_of(parents, tokens, i) for i in allowed[:m]]
    assert (out.parents[0, m:] == -1).all() and np.isneginf(out.logws[0, m:]).all()
    assert s.accepted == 0 and s.matcher.accept_token(alphabet[2])  # the matcher is back at the start


@pytest.mark.parametrize("boost", [True, False])
def test_draft_masks_follow_the_top1_path(backend, alphabet, boost):
    """Depth 1 exact; deeper depths masked after the masked top-1 path, each picked among the depth's
    ``DRAFT_MASK_TOPK`` raw candidates (``boost``: the grammar's letters are among them at every depth); where
    none is allowed the chain stops and deeper depths stay as they were."""
    s = GrammarState(backend.compile("regex", REGEX), (EOS,), VOCAB)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 4, VOCAB, generator=g)  # [bs, L, V]; row 1 is a free request
    if boost:  # the letters rank 2nd-5th at every depth, "c" last of them, behind a disallowed "x"
        for rank, t in enumerate(alphabet[4:5] + alphabet[:4]):
            logits[0, :, t] = 10.0 - rank + (-4.0 if t == alphabet[2] else 0.0)
    raw, free = logits[0].clone(), logits[1].clone()
    mask_draft_logits([s, None], logits)
    assert logits[1].equal(free)
    path: list[int] = []
    for d in range(4):
        want = brute_row(backend, "regex", REGEX, path)
        bits = ((want[:, None] >> torch.arange(32)) & 1).view(-1)[:VOCAB].bool()
        assert torch.isneginf(logits[0, d][~bits]).all() and torch.isfinite(logits[0, d][bits]).all()
        top = torch.topk(raw[d], DRAFT_MASK_TOPK).indices.tolist()  # the raw candidates, best first
        allowed = [t for t in top if bits[t]]
        if not allowed or allowed[0] == EOS:  # the chain stops: deeper depths untouched
            assert logits[0, d + 1:].equal(raw[d + 1:])
            break
        path.append(allowed[0])
    assert len(path) >= (2 if boost else 0)
    assert s.accepted == 0 and _row(s).equal(brute_row(backend, "regex", REGEX, []))


def test_plain_masks_leave_free_rows_alone(backend):
    s = GrammarState(backend.compile("json_schema", '{"type": "object"}'), (EOS,), VOCAB)
    logits = torch.randn(3, VOCAB)
    out = mask_logits([None, s, None], logits)
    assert out[0].equal(logits[0]) and out[2].equal(logits[2])
    fin = torch.isfinite(out[1])
    assert 0 < int(fin.sum()) < 500 and out[1][fin].equal(logits[1][fin])  # tokens that start an object
    assert mask_logits([None, None, None], logits) is logits


def test_terminated_matcher_allows_only_stop(backend, tok):
    s = GrammarState(backend.compile("regex", "ab"), (EOS,), VOCAB)
    s.accept(tok.encode("ab") + [EOS])
    assert s.terminated
    out = mask_logits([s], torch.zeros(1, VOCAB))
    assert torch.isfinite(out[0]).nonzero().view(-1).tolist() == [EOS]


@pytest.mark.parametrize(("field", "text"), [
    ("json_schema", '{"type": "nonsense"}'), ("json_schema", "{not json"),
    ("json_schema", '{"properties": {"a": {"$ref": "#/nowhere"}}}'), ("regex", "[a-"), ("regex", "(ab"),
    ("ebnf", "root ::= undefined_rule"), ("ebnf", 'root := "a"'), ("ebnf", "   "),
])
def test_uncompilable_grammar_is_value_error(field, text):
    with pytest.raises(ValueError, match=f"^{field} "):
        SamplingParams(**{field: text}).validate()


def test_grammar_fields_are_exclusive_and_valid_ones_pass():
    with pytest.raises(ValueError, match="^regex cannot be combined with json_schema"):
        SamplingParams(json_schema='{"type": "object"}', regex="a").validate()
    for kw in ({"json_schema": '{"type": "object"}'}, {"regex": "[0-9]+"}, {"ebnf": 'root ::= "yes" | "no"'}):
        SamplingParams(**kw).validate()
        assert SamplingParams(**kw).grammar == next(iter(kw.items()))
    assert SamplingParams().grammar is None


def test_grammar_queue_reports_compile_errors_and_aborts(backend):
    """The scheduler's queue: a constraint that fails on the worker thread comes back as its error message
    (the scheduler finishes the request with it: an HTTP 400), a good one with a fresh matcher."""
    from types import SimpleNamespace

    from ddtree_serve.model_executor.grammar.queue import GrammarQueue

    q = GrammarQueue(lambda: backend)
    bad = SimpleNamespace(rid="bad", params=SamplingParams(regex="(ab"), grammar=None, grammar_future=None)
    good = SimpleNamespace(rid="good", params=SamplingParams(regex="[0-9]+"), grammar=None, grammar_future=None)
    gone = SimpleNamespace(rid="gone", params=SamplingParams(regex="x"), grammar=None, grammar_future=None)
    for r in (bad, good, gone):
        q.submit(r)
    assert [r.rid for r in q.remove("gone")] == ["gone"]
    done = []
    while len(q):
        done += q.poll(idle=True)
    assert [(r.rid, err is None) for r, err in done] == [("bad", False), ("good", True)]
    assert done[0][1].startswith("regex cannot be compiled")
    assert isinstance(good.grammar, GrammarState) and good.grammar.accepted == 0 and bad.grammar is None
