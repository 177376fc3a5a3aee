"""Builders and a scalar (per-request) model of the tree verification kernels, shared by the CPU tests
and tests/gpu."""

from __future__ import annotations

import random

import torch

from ddtree_serve.kernels.speculative import tree_speculative_sampling_target_only, verify_tree_greedy

# ----------------------------------------------------------------------------- tree helpers


def pack_trees(trees: list[tuple[list[int], list[int]]], d: int, pad_garbage: bool = True) -> dict:
    """trees: (parents, tokens) per request; parents[0] = -1, parents[i] < i; siblings in index order.
    Returns the retrieve buffers of docs/DESIGN.md 4.1 for D = d slots (padding slots filled with garbage)."""
    bs = len(trees)
    g = torch.Generator().manual_seed(123)
    cand = (
        torch.randint(-9, 99, (bs, d), generator=g) if pad_garbage else torch.zeros(bs, d, dtype=torch.long)
    )
    nt = torch.randint(-9, 99, (bs, d), generator=g) if pad_garbage else torch.full((bs, d), -1)
    ns = torch.randint(-9, 99, (bs, d), generator=g) if pad_garbage else torch.full((bs, d), -1)
    depth = torch.zeros(bs, d, dtype=torch.long)
    for b, (parents, tokens) in enumerate(trees):
        n = len(parents)
        nt[b, :n] = -1
        ns[b, :n] = -1
        cand[b, :n] = torch.tensor(tokens)
        last_child: dict[int, int] = {}
        for i in range(1, n):
            p = parents[i]
            depth[b, i] = depth[b, p] + 1
            if p in last_child:
                ns[b, last_child[p]] = i
            else:
                nt[b, p] = i
            last_child[p] = i
    ridx = torch.arange(bs * d).view(bs, d)
    return dict(
        candidates=cand, retrive_index=ridx, retrive_next_token=nt, retrive_next_sibling=ns, depth=depth
    )


def outputs(bs: int, d: int, s: int, device: torch.device | str = "cpu") -> dict:
    """The in-place output buffers of both kernels, on ``device`` (the tree's)."""
    return dict(
        predicts=torch.full((bs * d,), -7, dtype=torch.int32, device=device),
        accept_index=torch.full((bs, s), -3, dtype=torch.int32, device=device),
        accept_token_num=torch.full((bs,), -3, dtype=torch.int32, device=device),
    )


def greedy_args(tree: dict, target_predict: torch.Tensor, s: int) -> dict:
    """Every argument of verify_tree_greedy, outputs on the tree's device."""
    bs, d = tree["candidates"].shape
    out = outputs(bs, d, s, tree["candidates"].device)
    return dict(**out, **{k: v for k, v in tree.items() if k != "depth"}, target_predict=target_predict)


def sampling_args(tree, coins, final, target, draft=None, s=None) -> dict:
    """Every tensor argument of tree_speculative_sampling_target_only, outputs on the tree's device."""
    bs, d = tree["candidates"].shape
    s = s if s is not None else int(tree["depth"].max()) + 1
    out = outputs(bs, d, s, tree["candidates"].device)
    draft = torch.zeros_like(target) if draft is None else draft
    return dict(
        **out,
        **{k: v for k, v in tree.items() if k != "depth"},
        uniform_samples=coins,
        uniform_samples_for_final_sampling=final,
        target_probs=target,
        draft_probs=draft,
    )


def run_greedy(tree: dict, target_predict: torch.Tensor, s: int) -> dict:
    args = greedy_args(tree, target_predict, s)
    verify_tree_greedy(**args)
    return {k: args[k] for k in ("predicts", "accept_index", "accept_token_num")}


def run_sampling(tree, coins, final, target, draft=None, s=None, **kw) -> dict:
    args = sampling_args(tree, coins, final, target, draft, s)
    tree_speculative_sampling_target_only(**args, **kw)
    return {k: args[k] for k in ("predicts", "accept_index", "accept_token_num", "draft_probs")}


def random_tree(rng: random.Random, n_nodes: int, vocab: int) -> tuple[list[int], list[int]]:
    """Random tree with distinct sibling tokens (root token arbitrary)."""
    parents, tokens, used = [-1], [rng.randrange(vocab)], {0: set()}
    for i in range(1, n_nodes):
        choices = [p for p in range(i) if len(used[p]) < vocab]
        p = rng.choice(choices)
        tok = rng.choice([t for t in range(vocab) if t not in used[p]])
        used[p].add(tok)
        used[i] = set()
        parents.append(p)
        tokens.append(tok)
    return parents, tokens


# ----------------------------------------------------------------------------- naive per-request model


def naive_walk(tree: dict, b: int, s: int, accept) -> tuple[list[int], list[int]]:
    """Scalar transcription of docs/DESIGN.md 4.2: returns (path of local nodes, accepted child per parent)."""
    nt, ns, cand = tree["retrive_next_token"][b], tree["retrive_next_sibling"][b], tree["candidates"][b]
    path = [0]
    for _ in range(1, s):
        cur, chosen = int(nt[path[-1]]), -1
        state: dict = {}
        while cur != -1:
            if accept(path[-1], int(cand[cur]), cur, state):
                chosen = cur
                break
            cur = int(ns[cur])
        if chosen == -1:
            break
        path.append(chosen)
    return path, [int(cand[i]) for i in path[1:]]


def naive_sampling(tree, b, s, coins, final, target, draft, t_single=1.0, t_acc=1.0, rule="le"):
    """Scalar model of the sampling kernel: accept iff ``coin <= acc / t_acc`` (``rule="le"``, AOT
    sgl-kernel) or ``coin < acc / t_acc`` (``"lt"``), or ``p >= t_single``; ``acc`` in float32."""
    draft = draft.clone()
    coin = [coins[b, 0]]

    def accept(parent, tok, node, st):
        p = target[b, parent, tok]
        st["acc"] = st.get("acc", torch.zeros((), dtype=torch.float32)) + p
        scaled = st["acc"] / t_acc
        if bool(coin[0] <= scaled if rule == "le" else coin[0] < scaled) or float(p) >= t_single:
            coin[0] = coins[b, node]
            return True
        draft[b, parent, tok] = p
        return False

    path, toks = naive_walk(tree, b, s, accept)
    q = target[b, path[-1]].double()
    pd = torch.zeros_like(q) if len(path) == s else draft[b, path[-1]].double()
    w = (q - pd).clamp_min(0)
    cdf = w.cumsum(0)
    hits = [i for i in range(len(w)) if cdf[i] > float(final[b]) * cdf[-1] and w[i] > 0]
    bonus = hits[0] if hits else max(i for i in range(len(w)) if w[i] > 0)
    return path, toks, bonus, draft[b]


def check_path_structure(tree: dict, out: dict, b: int) -> list[int]:
    """accept_index is a root-to-node path, -1 after; predicts along it are the children's tokens."""
    d = tree["candidates"].shape[1]
    n = int(out["accept_token_num"][b])
    row = out["accept_index"][b].tolist()
    assert row[0] == b * d and all(x == -1 for x in row[n + 1 :])
    local = [x - b * d for x in row[: n + 1]]
    for parent, child in zip(local, local[1:], strict=False):
        kids, c = [], int(tree["retrive_next_token"][b, parent])
        while c != -1:
            kids.append(c)
            c = int(tree["retrive_next_sibling"][b, c])
        assert child in kids
        assert int(out["predicts"][b * d + parent]) == int(tree["candidates"][b, child])
    return local
