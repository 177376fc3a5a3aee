"""The reasoning gate of a grammar state (ddtree_serve/model_executor/grammar/state.py) against brute force, with the
default model's real tokenizer: a grammar dormant until the end-of-reasoning token, then the grammar from
the next token (or from a handoff token itself). Tree masks with the end token at different depths equal a
per-path reference built on fresh matchers from the gate's definition; pruning keeps exactly the allowed
nodes; drafter masking, tree walks and plain decoding leave and move the state consistently."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from ddtree_serve.model_executor.grammar import (
    GrammarState,
    ReasoningGate,
    mask_draft_logits,
    mask_logits,
    prune_popped,
    tree_bitmask,
)
from ddtree_serve.model_executor.grammar.state import stop_only_row
from ddtree_serve.model_executor.sampling_params import SamplingParams
from ddtree_serve.speculative.ddtree import PoppedNodes
from tests.kernels.tree_helpers import random_tree
from tests.model_executor.test_grammar import EOS, REGEX, VOCAB, brute_row, make_tree, path_of

W = (VOCAB + 31) // 32


@pytest.fixture(scope="module")
def ids(tok) -> dict[str, int]:
    """Tokens of the test trees: the grammar's letters, ``z`` (the end of the reasoning in these tests),
    ``b`` and ``x`` (handoff tokens: the grammar may start with ``b``, not with ``x``), ``q`` (a reasoning
    token) and EOS."""
    out = {t: tok.convert_tokens_to_ids(t) for t in ("a", "b", "c", "ab", "x", "z", "q")}
    out["EOS"] = EOS
    return out


GATES = {"end": lambda i: ReasoningGate((i["z"],)), "end+handoff": lambda i: ReasoningGate((i["z"],), (i["b"], i["x"]))}


def reference_row(backend, gate: ReasoningGate, path: list[int]) -> torch.Tensor | None:
    """The mask after ``path`` from the gate's definition, on fresh matchers (None: the path is rejected)."""
    for k, t in enumerate(path):
        if t == EOS:  # the reply ended before its answer: stop tokens only
            if any(r != EOS for r in path[k + 1:]):
                return None
            row = torch.zeros(1, W, dtype=torch.int32)
            stop_only_row(row, 0, (EOS,))
            return row[0]
        if t in gate.end_ids:
            return brute_row(backend, "regex", REGEX, path[k + 1:])
        if t in gate.handoff_ids:
            return brute_row(backend, "regex", REGEX, path[k:])
    row = torch.full((W,), -1, dtype=torch.int32)  # dormant: everything but the handoffs the grammar refuses
    for h in gate.handoff_ids:
        if brute_row(backend, "regex", REGEX, [h]) is None:
            bits = ((row[h >> 5].item() & 0xFFFFFFFF) & ~(1 << (h & 31)))
            row[h >> 5] = bits - (1 << 32) if bits >= 1 << 31 else bits
    return row


def _state(backend, gate: ReasoningGate, prefix: list[int] = ()) -> GrammarState:
    s = GrammarState(backend.compile("regex", REGEX), (EOS,), VOCAB, gate)
    s.accept(list(prefix))
    return s


def _row(s: GrammarState) -> torch.Tensor:
    row = torch.full((1, W), -1, dtype=torch.int32)
    s.fill(row, 0)
    return row[0]


@pytest.mark.parametrize("gate_name", list(GATES))
def test_tree_masks_with_the_end_at_every_depth(backend, ids, gate_name):
    """Random trees over the alphabet: every reachable node's row equals the reference after its own path;
    the end token lands at depths 1 to 3 with grammar-masked nodes below it; the walk leaves the state
    where it was (dormant, or already awake after a committed end token)."""
    gate = GATES[gate_name](ids)
    alphabet = [ids[t] for t in ("a", "b", "c", "ab", "x", "z", "q", "EOS")]
    crossed: set[int] = set()  # depths of end tokens with a reachable awake node below them
    fixed = [(0, "z"), (1, "a"), (0, "q"), (3, "z"), (4, "c"), (3, "a"), (6, "z"), (7, "ab"), (8, "c"), (9, "EOS"),
             (6, "b"), (11, "z"), (3, "x"), (13, "z"), (14, "a")]  # the end token at depths 1, 2 and 3
    for seed in range(11):
        if seed < 10:
            parents, local = random_tree(random.Random(seed), 16, len(alphabet))
            tokens = [alphabet[t] for t in local]
        else:
            parents, tokens = [-1] + [p for p, _ in fixed], [ids["q"]] + [ids[t] for _, t in fixed]
        prefix = [[], [ids["q"]], [ids["q"], ids["z"], ids["a"]]][seed % 3]  # committed output
        s = _state(backend, gate, prefix)
        before = _row(s)
        tree = make_tree(parents, tokens)
        bm = tree_bitmask([s], tree.candidates, tree.parents, tree.retrive_next_token, tree.retrive_next_sibling,
                          VOCAB)[0]  # [D, W]
        assert _row(s).equal(before) and not s._trail and s.accepted == len(prefix), "the walk moved the state"
        for i in range(len(parents)):
            path = path_of(parents, tokens, i)
            want = reference_row(backend, gate, prefix + path)
            if want is None or EOS in path[:-1]:  # refused on its path, or below a stop token
                assert bm[i].eq(-1).all(), f"node {i} is unreachable: no mask"
            else:  # an EOS node's reference is the stop-only row
                assert bm[i].equal(want), f"seed {seed} node {i} path {path}"
                if ids["z"] in path[:-1] and not prefix.count(ids["z"]):
                    crossed.add(path.index(ids["z"]) + 1)
    assert {1, 2, 3} <= crossed, crossed


@pytest.mark.parametrize("gate_name", list(GATES))
def test_plain_decoding_follows_the_gate(backend, ids, gate_name):
    """Committed tokens one at a time: the plain mask after each equals the reference (reasoning free, then
    the grammar), and the mask path agrees with ``mask_logits``."""
    gate = GATES[gate_name](ids)
    seq = [ids[t] for t in ("q", "a", "x" if gate_name == "end" else "q", "c", "z", "a", "b", "c", "EOS")]
    s = _state(backend, gate)
    for k in range(len(seq) + 1):
        want = reference_row(backend, gate, seq[:k])
        assert _row(s).equal(want), f"after {k} tokens"
        logits = torch.zeros(1, VOCAB)
        out = mask_logits([s], logits)
        allowed = torch.isfinite(out[0])
        assert int(allowed.sum()) == int(((want[:, None] >> torch.arange(32)) & 1).view(-1)[:VOCAB].sum())
        if k < len(seq):
            s.accept([seq[k]])
    assert s.terminated and not s.failed
    eos_early = _state(backend, gate, [ids["q"], EOS])  # EOS before the end of the reasoning
    assert eos_early.terminated and torch.isfinite(mask_logits([eos_early], torch.zeros(1, VOCAB))[0]).nonzero(
    ).view(-1).tolist() == [EOS]


def test_handoff_token_starts_the_grammar(backend, ids):
    """A handoff token is the grammar's first token: allowed while dormant only where the grammar may
    start with it, and it wakes the grammar with itself accepted; a refused one is never committed."""
    gate = GATES["end+handoff"](ids)
    s = _state(backend, gate, [ids["q"]])
    assert s.dormant and s.push(ids["b"]) and not s.dormant
    assert _row(s).equal(brute_row(backend, "regex", REGEX, [ids["b"]]))
    s.pop(1)
    assert s.dormant and not s.push(ids["x"]) and s.dormant and not s._trail
    s.accept([ids["b"], ids["a"]])
    assert _row(s).equal(brute_row(backend, "regex", REGEX, [ids["b"], ids["a"]]))


@pytest.mark.parametrize("seed", range(3))
def test_prune_keeps_exactly_the_allowed_nodes(backend, ids, seed):
    gate = GATES["end+handoff"](ids)
    alphabet = [ids[t] for t in ("a", "b", "c", "x", "z", "q", "EOS")]
    rng = random.Random(20 + seed)
    parents, local = random_tree(rng, 16, len(alphabet))
    tokens = [alphabet[t] for t in local]
    n = len(parents) - 1
    popped = PoppedNodes(np.array([tokens[1:]]), np.array([parents[1:]]), np.ones((1, n), dtype=np.int64),
                         np.log(np.linspace(0.9, 0.1, n))[None], np.array([n]))
    s = _state(backend, gate, [ids["q"]])
    budget = 8
    out = prune_popped(popped, [s], torch.tensor([budget]))
    allowed = [i for i in range(1, n + 1)
               if reference_row(backend, gate, [ids["q"]] + path_of(parents, tokens, i)) is not None
               and EOS not in path_of(parents, tokens, parents[i])]
    m = int(out.counts[0])
    assert m == min(budget, len(allowed))
    kept = []
    for j in range(m):
        path, k = [], j + 1
        while k > 0:
            path.append(int(out.tokens[0, k - 1]))
            k = int(out.parents[0, k - 1])
        kept.append(path[::-1])
    assert kept == [path_of(parents, tokens, i) for i in allowed[:m]]
    assert s.dormant and not s._trail


def test_draft_masks_cross_the_end(backend, ids):
    """Drafter masking through the gate: the top-1 path ``q z`` leaves depth 3 under the grammar's start mask;
    the state is back where it was."""
    gate = GATES["end"](ids)
    s = _state(backend, gate)
    logits = torch.zeros(1, 4, VOCAB)  # [bs, L, V]
    logits[0, 0, ids["q"]] = 5.0
    logits[0, 1, ids["z"]] = 5.0
    logits[0, 2, ids["q"]] = 5.0  # refused by the grammar at depth 3
    logits[0, 2, ids["a"]] = 1.0
    mask_draft_logits([s], logits)
    assert torch.isfinite(logits[0, :2]).all(), "dormant depths stay unmasked"
    start = brute_row(backend, "regex", REGEX, [])
    bits = ((start[:, None] >> torch.arange(32)) & 1).view(-1)[:VOCAB].bool()
    assert torch.isneginf(logits[0, 2][~bits]).all() and torch.isfinite(logits[0, 2][bits]).all()
    assert int(logits[0, 2].argmax()) == ids["a"]
    assert s.dormant and not s._trail and s.accepted == 0


def test_gate_params_need_a_grammar_and_valid_ids():
    with pytest.raises(ValueError, match="^reasoning_end_ids needs a grammar"):
        SamplingParams(reasoning_end_ids=(5,)).validate()
    with pytest.raises(ValueError, match="^reasoning_handoff_ids must be token ids"):
        SamplingParams(regex="a", reasoning_handoff_ids=(99,)).validate(vocab_size=50)
    SamplingParams(regex="a", reasoning_end_ids=(5,), reasoning_handoff_ids=(6,)).validate(vocab_size=50)
