"""Verification of a batch of draft trees against the target (DDTree, arXiv 2604.12989, Sec. verification).

One target forward gives logits for every tree node (row i = the target's distribution for the token that
follows node i). Every node then gets the token the target itself would emit there, ``y_i``: the argmax
for a greedy request; for a sampled request the inverse-CDF draw ``F_i^-1(u(seed, position + depth_i))``
from the node's processed distribution (temperature, top-k, top-p, min-p after masks and penalties;
``ddtree_serve.model_executor.sampler.draw_tokens``) with the request's position-keyed uniform
(``model_executor/position_uniforms.py``). Walking from the root, a request accepts the child whose token
equals its parent's ``y`` and stops where none does; ``y`` of the last accepted node is the bonus token.
One walk (``verify_tree_greedy``'s) serves greedy and sampled rows of a mixed batch. Along the accepted
path every ``y`` is the token plain decoding draws at that position with the same seed, so the output is
plain decoding's, token for token; a node is accepted with probability the product of its path's target
probabilities, the target-only rule with thresholds 1 (docs/DESIGN.md 4.16).

Relaxed acceptance (``threshold_single`` / ``threshold_acc`` below 1, the lossy mode) keeps sgl-kernel's
coin rule: ``ddtree_serve.kernels.speculative.tree_speculative_sampling_target_only`` with ``draft_probs`` zero
and coins from the request's own generator (``verify_coins``). Its coins are exact under both acceptance rules
of the kernel (``coin <= acc`` of the pinned AOT sgl-kernel, ``coin < acc`` of JIT builds;
``PINNED_COIN_RULE``): greedy rows carry coin 1, sampled tree coins lie in (0, 1] (``1 - U``), the final
(bonus) coin in [0, 1) (greedy rows 0.5). The rule the PyTorch reference applies is ``PINNED_COIN_RULE``
unless ``DDTREE_REFERENCE_COIN_RULE`` (``le`` / ``lt``) names another; it never changes a CUDA kernel.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ddtree_serve.kernels.dispatch import one_kernel
from ddtree_serve.model_executor.penalties import BatchPenalties, apply_tree_penalties
from ddtree_serve.model_executor.position_uniforms import SampleKeys
from ddtree_serve.model_executor.sampler import (
    PROBS_BUDGET_BYTES,
    BatchSamplingInfo,
    draw_tokens,
    draw_uniforms,
    processed_probs,
)
from ddtree_serve.model_executor.sharded_sampling import kept_weights, sharded_argmax
from ddtree_serve.model_executor.vocab_shard import VocabShard
from ddtree_serve.speculative.ddtree import DraftTree


@dataclass
class VerifyResult:
    """Per request, ``accept_length[b] + 1`` valid leading entries in each ``[bs, S]`` field
    (S = 1 + the deepest node of the batch); padding is -1. Logprobs of the emitted tokens are the
    worker's (``commit.attach_logprobs``: raw target logits at ``accept_index``, as plain decoding)."""

    accept_index: torch.Tensor  # [bs, S] int64, local slots: root, then the accepted nodes in path order
    accept_length: torch.Tensor  # [bs] int64, accepted draft nodes (root not counted)
    emitted_tokens: torch.Tensor  # [bs, S] int64, accepted draft tokens then the bonus token
    node_reach: torch.Tensor | None = None  # [bs, D] float32, P(node i on the accepted path) (``node_reach``)


def node_reach(tree: DraftTree, target_probs: torch.Tensor) -> torch.Tensor:
    """[bs, D] float32: the probability that verification accepts node i, given the tree and the target
    distributions, over the coins (root 1, unused slots 0).

    With thresholds 1 and ``draft_probs`` zero the sampling kernel accepts child j of the last accepted
    node with coin u when ``acc_{j-1} < u <= acc_j`` (``acc`` the running sum of the parent row's target
    probabilities in sibling order; ``<`` under the ``lt`` rule, the same measure for a continuous coin), so
    with probability ``p_target(token_j)`` at the parent row, and the coins of successive levels are
    independent: a node is reached with the product of its path's target probabilities. For a one-hot
    (greedy) row that is 1 on the argmax path and 0 elsewhere: the greedy outcome itself. Summed over the
    nodes this is the expected accepted length, the sampled outcome with the coins' noise taken out
    (Rao-Blackwell): what the adaptive budget calibrates against (``ddtree_serve.speculative.budget``).

    tree: D slots per request; target_probs [bs, D, V] (row i: the distribution after node i)."""
    bs, d = tree.candidates.shape
    rows = torch.arange(bs, device=target_probs.device)[:, None] * d + tree.parents.clamp(min=0)  # [bs, D]
    flat = target_probs.reshape(bs * d, -1)  # [bs*D, V]
    p = flat[rows.reshape(-1), tree.candidates.reshape(-1)].reshape(bs, d)  # [bs, D] p_target at the parent
    return reach_from_child_probs(tree, p)


def reach_from_child_probs(tree: DraftTree, p: torch.Tensor) -> torch.Tensor:
    """``node_reach`` from ``p [bs, D]``: each node's token probability under its parent's row."""
    d = tree.candidates.shape[1]
    dev = p.device
    node = tree.parents >= 0  # [bs, D] non-root used slots
    p = torch.where(node, p.float(), torch.ones_like(p, dtype=torch.float32))  # [bs, D] root / unused: 1
    anc = tree.tree_mask.float()  # [bs, D, D] ancestors and self
    log_path = torch.bmm(anc, p.clamp_min(1e-30).log()[:, :, None])[:, :, 0]  # [bs, D]
    dead = torch.bmm(anc, (p <= 0).float()[:, :, None])[:, :, 0] > 0  # [bs, D] a zero on the path
    reach = torch.where(dead, 0.0, log_path.exp())  # [bs, D]
    used = node | (torch.arange(d, device=dev) == 0)[None, :]  # [bs, D]
    return torch.where(used, reach, 0.0)


def child_probs(tree: DraftTree, logits: torch.Tensor, info: BatchSamplingInfo,
                budget_bytes: int = PROBS_BUDGET_BYTES, shard: VocabShard | None = None) -> torch.Tensor:
    """``[bs, D]`` float32: each node's token probability under its parent's processed distribution
    (``logits [bs, D, V]`` after masks and penalties; ``shard``: its columns ``[bs, D, V/tp]``), the sampler's
    integer weights (``sharded_sampling.kept_weights``) over their row's kept mass, in row blocks of at most
    ``budget_bytes``."""
    bs, d, width = logits.shape
    shard = shard if shard is not None else VocabShard.whole(width)
    flat = logits.reshape(bs * d, width)  # [bs*D, V]
    rows = (torch.arange(bs, device=logits.device)[:, None] * d + tree.parents.clamp(min=0)).reshape(-1)  # [bs*D]
    cols, inside = shard.local_ids(tree.candidates.reshape(-1).clamp(min=0))  # [bs*D]
    per_row = info.repeat(d)
    maybe = info.maybe[:3] if info.maybe is not None else (True, True, True)
    out = torch.zeros(bs * d, dtype=torch.float32, device=logits.device)  # [bs*D]
    step = max(1, budget_bytes // (max(width, 1) * 8 * 4))
    for lo in range(0, bs * d, step):
        sl = slice(lo, lo + step)
        par = per_row.take(rows[sl])
        with one_kernel():  # the sampler's fused reductions (a simulated device counts one launch)
            qk, total = kept_weights(flat[rows[sl]], par.temperature, par.top_k, par.top_p, par.min_p, shard, maybe)
        mine = torch.where(inside[sl], qk.gather(1, cols[sl, None])[:, 0], 0)  # [k] the token's weight, if here
        out[sl] = (shard.sum(mine).double() / total.clamp(min=1).double()).float()
    return out.reshape(bs, d)


def _path_indicator(accept_index: torch.Tensor, num_slots: int) -> torch.Tensor:
    """[bs, D] float32: 1 on the accepted path (root included), from local ``accept_index`` [bs, S]."""
    bs = accept_index.shape[0]
    out = torch.zeros(bs, num_slots + 1, device=accept_index.device)  # [bs, D + 1] (column D: padding)
    out.scatter_(1, torch.where(accept_index >= 0, accept_index, num_slots), 1.0)
    return out[:, :num_slots]


def verify_info(
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    is_greedy: torch.Tensor,
    min_p: torch.Tensor | None,
    vocab: int,
    device: torch.device,
    greedy_only: bool | None = None,
    maybe: tuple[bool, bool, bool, bool] | None = None,
) -> BatchSamplingInfo:
    """The sampler's per-request parameters from verification's tensors (``top_k <= 0`` or past the
    vocabulary: off; temperature of greedy rows unused). ``greedy_only``: every row greedy, as the host knows it
    (None: read back when asked); ``maybe``: ``BatchSamplingInfo.maybe`` (which filters any row may use)."""
    greedy = is_greedy.to(device=device, dtype=torch.bool)  # [bs]
    temp = temperature.to(device=device, dtype=torch.float32)  # [bs]
    k = top_k.to(device=device, dtype=torch.int64)  # [bs]
    return BatchSamplingInfo(
        temperature=torch.where(greedy | (temp <= 0), torch.ones_like(temp), temp),
        top_k=torch.where((k <= 0) | (k > vocab), torch.full_like(k, vocab), k),
        top_p=top_p.to(device=device, dtype=torch.float32),
        min_p=torch.zeros(len(greedy), device=device) if min_p is None else min_p.to(device=device,
                                                                                       dtype=torch.float32),
        is_greedy=greedy,
        greedy_only=greedy_only,
        maybe=maybe,
    )


def build_target_probs(
    target_logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    is_greedy: torch.Tensor,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """Target distributions for every tree node, exactly as the non-speculative sampler builds them
    (``ddtree_serve.model_executor.sampler.processed_probs``): softmax(logits / T), then top-k, top-p and min-p
    renormalisation; greedy rows are one-hot at the argmax.

    target_logits [bs, D, V]; temperature/top_p float [bs]; top_k int [bs] (<= 0 disables);
    is_greedy bool [bs]; min_p float [bs] or None. Returns float32 [bs, D, V]."""
    info = verify_info(temperature, top_k, top_p, is_greedy, min_p, target_logits.shape[-1], target_logits.device)
    return processed_probs(target_logits.float(), info).contiguous()


def node_tokens(logits: torch.Tensor, info: BatchSamplingInfo, depths: torch.Tensor, keys: SampleKeys | None,
                shard: VocabShard | None = None) -> torch.Tensor:
    """``y [bs, D]``: the token the target emits after each node: the argmax for greedy rows, else
    ``F^-1(u(seed, position + depth))`` of the node's processed distribution (``draw_tokens``).
    logits [bs, D, V] after masks and penalties (``shard``: its columns); depths [bs, D] (root 0)."""
    bs, d, vocab = logits.shape
    if info.all_greedy:
        flat = logits.reshape(bs * d, vocab)  # [bs*D, V]
        return (sharded_argmax(flat, shard) if shard is not None else flat.argmax(-1)).reshape(bs, d)
    if keys is None:
        raise ValueError("sampled rows need their sample keys (seed and output position) for verification")
    u = keys.uniforms(depths.clamp(min=0).to(keys.seeds.device)).reshape(-1)  # [bs*D] float64
    return draw_tokens(logits.reshape(bs * d, vocab), info.repeat(d), u.to(logits.device), shard=shard).reshape(bs, d)


COIN_RULE_ENV = "DDTREE_REFERENCE_COIN_RULE"
_GREEDY_FINAL_COIN = 0.5


def reference_coin_rule() -> str | None:
    """The acceptance rule the PyTorch reference should apply, from ``DDTREE_REFERENCE_COIN_RULE``
    (``le`` / ``lt``); None (unset) means the kernel module's ``PINNED_COIN_RULE``."""
    rule = os.environ.get(COIN_RULE_ENV, "").strip().lower()
    if rule in ("", "le", "lt"):
        return rule or None
    raise ValueError(f"{COIN_RULE_ENV} must be 'le' or 'lt', got {rule!r}")


def verify_coins(
    generators: Sequence[torch.Generator | None],
    num_nodes: torch.Tensor,
    num_slots: int,
    is_greedy: torch.Tensor,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Coins for the sampling kernel: request b draws ``2 + num_nodes[b]`` uniforms U from its own
    generator (``ddtree_serve.model_executor.sampler.draw_uniforms``): tree coins ``1 - U[:1 + n]`` in (0, 1] (one per
    used slot; unused slots hold 1), final coin ``U[1 + n]`` in [0, 1). Request b's stream depends only on
    its own tree, so a seeded request reproduces across batch compositions. Greedy rows draw nothing:
    coin 1 everywhere, final coin 0.5. Returns (coins [bs, D], final [bs]) float32 on ``device``."""
    greedy = is_greedy.to(device="cpu", dtype=torch.bool)  # [bs]
    n = num_nodes.to(device="cpu", dtype=torch.int64)  # [bs]
    counts = torch.where(greedy, 0, 2 + n)  # [bs]
    u = draw_uniforms(generators, counts.tolist(), num_slots + 1, torch.device("cpu"))  # [bs, D + 1]
    used = torch.arange(num_slots)[None, :] < (1 + n)[:, None]  # [bs, D]
    coins = torch.where(used & ~greedy[:, None], 1.0 - u[:, :num_slots], 1.0)  # [bs, D] in (0, 1]
    final = torch.where(greedy, _GREEDY_FINAL_COIN, u.gather(1, (1 + n).clamp(max=num_slots)[:, None])[:, 0])
    return coins.to(device), final.to(device)


def verify_tree(
    tree: DraftTree,
    target_logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    is_greedy: torch.Tensor,
    keys: SampleKeys | None = None,
    min_p: torch.Tensor | None = None,
    threshold_single: float = 1.0,
    threshold_acc: float = 1.0,
    penalties: BatchPenalties | None = None,
    want_reach: bool = False,
    generators: Sequence[torch.Generator | None] | None = None,
    greedy_only: bool | None = None,
    maybe: tuple[bool, bool, bool, bool] | None = None,
    shard: VocabShard | None = None,
) -> VerifyResult:
    """Derive accepted nodes and emitted tokens for a batch of trees (DDTree verification; with thresholds
    1, sampled rows give plain decoding's tokens for the same seed).

    tree: from ``build_ddtree``; target_logits [bs, D, V] float (row i: after node i); temperature,
    top_p [bs] float; top_k [bs] int (<= 0: off); is_greedy [bs] bool; ``keys``: each request's seed and
    output position (needed when a row samples). ``penalties``: logit bias and repetition / frequency /
    presence penalties (``ddtree_serve.model_executor.penalties.apply_tree_penalties``: node i counts the tokens
    on its own path root..i), applied before the tokens are drawn. Thresholds below 1 (relaxed, lossy):
    sgl-kernel's coin rule with ``generators`` (one per request; None: torch's default generator).
    ``want_reach``: also return ``node_reach`` (sampled rows with thresholds 1: the exact reach probabilities;
    greedy rows and relaxed acceptance: the realized path, 0 / 1). ``shard``: the logits are this rank's
    vocabulary columns ``[bs, D, V/tp]`` (vocabulary-parallel TP; relaxed acceptance gathers them)."""
    from ddtree_serve.kernels import speculative as kspec

    bs, d = tree.candidates.shape
    if target_logits.shape[:2] != (bs, d):
        raise ValueError(f"target_logits {tuple(target_logits.shape)} does not match tree [{bs}, {d}]")
    dev = target_logits.device
    s = 1 + (tree.max_depth if tree.max_depth is not None else int(tree.depths.max()) if tree.depths.numel() else 0)
    predicts = torch.full((bs * d,), -1, dtype=torch.int32, device=dev)  # [bs*D]
    accept_index = torch.full((bs, s), -1, dtype=torch.int32, device=dev)  # [bs, S], global rows
    accept_num = torch.zeros(bs, dtype=torch.int32, device=dev)  # [bs]
    shard = shard if shard is not None else VocabShard.whole(target_logits.shape[-1])
    info = verify_info(temperature, top_k, top_p, is_greedy, min_p, shard.vocab, dev, greedy_only, maybe)
    logits = apply_tree_penalties(
        target_logits, penalties, tree.candidates, tree.tree_mask, tree.parents >= 0, shard
    )  # [bs, D, V] processed (target_logits itself without penalties)
    lossless = threshold_single >= 1.0 and threshold_acc >= 1.0

    if lossless or info.all_greedy:
        y = node_tokens(logits, info, tree.depths, keys, shard)  # [bs, D]
        kspec.verify_tree_greedy(predicts, accept_index, accept_num, tree.candidates, tree.retrive_index,
                                 tree.retrive_next_token, tree.retrive_next_sibling, y)
    else:
        if generators is None or len(generators) != bs:
            raise ValueError(f"relaxed acceptance needs {bs} generators")
        target_probs = build_target_probs(shard.full_rows(logits), temperature, top_k, top_p, info.is_greedy,
                                          min_p)  # [bs, D, V] (the lossy mode gathers its rows)
        coins, final_coins = verify_coins(generators, tree.num_nodes, d, info.is_greedy, dev)
        kspec.tree_speculative_sampling_target_only(
            predicts,
            accept_index,
            accept_num,
            tree.candidates,
            tree.retrive_index,
            tree.retrive_next_token,
            tree.retrive_next_sibling,
            coins,
            final_coins,
            target_probs,
            torch.zeros_like(target_probs),  # draft_probs [bs, D, V]
            threshold_single=threshold_single,
            threshold_acc=threshold_acc,
            deterministic=True,
            coin_rule=reference_coin_rule(),
        )

    glob = accept_index.long()  # [bs, S]
    valid = glob >= 0  # [bs, S]
    base = (torch.arange(bs, device=dev) * d).view(bs, 1)  # [bs, 1]
    local = torch.where(valid, glob - base, -1)  # [bs, S]
    emitted = torch.where(valid, predicts.long()[glob.clamp(min=0)], -1)  # [bs, S]
    reach = None
    if want_reach:
        reach = _path_indicator(local, d)  # [bs, D]
        if not info.all_greedy and lossless:
            expected = reach_from_child_probs(tree, child_probs(tree, logits, info, shard=shard))  # [bs, D]
            reach = torch.where(info.is_greedy[:, None], reach, expected)  # [bs, D]
    return VerifyResult(
        accept_index=local,
        accept_length=accept_num.long(),
        emitted_tokens=emitted,
        node_reach=reach,
    )
