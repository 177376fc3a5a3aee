"""Verification of a batch of draft trees against the target (DDTree, arXiv 2604.12989, Sec. verification).

One target forward gives logits for every tree node (row i = the target's distribution for the token that
follows node i). Walking from the root, a request accepts the child that matches the target's own choice
and stops at the first mismatch; the target's choice there is the bonus token. Greedy requests choose the
argmax; sampled requests draw from ``softmax(logits / T)`` after top-k then top-p renormalisation, with
the sibling walk + residual draw of ``ddtree_serve.kernels.speculative.tree_speculative_sampling_target_only``
(``draft_probs`` zero: the draft tree is deterministic), which is exact sampling from the target.

A batch may mix both: when every request is greedy the argmax kernel ``verify_tree_greedy`` runs; else
the sampling kernel runs for all, greedy rows carrying one-hot argmax distributions (a one-hot child is
accepted by ``p >= threshold_single = 1``, and the residual of a one-hot row is the argmax itself), so
both branches return the same structure and the same greedy tokens. Contracts: docs/DESIGN.md 4.1, 4.2, 4.4.

Coins are exact under both acceptance rules of the sampling kernel (``coin <= acc`` of the pinned AOT
sgl-kernel, ``coin < acc`` of JIT builds; ``ddtree_serve.kernels.speculative.PINNED_COIN_RULE``): greedy rows carry
coin 1 (a one-hot row's non-argmax children keep ``acc = 0``, so only the argmax child is accepted), sampled
tree coins lie in (0, 1] (``1 - U``, U uniform on [0, 1)), where ``u <= acc`` and ``u < acc`` have the
same probability ``acc``. The final (bonus) coin is an inverse-CDF coin and stays in [0, 1): 0 selects
the first positive residual entry, whereas a coin of exactly 1 would fall on the kernel's "no index past
the threshold" fallback; greedy rows use 0.5 there (a one-hot residual returns its argmax for any coin in
(0, 1)). The rule the PyTorch reference applies is ``PINNED_COIN_RULE`` unless the environment variable
``DDTREE_REFERENCE_COIN_RULE`` (``le`` / ``lt``) names another (tests run mixed batches under both); it
never changes what a CUDA kernel does.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ddtree_serve.model_executor.penalties import BatchPenalties, apply_tree_penalties
from ddtree_serve.model_executor.sampler import BatchSamplingInfo, draw_uniforms, processed_probs
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
    dev = target_probs.device
    node = tree.parents >= 0  # [bs, D] non-root used slots
    rows = torch.arange(bs, device=dev)[:, None] * d + tree.parents.clamp(min=0)  # [bs, D] parent rows
    flat = target_probs.reshape(bs * d, -1)  # [bs*D, V]
    p = flat[rows.reshape(-1), tree.candidates.reshape(-1)].reshape(bs, d)  # [bs, D] p_target at the parent
    p = torch.where(node, p.float(), torch.ones_like(p, dtype=torch.float32))  # [bs, D] root / unused: 1
    anc = tree.tree_mask.float()  # [bs, D, D] ancestors and self
    log_path = torch.bmm(anc, p.clamp_min(1e-30).log()[:, :, None])[:, :, 0]  # [bs, D]
    dead = torch.bmm(anc, (p <= 0).float()[:, :, None])[:, :, 0] > 0  # [bs, D] a zero on the path
    reach = torch.where(dead, 0.0, log_path.exp())  # [bs, D]
    used = node | (torch.arange(d, device=dev) == 0)[None, :]  # [bs, D]
    return torch.where(used, reach, 0.0)


def _path_indicator(accept_index: torch.Tensor, num_slots: int) -> torch.Tensor:
    """[bs, D] float32: 1 on the accepted path (root included), from local ``accept_index`` [bs, S]."""
    bs = accept_index.shape[0]
    out = torch.zeros(bs, num_slots + 1, device=accept_index.device)  # [bs, D + 1] (column D: padding)
    out.scatter_(1, torch.where(accept_index >= 0, accept_index, num_slots), 1.0)
    return out[:, :num_slots]


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
    bs, _, vocab = target_logits.shape
    dev = target_logits.device
    greedy = is_greedy.to(device=dev, dtype=torch.bool)  # [bs]
    temp = temperature.to(device=dev, dtype=torch.float32)  # [bs]
    k = top_k.to(device=dev, dtype=torch.int64)  # [bs]
    info = BatchSamplingInfo(
        temperature=torch.where(greedy | (temp <= 0), torch.ones_like(temp), temp),
        top_k=torch.where((k <= 0) | (k > vocab), torch.full_like(k, vocab), k),
        top_p=top_p.to(device=dev, dtype=torch.float32),
        min_p=torch.zeros(bs, device=dev) if min_p is None else min_p.to(device=dev, dtype=torch.float32),
        is_greedy=greedy,
    )
    return processed_probs(target_logits.float(), info).contiguous()


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
    generators: Sequence[torch.Generator | None],
    min_p: torch.Tensor | None = None,
    threshold_single: float = 1.0,
    threshold_acc: float = 1.0,
    penalties: BatchPenalties | None = None,
    want_reach: bool = False,
) -> VerifyResult:
    """Derive accepted nodes and emitted tokens for a batch of trees (DDTree verification, lossless with
    thresholds 1).

    tree: from ``build_ddtree``; target_logits [bs, D, V] float (row i: after node i); temperature,
    top_p [bs] float; top_k [bs] int (<= 0: off); is_greedy [bs] bool; generators: one per request
    (None: torch's default generator), only used by sampled requests. ``penalties``: logit bias and
    repetition / frequency / presence penalties (``ddtree_serve.model_executor.penalties.apply_tree_penalties``: node i
    counts the tokens on its own path root..i), applied before the argmax and the target probabilities.
    ``want_reach``: also return ``node_reach`` (sampled rows: the exact reach probabilities, ``node_reach``;
    greedy rows and thresholds below 1: the realized path, 0 / 1)."""
    from ddtree_serve.kernels import speculative as kspec

    bs, d = tree.candidates.shape
    if target_logits.shape[:2] != (bs, d):
        raise ValueError(f"target_logits {tuple(target_logits.shape)} does not match tree [{bs}, {d}]")
    if len(generators) != bs:
        raise ValueError(f"need {bs} generators, got {len(generators)}")
    dev = target_logits.device
    s = 1 + (int(tree.depths.max()) if tree.depths.numel() else 0)
    predicts = torch.full((bs * d,), -1, dtype=torch.int32, device=dev)  # [bs*D]
    accept_index = torch.full((bs, s), -1, dtype=torch.int32, device=dev)  # [bs, S], global rows
    accept_num = torch.zeros(bs, dtype=torch.int32, device=dev)  # [bs]
    greedy = is_greedy.to(device=dev, dtype=torch.bool)  # [bs]
    logits = apply_tree_penalties(
        target_logits, penalties, tree.candidates, tree.tree_mask, tree.parents >= 0
    )  # [bs, D, V] processed (target_logits itself without penalties)

    if bool(greedy.all()):
        kspec.verify_tree_greedy(
            predicts,
            accept_index,
            accept_num,
            tree.candidates,
            tree.retrive_index,
            tree.retrive_next_token,
            tree.retrive_next_sibling,
            logits.argmax(dim=-1),  # [bs, D] int64
        )
    else:
        target_probs = build_target_probs(logits, temperature, top_k, top_p, greedy, min_p)  # [bs, D, V]
        coins, final_coins = verify_coins(generators, tree.num_nodes, d, greedy, dev)
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
        if not bool(greedy.all()) and threshold_single >= 1.0 and threshold_acc >= 1.0:
            reach = torch.where(greedy[:, None], reach, node_reach(tree, target_probs))  # [bs, D]
    return VerifyResult(
        accept_index=local,
        accept_length=accept_num.long(),
        emitted_tokens=emitted,
        node_reach=reach,
    )
