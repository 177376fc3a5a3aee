"""Sampled tree verification with penalties reproduces the penalised target distribution node by node
(issue 14, item 4): a depth-1 node's row counts the request's tokens plus the node's own token."""

from __future__ import annotations

import torch

from ddtree_serve.model_executor.penalties import BatchPenalties, TokenCounts
from ddtree_serve.model_executor.position_uniforms import SampleKeys
from ddtree_serve.model_executor.sampling_params import SamplingParams
from ddtree_serve.speculative.ddtree import build_ddtree
from ddtree_serve.speculative.verify import verify_tree

PROMPT, GENERATED = [0, 1], [1, 2, 2]  # the root token is the last generated one (2)
PARAMS = SamplingParams(
    temperature=0.8, presence_penalty=0.8, frequency_penalty=0.5, repetition_penalty=1.4, logit_bias={4: 1.0}
)


def _by_hand(logits: torch.Tensor, generated: list[int]) -> torch.Tensor:
    """softmax of the penalised logits / T, written out per token (independent of ddtree_serve.model_executor.penalties)."""
    out = logits.double().clone()
    for t, b in PARAMS.logit_bias.items():
        out[t] += b
    for t in range(out.shape[0]):
        if t in PROMPT or t in generated:
            r = PARAMS.repetition_penalty
            out[t] = out[t] / r if out[t] > 0 else out[t] * r
        c = generated.count(t)
        out[t] -= c * PARAMS.frequency_penalty + (PARAMS.presence_penalty if c else 0.0)
    return torch.softmax(out / PARAMS.temperature, -1)


def test_sampled_verification_with_penalties_matches_penalised_distribution() -> None:
    """Emitted (first, second) tokens of one step ~ sequential sampling from the penalised target, where
    the second token's distribution counts the first. Same tolerances as the unpenalised test in
    test_verify.py: N = 12000 requests, fixed seeds, TV < 0.035 and chi-square p-value > 1e-3 over cells
    with expected count >= 5. Ignoring the path (only the request's counts at every node) moves the
    second-token law by TV ~0.1 here (checked below, so the test has power)."""
    gen = torch.Generator().manual_seed(11)
    n, vocab, depth = 12000, 5, 3
    l1 = torch.randn(vocab, generator=gen) * 1.2
    l2 = torch.randn(vocab, vocab, generator=gen) * 1.2
    draft = torch.randn(n, depth, vocab, generator=gen) * 1.5
    tree = build_ddtree(draft, torch.full((n,), 6), torch.full((n,), GENERATED[-1]), torch.full((n,), 5))
    d = tree.num_slots
    target = torch.randn(n, d, vocab, generator=gen)  # deeper rows: arbitrary
    target[:, 0] = l1
    is_d1 = tree.depths == 1  # [n, D]
    target[is_d1] = l2[tree.candidates[is_d1]]
    counts = TokenCounts(PROMPT, vocab, torch.device("cpu"))
    counts.add(GENERATED)
    one = BatchPenalties.build([PARAMS], [counts], vocab, torch.device("cpu"))
    pen = BatchPenalties(
        *(
            t.expand(n, *t.shape[1:])
            for t in (one.presence, one.frequency, one.repetition, one.generated, one.seen, one.bias)
        )
    )
    keys = SampleKeys.build([5000 + i for i in range(n)], [len(GENERATED)] * n, torch.device("cpu"))
    res = verify_tree(
        tree,
        target,
        torch.full((n,), PARAMS.temperature),
        torch.full((n,), -1),
        torch.ones(n),
        torch.zeros(n, dtype=torch.bool),
        keys,
        penalties=pen,
    )
    assert res.accept_length.float().mean() > 0.3  # the trees are actually used

    p1 = _by_hand(l1, GENERATED)  # [V]
    p2 = torch.stack([_by_hand(l2[a], GENERATED + [a]) for a in range(vocab)])  # [V, V]
    p2_no_path = torch.stack([_by_hand(l2[a], GENERATED) for a in range(vocab)])
    assert 0.5 * (p1[:, None] * (p2 - p2_no_path)).abs().sum() > 0.08  # the path matters here

    child = torch.zeros(n, vocab, dtype=torch.bool)  # [n, V] is token a a child of the root
    child[is_d1.nonzero()[:, 0], tree.candidates[is_d1]] = True
    pair_p = (p1[:, None] * p2).reshape(1, -1) * child.double().repeat_interleave(vocab, 1)  # [n, V*V]
    single_p = p1[None, :] * (~child).double()  # [n, V]
    expected = torch.cat([pair_p, single_p], 1).sum(0)  # [V*V + V] expected counts
    first, second = res.emitted_tokens[:, 0], res.emitted_tokens[:, 1]
    cells = torch.where(res.accept_length >= 1, first * vocab + second, vocab * vocab + first)
    observed = torch.bincount(cells, minlength=vocab * vocab + vocab).double()
    assert observed.sum() == n and abs(expected.sum().item() - n) < 1e-6 * n
    tv = 0.5 * (observed / n - expected / n).abs().sum().item()
    assert tv < 0.035, tv
    big = expected >= 5
    obs = torch.cat([observed[big], observed[~big].sum(0, keepdim=True)])
    exp = torch.cat([expected[big], expected[~big].sum(0, keepdim=True)])
    keep = exp > 0
    chi2 = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    dof = int(keep.sum()) - 1
    p_value = torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), chi2 / 2).item()
    assert p_value > 1e-3, (chi2.item(), dof, p_value)
