"""Tree verification derivation (ddtree_serve/speculative/verify.py) over ddtree_serve.kernels.speculative / ddtree_serve.kernels.sampling."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch

import ddtree_serve.kernels.speculative as kspec
from ddtree_serve.kernels.sampling import inverse_cdf_sample
from ddtree_serve.model_executor.position_uniforms import SampleKeys, position_uniform_reference
from ddtree_serve.speculative.commit import attach_logprobs
from ddtree_serve.speculative.ddtree import DraftTree, build_ddtree
from ddtree_serve.speculative.types import DecodeResult
from ddtree_serve.speculative.verify import (
    COIN_RULE_ENV,
    VerifyResult,
    build_target_probs,
    verify_tree,
)


def _tree(draft_logits: torch.Tensor, budgets: list[int], chain: bool = False) -> DraftTree:
    bs = draft_logits.shape[0]
    return build_ddtree(
        draft_logits,
        torch.tensor(budgets, dtype=torch.int64),
        torch.zeros(bs, dtype=torch.int64),
        torch.full((bs,), 5, dtype=torch.int64),
        chain=chain,
    )


def _params(bs: int, temp: float = 1.0, top_k: int = -1, top_p: float = 1.0, greedy: bool = False):
    return (
        torch.full((bs,), temp),
        torch.full((bs,), top_k, dtype=torch.int64),
        torch.full((bs,), top_p),
        torch.full((bs,), greedy, dtype=torch.bool),
    )


def _gens(seeds: list[int]) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(s) for s in seeds]


def _keys(seeds: list[int], positions: list[int] | None = None) -> SampleKeys:
    return SampleKeys.build(seeds, positions if positions is not None else [0] * len(seeds), torch.device("cpu"))


def _children(tree: DraftTree, b: int, node: int) -> list[int]:
    out, c = [], int(tree.retrive_next_token[b, node])
    while c != -1:
        out.append(c)
        c = int(tree.retrive_next_sibling[b, c])
    return out


def _oracle(tree: DraftTree, probs: torch.Tensor, coins: torch.Tensor, final: torch.Tensor, b: int, rule: str):
    """Plain-Python walk of one request (docs/DESIGN.md 4.2 semantics, thresholds 1, draft_probs 0) under the
    kernel's acceptance rule ``coin <= acc`` (``le``) or ``coin < acc`` (``lt``), no ``p > 0`` test."""
    node, coin, path, toks = 0, coins[b, 0], [0], []
    residual = probs[b, 0].clone()
    while True:
        acc, nxt = torch.zeros((), dtype=torch.float32), None  # float32 running sum, as the kernel
        residual = probs[b, node].clone()
        for c in _children(tree, b, node):
            tok = int(tree.candidates[b, c])
            p = probs[b, node, tok]
            acc = acc + p
            if bool(coin <= acc if rule == "le" else coin < acc) or float(p) >= 1.0:
                nxt = c
                break
            residual[tok] = 0.0
        if nxt is None:
            break
        path.append(nxt)
        toks.append(int(tree.candidates[b, nxt]))
        node, coin = nxt, coins[b, nxt]
    cdf = residual.double().cumsum(0)
    bonus = int(torch.searchsorted(cdf, float(final[b]) * cdf[-1], right=True))
    return path, toks + [bonus]


def _check_result(res: VerifyResult, tree: DraftTree) -> None:
    bs, s = res.accept_index.shape
    assert s == 1 + int(tree.depths.max())
    for b in range(bs):
        n = int(res.accept_length[b])
        path = res.accept_index[b].tolist()
        assert path[0] == 0 and all(x == -1 for x in path[n + 1 :])
        for j in range(1, n + 1):
            assert int(tree.parents[b, path[j]]) == path[j - 1]
            assert int(res.emitted_tokens[b, j - 1]) == int(tree.candidates[b, path[j]])
        assert int(res.emitted_tokens[b, n]) >= 0
        assert all(x == -1 for x in res.emitted_tokens[b, n + 1 :].tolist())


def test_greedy_hand_built() -> None:
    vocab = 6
    draft = torch.full((1, 3, vocab), -5.0)
    draft[0, 0, 1], draft[0, 0, 2] = 3.0, 2.5  # depth 1: 1 then 2
    draft[0, 1, 3], draft[0, 1, 4] = 3.0, 2.0  # depth 2: 3 then 4
    draft[0, 2, 5] = 3.0
    tree = _tree(draft, [10])
    cand, par = tree.candidates[0].tolist(), tree.parents[0].tolist()
    # The target wants 2 -> 4 -> 0: accept the second child of the root, then its second child.
    n2 = next(i for i in range(1, 11) if par[i] == 0 and cand[i] == 2)
    n24 = next((i for i in range(1, 11) if par[i] == n2 and cand[i] == 4), None)
    assert n24 is not None, (cand, par)
    target = torch.randn(1, tree.num_slots, vocab) * 0.1
    target[0, 0, 2] = 5.0
    target[0, n2, 4] = 5.0
    target[0, n24, 0] = 5.0  # bonus: 0 (no such child)
    res = verify_tree(tree, target, *_params(1, temp=0.0, greedy=True), [None])
    _check_result(res, tree)
    assert res.accept_length.tolist() == [2]
    assert res.accept_index[0, :3].tolist() == [0, n2, n24]
    assert res.emitted_tokens[0, :3].tolist() == [2, 4, 0]
    # the worker's logprobs of the emitted tokens: raw target rows of the root and the accepted nodes
    lsm = torch.log_softmax(target[0], -1)
    out = [DecodeResult([2, 4], 2)]  # a stop cut the bonus token
    attach_logprobs([SimpleNamespace(params=SimpleNamespace(logprobs=1))], res, target, out)
    assert [lp for lp, _ in out[0].logprobs] == pytest.approx([lsm[0, 2].item(), lsm[n2, 4].item()])
    assert [top[0][0] for _, top in out[0].logprobs] == [2, 4]
    # No match at the root: bonus only.
    target[0, 0] = 0.0
    target[0, 0, 5] = 5.0
    res = verify_tree(tree, target, *_params(1, temp=0.0, greedy=True), [None])
    assert res.accept_length.tolist() == [0]
    assert res.emitted_tokens[0, 0].item() == 5 and res.accept_index[0, 0].item() == 0


def test_greedy_random_matches_argmax_walk() -> None:
    gen = torch.Generator().manual_seed(0)
    bs, vocab = 16, 5
    draft = torch.randn(bs, 4, vocab, generator=gen) * 2
    tree = _tree(draft, [1 + (3 * b) % 13 for b in range(bs)])
    target = torch.randn(bs, tree.num_slots, vocab, generator=gen) * 3
    res = verify_tree(tree, target, *_params(bs, temp=0.0, greedy=True), [None] * bs)
    _check_result(res, tree)
    one_hot = build_target_probs(target, *_params(bs, temp=0.0, greedy=True))
    ones = torch.ones(bs, tree.num_slots)  # greedy rows' coins: one-hot rows walk the argmax under both rules
    for b, rule in itertools.product(range(bs), ("le", "lt")):
        path, toks = _oracle(tree, one_hot, ones, torch.full((bs,), 0.5), b, rule)
        n = len(path) - 1
        assert res.accept_index[b, : n + 1].tolist() == path
        assert res.emitted_tokens[b, : n + 1].tolist() == toks
        assert toks[-1] == int(target[b, path[-1]].argmax())
    assert res.accept_length.sum() > 0


def test_chain_tree_full_acceptance() -> None:
    draft = torch.randn(2, 4, 7, generator=torch.Generator().manual_seed(2))
    tree = _tree(draft, [4, 2], chain=True)
    target = torch.zeros(2, tree.num_slots, 7)
    for b in range(2):
        for i in range(int(tree.num_nodes[b])):
            target[b, i, tree.candidates[b, i + 1]] = 4.0  # row i wants the next chain token
        target[b, int(tree.num_nodes[b]), 6] = 4.0
    res = verify_tree(tree, target, *_params(2, temp=0.0, greedy=True), [None, None])
    assert res.accept_length.tolist() == [4, 2]
    assert res.emitted_tokens[1, :3].tolist() == [*tree.candidates[1, 1:3].tolist(), 6]
    assert res.emitted_tokens[0, 4].item() == 6


def _coupled_oracle(tree: DraftTree, probs: torch.Tensor, seed: int, position: int, b: int):
    """Plain-Python walk of one sampled request under the coupled rule: at a node of depth d the target's
    token is the inverse-CDF draw with u(seed, position + d); accept the child holding it, else stop."""
    node, path, toks = 0, [0], []
    while True:
        u = position_uniform_reference(seed, position + int(tree.depths[b, node]))
        y = int(inverse_cdf_sample(probs[b, node][None], torch.tensor([u], dtype=torch.float32))[0])
        toks.append(y)
        nxt = next((c for c in _children(tree, b, node) if int(tree.candidates[b, c]) == y), None)
        if nxt is None:
            return path, toks
        path.append(nxt)
        node = nxt


def test_mixed_batch_runs_one_walk_and_follows_the_coupled_oracle(monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy and sampled rows share the greedy walk (one kernel call); greedy rows equal the all-greedy
    batch's, sampled rows the plain-Python walk over position-keyed inverse-CDF tokens."""
    gen = torch.Generator().manual_seed(1)
    bs, vocab = 8, 6
    draft = torch.randn(bs, 3, vocab, generator=gen) * 2
    tree = _tree(draft, [8] * bs)
    target = draft.new_zeros(bs, tree.num_slots, vocab)
    target += torch.randn(bs, tree.num_slots, vocab, generator=gen) * 2
    calls: list[str] = []
    real_greedy, real_sampling = kspec.verify_tree_greedy, kspec.tree_speculative_sampling_target_only
    monkeypatch.setattr(kspec, "verify_tree_greedy", lambda *a: (calls.append("g"), real_greedy(*a))[1])
    monkeypatch.setattr(
        kspec, "tree_speculative_sampling_target_only",
        lambda *a, **k: (calls.append("s"), real_sampling(*a, **k))[1],
    )
    greedy = verify_tree(tree, target, *_params(bs, temp=0.0, greedy=True))
    assert calls == ["g"]
    temp, top_k, top_p, is_greedy = _params(bs, temp=0.8, top_k=4, top_p=0.9)
    is_greedy[::2] = True
    temp[::2] = 0.0
    seeds, positions = list(range(10, 10 + bs)), [3 * b for b in range(bs)]
    mixed = verify_tree(tree, target, temp, top_k, top_p, is_greedy, _keys(seeds, positions))
    assert calls == ["g", "g"]
    _check_result(mixed, tree)
    for f in ("accept_index", "accept_length", "emitted_tokens"):
        assert torch.equal(getattr(mixed, f)[::2], getattr(greedy, f)[::2]), f
    probs = build_target_probs(target, temp, top_k, top_p, is_greedy)
    accepted = 0
    for b in range(1, bs, 2):
        path, toks = _coupled_oracle(tree, probs, seeds[b], positions[b], b)
        assert mixed.accept_index[b, : len(path)].tolist() == path
        assert mixed.emitted_tokens[b, : len(toks)].tolist() == toks
        accepted += len(path) - 1
    assert accepted > 0  # the sampled rows did accept drafts
    # relaxed acceptance keeps sgl-kernel's coin rule (the sampling kernel)
    verify_tree(tree, target, temp, top_k, top_p, is_greedy, None, threshold_acc=0.7, generators=_gens(seeds))
    assert calls == ["g", "g", "s"]


def test_sampled_rows_need_keys() -> None:
    tree = _tree(torch.randn(2, 3, 4), [3, 3])
    with pytest.raises(ValueError, match="sample keys"):
        verify_tree(tree, torch.randn(2, tree.num_slots, 4), *_params(2))


def test_target_probs_filters() -> None:
    logits = torch.tensor([[[2.0, 1.0, 0.0, -1.0]]]).repeat(3, 1, 1)  # [3, 1, 4]
    temp = torch.tensor([1.0, 0.5, 0.0])
    probs = build_target_probs(
        logits, temp, torch.tensor([2, -1, -1]), torch.tensor([1.0, 0.8, 1.0]), torch.tensor([False, False, True])
    )
    p0 = torch.softmax(logits[0, 0, :2], -1)
    assert torch.allclose(probs[0, 0], torch.cat([p0, torch.zeros(2)]))
    q = torch.softmax(logits[1, 0] / 0.5, -1)  # [0.865, 0.117, ...]: top-p 0.8 keeps the first only
    assert q[0] > 0.8
    assert torch.allclose(probs[1, 0], torch.tensor([1.0, 0.0, 0.0, 0.0]))
    assert torch.equal(probs[2, 0], torch.tensor([1.0, 0.0, 0.0, 0.0]))


def test_seeded_reproducibility_and_batch_invariance() -> None:
    gen = torch.Generator().manual_seed(4)
    bs, vocab = 12, 5
    draft = torch.randn(bs, 3, vocab, generator=gen)
    budgets = [6] * bs
    tree = _tree(draft, budgets)
    target = torch.randn(bs, tree.num_slots, vocab, generator=gen)
    args = _params(bs, temp=1.0)
    a = verify_tree(tree, target, *args, _keys(list(range(bs))))
    b = verify_tree(tree, target, *args, _keys(list(range(bs))))
    for f in ("accept_index", "accept_length", "emitted_tokens"):
        assert torch.equal(getattr(a, f), getattr(b, f))
    c = verify_tree(tree, target, *args, _keys(list(range(100, 100 + bs))))
    assert not torch.equal(a.emitted_tokens, c.emitted_tokens)
    # Request 0 alone gives the same result as inside a batch whose other tree is wider (D larger).
    wide = _tree(torch.cat([draft[:1], draft[1:2]]), [6, 14])
    t_wide = torch.randn(2, wide.num_slots, vocab, generator=gen)
    t_wide[0, :7] = target[0]
    alone = verify_tree(wide, t_wide, *_params(2), _keys([0, 1]))
    n = int(a.accept_length[0]) + 1
    assert alone.emitted_tokens[0, :n].tolist() == a.emitted_tokens[0, :n].tolist()


def _filtered(logits: torch.Tensor, temp: float, top_k: int, top_p: float) -> torch.Tensor:
    """Independent reference of softmax(l / T) -> top-k -> top-p (no ties in these tests)."""
    p = torch.softmax(logits.double() / temp, -1)
    if 0 < top_k < p.shape[-1]:
        kth = p.topk(top_k, -1).values[..., -1:]
        p = torch.where(p >= kth, p, 0.0)
        p = p / p.sum(-1, keepdim=True)
    if top_p < 1.0:
        s, i = p.sort(-1, descending=True)
        keep_sorted = (s.cumsum(-1) - s) < top_p
        keep = torch.zeros_like(p, dtype=torch.bool).scatter(-1, i, keep_sorted)
        p = torch.where(keep, p, 0.0)
        p = p / p.sum(-1, keepdim=True)
    return p


@pytest.mark.parametrize("temp,top_k,top_p", [(1.0, -1, 1.0), (0.7, 4, 0.85)])
def test_sampled_verification_matches_target_distribution(temp: float, top_k: int, top_p: float) -> None:
    """Emitted (first, second) tokens ~ sequential sampling from the target.

    Target: row 0 (after the root) has logits l1, a depth-1 node with token a has logits l2[a]; so the
    first token ~ p1 and, when it is a tree child (then a second token is always emitted), the second
    ~ p2[a]. Expected cell probabilities are averaged over the (random, per-request) trees. Tolerance:
    chi-square p-value > 1e-3 over cells with expected count >= 5 (rest lumped), and total variation
    < 0.035, with N = 12000 requests and fixed seeds (deterministic outcome). Sampling noise alone gives
    TV ~0.01 here; lossy verification (threshold_acc 0.7) gives TV 0.12-0.16 and fails both checks. Each
    request has its own seed (u(seed, t) is independent across seeds)."""
    gen = torch.Generator().manual_seed(7)
    n, vocab, depth = 12000, 5, 3
    l1 = torch.randn(vocab, generator=gen) * 1.2
    l2 = torch.randn(vocab, vocab, generator=gen) * 1.2
    draft = torch.randn(n, depth, vocab, generator=gen) * 1.5
    tree = _tree(draft, [6] * n)
    d = tree.num_slots
    target = torch.randn(n, d, vocab, generator=gen)  # deeper rows: arbitrary
    target[:, 0] = l1
    is_d1 = tree.depths == 1  # [n, D]
    target[is_d1] = l2[tree.candidates[is_d1]]
    res = verify_tree(tree, target, *_params(n, temp, top_k, top_p), _keys(list(range(1000, 1000 + n))))
    assert res.accept_length.float().mean() > 0.3  # the trees are actually used

    p1 = _filtered(l1, temp, top_k, top_p)  # [V]
    p2 = _filtered(l2, temp, top_k, top_p)  # [V, V]
    # Cells: pair (a, b) -> a * V + b; singleton a -> V * V + a.
    child = torch.zeros(n, vocab, dtype=torch.bool)  # [n, V] is token a a child of the root
    child[is_d1.nonzero()[:, 0], tree.candidates[is_d1]] = True
    pair_p = (p1[:, None] * p2).reshape(1, -1) * child.double().repeat_interleave(vocab, 1)  # [n, V*V]
    single_p = p1[None, :] * (~child).double()  # [n, V]
    expected = torch.cat([pair_p, single_p], 1).sum(0)  # [V*V + V] expected counts
    first, second = res.emitted_tokens[:, 0], res.emitted_tokens[:, 1]
    two = res.accept_length >= 1  # [n]
    cells = torch.where(two, first * vocab + second, vocab * vocab + first)
    observed = torch.bincount(cells, minlength=vocab * vocab + vocab).double()
    assert observed.sum() == n and abs(expected.sum().item() - n) < 1e-6 * n
    assert not (observed[expected == 0] > 0).any()  # never emits a filtered-out token
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


def test_coin_rule_env_is_validated(monkeypatch: pytest.MonkeyPatch) -> None:
    tree = _tree(torch.randn(2, 3, 4), [3, 3])
    monkeypatch.setenv(COIN_RULE_ENV, "lte")
    with pytest.raises(ValueError, match=COIN_RULE_ENV):
        verify_tree(tree, torch.randn(2, tree.num_slots, 4), *_params(2), None, threshold_acc=0.5,
                    generators=_gens([0, 1]))


def test_rejects_mismatched_shapes() -> None:
    tree = _tree(torch.randn(2, 3, 4), [3, 3])
    with pytest.raises(ValueError):
        verify_tree(tree, torch.randn(2, 2, 4), *_params(2), _keys([0, 1]))
    with pytest.raises(ValueError, match="generators"):
        verify_tree(tree, torch.randn(2, tree.num_slots, 4), *_params(2), None, threshold_acc=0.5,
                    generators=[None])
