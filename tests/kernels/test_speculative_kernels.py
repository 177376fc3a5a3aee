"""Tree verification kernels: hand-built trees, properties on random trees, exactness of sampling."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ddtree_serve.kernels.speculative import (
    PINNED_COIN_RULE,
    tree_speculative_sampling_target_only,
    verify_tree_greedy,
)
from tests.kernels.tree_helpers import (
    check_path_structure,
    naive_sampling,
    naive_walk,
    outputs,
    pack_trees,
    random_tree,
    run_greedy,
    run_sampling,
)

# ----------------------------------------------------------------------------- greedy, hand-built

# root(0) -> 1 [tok 5] -> 3 [tok 9] -> 5 [tok 2]
#         -> 2 [tok 7] -> 4 [tok 8]
TREE_A = ([-1, 0, 0, 1, 2, 3], [1, 5, 7, 9, 8, 2])


def test_greedy_hand_built_batch():
    chain = ([-1, 0, 1], [4, 6, 3])
    tree = pack_trees([TREE_A, TREE_A, TREE_A, chain], d=6)
    tp = torch.zeros(4, 6, dtype=torch.long)
    tp[0, [0, 2, 4]] = torch.tensor([7, 8, 11])  # second sibling, then its child; bonus 11 at node 4
    tp[1, [0, 1, 3, 5]] = torch.tensor([5, 9, 2, 13])  # full depth 3: bonus from node 5 alone
    tp[2, 0] = 6  # no child matches: only the bonus
    tp[3, [0, 1, 2]] = torch.tensor([6, 0, 42])  # chain: accept 1, reject 2 (target says 0)
    out = run_greedy(tree, tp, s=4)
    assert out["accept_token_num"].tolist() == [2, 3, 0, 1]
    assert out["accept_index"].tolist() == [[0, 2, 4, -1], [6, 7, 9, 11], [12, -1, -1, -1], [18, 19, -1, -1]]
    p = out["predicts"].tolist()
    assert (p[0], p[2], p[4]) == (7, 8, 11)
    assert (p[6], p[7], p[9], p[11]) == (5, 9, 2, 13)
    assert p[12] == 6
    assert (p[18], p[19]) == (6, 0)
    untouched = set(range(24)) - {0, 2, 4, 6, 7, 9, 11, 12, 18, 19}
    assert all(p[i] == -7 for i in untouched)


def test_greedy_depth_cap_s_smaller_than_tree():
    tree = pack_trees([TREE_A], d=6)
    tp = torch.tensor([[5, 9, 0, 2, 0, 13]])
    out = run_greedy(tree, tp, s=2)  # only one level may be accepted; bonus = target at node 1
    assert out["accept_index"].tolist() == [[0, 1]] and out["accept_token_num"].tolist() == [1]
    assert out["predicts"][:2].tolist() == [5, 9]


# ----------------------------------------------------------------------------- sampling, hand-built


def one_hot_rows(bs: int, d: int, v: int, argmax: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.one_hot(argmax, v).float().view(bs, d, v)


def test_sampling_hand_built_siblings_and_coins():
    v = 12
    tree = pack_trees([TREE_A, TREE_A], d=6)
    target = torch.full((2, 6, v), 0.0)
    target[:, :] = 1.0 / v
    # root row: tok5 0.3, tok7 0.4 ; node 2 row: tok8 0.5 ; node 1 row: tok9 0.2
    for b in range(2):
        target[b, 0] = 0.3 / (v - 2)
        target[b, 0, 5], target[b, 0, 7] = 0.3, 0.4
        target[b, 2] = 0.5 / (v - 1)
        target[b, 2, 8] = 0.5
    coins = torch.zeros(2, 6)
    coins[0, 0] = 0.5  # 0.5 >= 0.3 rejects tok5, 0.5 < 0.7 accepts tok7 (node 2)
    coins[0, 2] = 0.6  # node 2's coin: 0.6 >= 0.5 rejects tok8 -> stop at node 2
    coins[1, 0] = 0.1  # accepts tok5 (node 1)
    coins[1, 1] = 0.9  # rejects tok9 (p 1/12)
    final = torch.tensor([0.0, 0.999999])
    out = run_sampling(tree, coins, final, target)
    assert out["accept_index"].tolist() == [[0, 2, -1, -1], [6, 7, -1, -1]]
    assert out["accept_token_num"].tolist() == [1, 1]
    # rejected siblings' target probability copied into draft at the parent row
    assert out["draft_probs"][0, 0, 5] == pytest.approx(0.3)
    assert out["draft_probs"][0, 2, 8] == pytest.approx(0.5)
    assert out["draft_probs"][1, 1, 9] == pytest.approx(1 / v)
    assert out["draft_probs"].count_nonzero() == 3
    # bonus of request 0 from relu(target[2] - draft[2]): token 8 removed, u = 0 -> first positive = 0
    assert out["predicts"][0] == 7 and out["predicts"][2] == 0
    # request 1: u ~ 1 -> last positive token of relu(target[1] - draft[1]) = v - 1
    assert out["predicts"][6] == 5 and out["predicts"][7] == v - 1


def test_sampling_full_depth_bonus_from_target_row_alone():
    v = 6
    tree = pack_trees([([-1, 0, 1], [0, 2, 3])], d=3)
    target = torch.zeros(1, 3, v)
    target[0, 0, 2] = target[0, 1, 3] = 1.0
    target[0, 2] = torch.tensor([0.0, 0.5, 0.0, 0.0, 0.5, 0.0])
    draft = torch.zeros_like(target)
    draft[0, 2, 1] = 0.5  # ignored at full depth: the bonus comes from target[2] alone
    out = run_sampling(tree, torch.rand(1, 3), torch.tensor([0.1]), target, draft=draft)
    assert out["accept_token_num"].tolist() == [2]
    assert out["predicts"].tolist() == [2, 3, 1]


@pytest.mark.parametrize(("rule", "accepted"), [(None, [[0, 1]]), ("le", [[0, 1]]), ("lt", [[0, 2]])])
def test_sampling_coin_zero_and_zero_probability_child(rule, accepted):
    """Coin exactly 0, first child of probability 0: ``le`` (0 <= 0, the pinned AOT kernel, the default)
    accepts it, ``lt`` (0 < 0 is false) rejects it and accepts the next child (0 < 1)."""
    tree = pack_trees([([-1, 0, 0], [0, 1, 2])], d=3)
    target = torch.tensor([[[0.0, 0.0, 1.0, 0.0], [0.25] * 4, [0.25] * 4]])
    out = run_sampling(tree, torch.zeros(1, 3), torch.tensor([0.5]), target, coin_rule=rule)
    assert out["accept_index"].tolist() == accepted


def test_pinned_coin_rule_is_the_aot_kernel_rule():
    assert PINNED_COIN_RULE == "le"
    with pytest.raises(ValueError, match="coin_rule"):
        run_sampling(
            pack_trees([([-1, 0], [0, 1])], d=2),
            torch.ones(1, 2),
            torch.tensor([0.5]),
            torch.full((1, 2, 4), 0.25),
            coin_rule="leq",
        )


@pytest.mark.parametrize("rule", ["le", "lt"])
def test_sampling_coin_one_greedy_rows_walk_the_argmax(rule):
    """Greedy rows (one-hot targets) with coin 1 accept exactly the argmax child under both rules; with
    coin 0 the ``le`` rule accepts the FIRST child whatever its token (the defect of issue 14)."""
    tree = pack_trees([([-1, 0, 0, 2], [0, 4, 3, 1])], d=4)  # root -> tok4, tok3 -> tok1
    target = torch.zeros(1, 4, 6)
    target[0, 0, 3] = target[0, 2, 1] = target[0, 3, 5] = target[0, 1, 0] = 1.0  # argmax: 3, then 1, then 5
    out = run_sampling(tree, torch.ones(1, 4), torch.tensor([0.5]), target, coin_rule=rule)
    assert out["accept_index"].tolist() == [[0, 2, 3]] and out["predicts"][[0, 2, 3]].tolist() == [3, 1, 5]
    zero = run_sampling(tree, torch.zeros(1, 4), torch.tensor([0.5]), target, coin_rule=rule)
    assert zero["accept_index"].tolist() == ([[0, 1, -1]] if rule == "le" else [[0, 2, 3]])


@pytest.mark.parametrize("rule", ["le", "lt"])
def test_sampling_prob_acc_reaching_one_by_float_sums(rule):
    """Coin 1 and siblings whose float32 running sum reaches exactly 1.0 at the last child: ``le``
    accepts it (1 <= 1), ``lt`` does not (bonus from the residual). When the float32 sum stays below 1
    (0.99999994), neither rule accepts."""
    v = 8
    ps = [0.5, 0.25, 0.125, 0.125]  # float32 sums: 0.5, 0.75, 0.875, 1.0 exactly
    tree = pack_trees([([-1, 0, 0, 0, 0], [0, 1, 2, 3, 4])], d=5)
    target = torch.full((1, 5, v), 1.0 / v)
    target[0, 0] = 0.0
    target[0, 0, 1:5] = torch.tensor(ps)
    out = run_sampling(tree, torch.ones(1, 5), torch.tensor([0.5]), target, coin_rule=rule)
    assert out["accept_token_num"].tolist() == ([1] if rule == "le" else [0])
    if rule == "lt":  # all four siblings rejected: the residual row is empty -> kernel fallback V - 1
        assert int(out["predicts"][0]) == v - 1
    short = torch.tensor([0.1, 0.35, 0.35, 0.2], dtype=torch.float32)  # float32 running sum 0.99999994 < 1
    running = torch.zeros((), dtype=torch.float32)
    for x in short:  # sequential float32 adds, as the kernel's running prob_acc
        running = running + x
    assert float(running) < 1.0
    target[0, 0, 1:5] = short
    target[0, 0, 5] = 1.0 - float(short.sum())  # the tiny rest of the mass on a non-drafted token
    out = run_sampling(tree, torch.ones(1, 5), torch.tensor([0.5]), target, coin_rule=rule)
    assert out["accept_token_num"].tolist() == [0] and int(out["predicts"][0]) == 5


def test_sampling_thresholds():
    tree = pack_trees([([-1, 0], [0, 1])], d=2)
    target = torch.tensor([[[0.1, 0.6, 0.2, 0.1], [0.25] * 4]])
    coins = torch.tensor([[0.9, 0.0]])
    assert run_sampling(tree, coins, torch.tensor([0.0]), target)["accept_token_num"].item() == 0
    out = run_sampling(tree, coins, torch.tensor([0.0]), target, threshold_single=0.5)
    assert out["accept_token_num"].item() == 1
    out = run_sampling(tree, coins, torch.tensor([0.0]), target, threshold_acc=0.6)  # 0.9 < 0.6/0.6
    assert out["accept_token_num"].item() == 1


def test_greedy_equivalence_one_hot_targets():
    rng = random.Random(0)
    trees = [random_tree(rng, rng.randint(1, 10), 5) for _ in range(64)]
    tree = pack_trees(trees, d=10)
    g = torch.Generator().manual_seed(1)
    # bias the argmax toward the drafted tokens so that paths go deep
    argmax = torch.where(torch.rand(64, 10, generator=g) < 0.3, torch.randint(0, 5, (64, 10), generator=g), 0)
    nt = tree["retrive_next_token"]
    for b, (parents, tokens) in enumerate(trees):
        for i in range(len(parents)):
            if nt[b, i] >= 0 and rng.random() < 0.7:
                argmax[b, i] = tokens[int(nt[b, i])]
    target = one_hot_rows(64, 10, 5, argmax)
    s = int(tree["depth"].max()) + 1
    greedy = run_greedy(tree, argmax, s)
    sampled = run_sampling(tree, torch.rand(64, 10, generator=g), torch.rand(64, generator=g), target, s=s)
    for key in ("predicts", "accept_index", "accept_token_num"):
        assert torch.equal(greedy[key], sampled[key]), key
    assert greedy["accept_token_num"].max() >= 3


# ----------------------------------------------------------------------------- properties


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**31 - 1),
    bs=st.integers(1, 5),
    d=st.integers(1, 9),
    vocab=st.integers(2, 6),
    t_single=st.sampled_from([1.0, 0.3]),
    t_acc=st.sampled_from([1.0, 0.7]),
)
def test_random_trees_match_naive_model(seed, bs, d, vocab, t_single, t_acc):
    rng = random.Random(seed)
    trees = [random_tree(rng, rng.randint(1, d), vocab) for _ in range(bs)]
    tree = pack_trees(trees, d)
    g = torch.Generator().manual_seed(seed)
    s = int(tree["depth"].max()) + 1 - rng.randint(0, 1) if d > 1 else 1
    s = max(s, 1)
    logits = torch.randn(bs, d, vocab, generator=g) * 2
    logits[torch.rand(bs, d, vocab, generator=g) < 0.3] = -float("inf")
    logits[..., 0] = logits[..., 0].clamp_min(0)  # keep every row non-empty
    target = logits.softmax(-1)
    coins, final = torch.rand(bs, d, generator=g), torch.rand(bs, generator=g)
    out = run_sampling(tree, coins, final, target, s=s, threshold_single=t_single, threshold_acc=t_acc)
    tp = target.argmax(-1)
    gout = run_greedy(tree, tp, s)
    for b in range(bs):
        local = check_path_structure(tree, out, b)
        path, toks, bonus, draft_row = naive_sampling(
            tree, b, s, coins, final, target, torch.zeros_like(target), t_single, t_acc
        )
        assert local == path
        assert int(out["predicts"][b * d + path[-1]]) == bonus
        assert target[b, path[-1], bonus] > 0
        assert torch.equal(out["draft_probs"][b], draft_row)
        glocal = check_path_structure(tree, gout, b)
        gpath, _ = naive_walk(tree, b, s, lambda par, tok, node, st, b=b: tok == int(tp[b, par]))
        assert glocal == gpath
        assert int(gout["predicts"][b * d + gpath[-1]]) == int(tp[b, gpath[-1]])


# ----------------------------------------------------------------------------- invalid inputs


def _valid_sampling_args():
    tree = pack_trees([TREE_A, ([-1, 0], [0, 1])], d=6)
    tree.pop("depth")
    target = torch.full((2, 6, 12), 1 / 12)
    return dict(
        **outputs(2, 6, 4),
        **tree,
        uniform_samples=torch.rand(2, 6),
        uniform_samples_for_final_sampling=torch.rand(2),
        target_probs=target,
        draft_probs=torch.zeros_like(target),
    )


@pytest.mark.parametrize(
    "name,bad,match",
    [
        ("predicts", lambda a: a["predicts"].long(), "predicts"),
        ("predicts", lambda a: a["predicts"][:-1], "predicts"),
        ("accept_index", lambda a: a["accept_index"].long(), "accept_index"),
        ("accept_token_num", lambda a: a["accept_token_num"][:1], "accept_token_num"),
        ("candidates", lambda a: a["candidates"].int(), "candidates"),
        ("retrive_index", lambda a: a["retrive_index"][:, :5], "retrive_index"),
        (
            "retrive_next_token",
            lambda a: a["retrive_next_token"].clone().index_fill_(1, torch.tensor([0]), 6),
            "retrive_next_token",
        ),
        (
            "retrive_next_sibling",
            lambda a: a["retrive_next_sibling"].clone().index_fill_(1, torch.tensor([1]), 9),
            "retrive_next_sibling",
        ),
        ("candidates", lambda a: a["candidates"].clone().index_fill_(1, torch.tensor([1]), 12), "candidates"),
        ("retrive_index", lambda a: a["retrive_index"] + 100, "retrive_index"),
        ("uniform_samples", lambda a: a["uniform_samples"] + 1.5, "uniform_samples"),
        (
            "uniform_samples_for_final_sampling",
            lambda a: a["uniform_samples_for_final_sampling"].double(),
            "uniform_samples_for_final_sampling",
        ),
        ("target_probs", lambda a: a["target_probs"] * 2, "target_probs"),
        ("target_probs", lambda a: a["target_probs"][:, :, :5], "draft_probs|target_probs"),
        ("draft_probs", lambda a: a["draft_probs"] - 1, "draft_probs"),
    ],
)
def test_sampling_invalid_inputs_raise(name, bad, match):
    args = _valid_sampling_args()
    args[name] = bad(args)
    before = args["accept_token_num"].clone()
    with pytest.raises(ValueError, match=match):
        tree_speculative_sampling_target_only(**args)
    if args["accept_token_num"].shape == before.shape:
        assert torch.equal(args["accept_token_num"], before)


def test_greedy_invalid_inputs_raise():
    args = _valid_sampling_args()
    for k in ("uniform_samples", "uniform_samples_for_final_sampling", "target_probs", "draft_probs"):
        args.pop(k)
    with pytest.raises(ValueError, match="target_predict"):
        verify_tree_greedy(**args, target_predict=torch.zeros(2, 6, dtype=torch.int32))
    with pytest.raises(ValueError, match="target_predict"):
        verify_tree_greedy(**args, target_predict=torch.zeros(2, 5, dtype=torch.long))
    cyclic = dict(args, retrive_next_sibling=args["retrive_next_sibling"].clone())
    cyclic["retrive_next_sibling"][0, 2] = 1  # root's children 1 -> 2 -> 1 -> ...; target 0 matches none
    with pytest.raises(ValueError, match="retrive_next_sibling"):
        verify_tree_greedy(**cyclic, target_predict=torch.zeros(2, 6, dtype=torch.long))
    args["retrive_next_token"] = args["retrive_next_token"].clone()
    args["retrive_next_token"][0, 0] = -2
    with pytest.raises(ValueError, match="retrive_next_token"):
        verify_tree_greedy(**args, target_predict=torch.zeros(2, 6, dtype=torch.long))


def test_padding_slots_are_never_read():
    """Garbage in unused slots (negative tokens, wild pointers) does not matter."""
    tree = pack_trees([TREE_A, ([-1, 0], [0, 1])], d=6, pad_garbage=True)
    out = run_greedy(tree, torch.ones(2, 6, dtype=torch.long), s=4)
    assert out["accept_index"][1].tolist() == [6, 7, -1, -1]
