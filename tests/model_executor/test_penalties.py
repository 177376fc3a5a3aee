"""Logit bias and repetition / frequency / presence penalties (ddtree_serve/model_executor/penalties.py): the dense
batch form against a scalar transcription of the definitions, and the tree form row by row against the
dense form with the path's tokens added to the request's tokens (DDTree verification)."""

from __future__ import annotations

import pytest
import torch

from ddtree_serve.model_executor.penalties import (
    BatchPenalties,
    TokenCounts,
    apply_penalties,
    apply_tree_penalties,
)
from ddtree_serve.model_executor.sampling_params import SamplingParams
from ddtree_serve.speculative.ddtree import build_ddtree


def _scalar_reference(
    row: list[float], prompt: list[int], generated: list[int], p: SamplingParams
) -> list[float]:
    """The definitions, one token at a time: bias, then repetition (prompt + generated), then frequency
    and presence (generated only)."""
    out = list(row)
    for t, b in (p.logit_bias or {}).items():
        out[t] += b
    for t in range(len(out)):
        if t in prompt or t in generated:
            out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
        c = generated.count(t)
        out[t] -= c * p.frequency_penalty + (1.0 if c > 0 else 0.0) * p.presence_penalty
    return out


PARAMS = [
    SamplingParams(presence_penalty=0.7, frequency_penalty=0.4, repetition_penalty=1.3),
    SamplingParams(),  # a neutral row in a penalised batch
    SamplingParams(repetition_penalty=0.8, logit_bias={3: 5.0, 1: -100.0}),
    SamplingParams(presence_penalty=-1.5, frequency_penalty=2.0),
]


def _batch(vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, vocab, (6,), generator=g).tolist() for _ in PARAMS]
    gens = [torch.randint(0, vocab, (9,), generator=g).tolist() for _ in PARAMS]
    counts = []
    for p, pr, gen in zip(PARAMS, prompts, gens, strict=True):
        c = TokenCounts(pr, vocab, torch.device("cpu")) if p.needs_token_counts else None
        if c is not None:
            c.add(gen[:4])
            c.add(gen[4:])  # incremental, as at two commits
        counts.append(c)
    return prompts, gens, counts


def test_dense_penalties_match_definitions() -> None:
    vocab = 12
    prompts, gens, counts = _batch(vocab, 0)
    logits = torch.randn(len(PARAMS), vocab, generator=torch.Generator().manual_seed(1)) * 3
    pen = BatchPenalties.build(PARAMS, counts, vocab, torch.device("cpu"))
    got = apply_penalties(logits, pen)
    for b, p in enumerate(PARAMS):
        used_gen = gens[b] if p.needs_token_counts else []
        used_prompt = prompts[b] if p.needs_token_counts else []
        want = _scalar_reference(logits[b].tolist(), used_prompt, used_gen, p)
        assert torch.allclose(got[b], torch.tensor(want), atol=1e-5), b
    assert torch.equal(got[1], logits[1])
    assert BatchPenalties.build([SamplingParams()] * 2, [None, None], vocab, torch.device("cpu")) is None


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tree_rows_equal_dense_penalties_with_the_path_tokens(seed: int) -> None:
    """Every real node's row equals the dense form with the request's counts plus the tokens on the node's
    path (root excluded: it is the last committed token), computed by walking parents."""
    vocab = 6  # small: drafted tokens repeat along paths and match prompt tokens
    prompts, gens, counts = _batch(vocab, seed)
    bs = len(PARAMS)
    g = torch.Generator().manual_seed(10 + seed)
    tree = build_ddtree(
        torch.randn(bs, 4, vocab, generator=g) * 2,
        torch.tensor([9, 5, 12, 7]),
        torch.tensor([seq[-1] for seq in gens]),
        torch.full((bs,), 20),
        chain=False,
    )
    d = tree.num_slots
    logits = torch.randn(bs, d, vocab, generator=g) * 3
    pen = BatchPenalties.build(PARAMS, counts, vocab, torch.device("cpu"))
    got = apply_tree_penalties(logits, pen, tree.candidates, tree.tree_mask, tree.parents >= 0)
    deep = 0
    for b in range(bs):
        for i in range(1 + int(tree.num_nodes[b])):
            path, node = [], i
            while node > 0:
                path.append(int(tree.candidates[b, node]))
                node = int(tree.parents[b, node])
            deep = max(deep, len(path))
            c = None
            if counts[b] is not None:
                c = TokenCounts(prompts[b], vocab, torch.device("cpu"))
                c.add(gens[b] + path[::-1])
            row_pen = BatchPenalties.build([PARAMS[b]], [c], vocab, torch.device("cpu"))
            want = apply_penalties(logits[b, i][None], row_pen)[0]
            assert torch.allclose(got[b, i], want, atol=1e-5), (b, i, path)
    assert deep >= 3


def test_a_vanishing_repetition_penalty_keeps_logits_finite() -> None:
    """repetition_penalty 5e-324 passes validation ((0, 2]) but is 0 in float32: the processed logits stay
    finite (a server fuzz got NaN probabilities and a failed step before), the seen positive ones on top."""
    vocab = 8
    params = [SamplingParams(repetition_penalty=5e-324)]
    counts = [TokenCounts([1, 2], vocab, torch.device("cpu"))]
    logits = torch.tensor([[0.5, 2.0, -1.0, 0.1, 0.0, 1.0, -3.0, 0.2]])
    got = apply_penalties(logits, BatchPenalties.build(params, counts, vocab, torch.device("cpu")))
    assert torch.isfinite(got).all() and got[0].argmax().item() == 1
    assert torch.isfinite(torch.softmax(got, -1)).all()


def test_no_penalties_is_identity() -> None:
    logits = torch.randn(2, 3, 5)
    tree_cands = torch.zeros(2, 3, dtype=torch.int64)
    assert (
        apply_tree_penalties(
            logits,
            None,
            tree_cands,
            torch.ones(2, 3, 3, dtype=torch.bool),
            torch.ones(2, 3, dtype=torch.bool),
        )
        is logits
    )


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3.0}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": 2.1}, "repetition_penalty"),
        ({"logit_bias": {5: 101.0}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {12: 1.0}}, "out of range"),
    ],
)
def test_sampling_params_validation(kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw).validate(vocab_size=12)
