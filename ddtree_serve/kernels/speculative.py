"""Tree verification kernels (docs/DESIGN.md 4.1, 4.2): sgl-kernel's names, argument order, dtypes and outputs.

Tree encoding per request ``b`` (``D = 1 + num_nodes`` slots, local index 0 = root): ``candidates[b, i]``
token of node i; ``retrive_index[b, i]`` its global row ``b * D + i``; ``retrive_next_token[b, i]`` first
child or -1; ``retrive_next_sibling[b, i]`` next sibling or -1. Only nodes reachable from the root are
read, so padding slots may hold anything.

Outputs are written in place: ``predicts`` int32 ``[bs*D]`` (at the global row of every accepted parent:
the accepted child's token; at the last accepted node's row: the bonus token; other rows untouched),
``accept_index`` int32 ``[bs, S]`` (global rows of the accepted path, root first, -1 after it; S = max
depth + 1) and ``accept_token_num`` int32 ``[bs]`` (accepted drafts, root not counted).

The reference is vectorised over the batch (Python loops run over depth and sibling steps only). On CUDA
tensors with sgl-kernel importable (``ddtree_serve.kernels.dispatch.use_cuda_kernels``) sgl-kernel's kernels run
instead.

Acceptance rule of the sampling kernel (``coin_rule``): a child of target probability ``p`` is accepted iff
``coin <= acc / threshold_acc or p >= threshold_single`` (``"le"``) or ``coin < acc / threshold_acc or
p >= threshold_single`` (``"lt"``), with NO ``p > 0`` test in either. ``"le"`` is the AOT sgl-kernel
rule: sgl-project/sglang ``sgl-kernel/csrc/speculative/speculative_sampling.cuh``, kernel
``TreeSpeculativeSamplingTargetOnly``, read at commits 120affb9613cc3f5bcd055ec09c7621d3ced0ebc and
b227f63247cdaf7fcbc4cfec8c3379120276ec82 (every stored version of that file uses ``<=``); our pin
``sglang-kernel==0.4.6.post1`` builds that file. ``"lt"`` is the rule of newer JIT builds.
``PINNED_COIN_RULE`` is the pinned release's rule and the reference's default; the CUDA path always runs
the installed kernel's own rule. Under both rules a coin of exactly 0 differs: ``"le"`` accepts the first
child even when ``p = 0``, so callers must draw coins in (0, 1] (then both rules accept with the same
probability) and give greedy rows coin 1 (docs/DEPLOY.md, "Verification kernel rule").
"""

from __future__ import annotations

import inspect
from typing import Final, Literal

import torch

from ddtree_serve.kernels.dispatch import SGL_KERNEL, import_cuda_library, one_kernel, use_cuda_kernels
from ddtree_serve.kernels.sampling import inverse_cdf_sample

_SIMPLEX_ATOL = 1e-3  # |row sum - 1| allowed for target probability rows that the walk reads
_NEG_ATOL = 1e-6  # entries above -_NEG_ATOL count as non-negative

CoinRule = Literal["le", "lt"]
PINNED_COIN_RULE: Final[CoinRule] = "le"  # sglang-kernel==0.4.6.post1 (AOT): ``coin <= acc / threshold_acc``


def _expect(t: object, name: str, dtype: torch.dtype, shape: tuple[int, ...], device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor")
    if t.dtype != dtype:
        raise ValueError(f"{name} must have dtype {dtype}, got {t.dtype}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} must be on {device}, got {t.device}")


def _validate_tree(
    predicts: torch.Tensor,
    accept_index: torch.Tensor,
    accept_token_num: torch.Tensor,
    candidates: torch.Tensor,
    retrive_index: torch.Tensor,
    retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor,
) -> tuple[int, int, int]:
    """Check dtypes/shapes/devices shared by both kernels; return (bs, D, S)."""
    if not isinstance(candidates, torch.Tensor) or candidates.dim() != 2:
        raise ValueError("candidates must be a 2-D int64 tensor [bs, D]")
    bs, d = candidates.shape
    dev = candidates.device
    if d < 1:
        raise ValueError("candidates must have at least the root slot (D >= 1)")
    _expect(candidates, "candidates", torch.int64, (bs, d), dev)
    for name, t in (
        ("retrive_index", retrive_index),
        ("retrive_next_token", retrive_next_token),
        ("retrive_next_sibling", retrive_next_sibling),
    ):
        _expect(t, name, torch.int64, (bs, d), dev)
    _expect(predicts, "predicts", torch.int32, (bs * d,), dev)
    if not isinstance(accept_index, torch.Tensor) or accept_index.dim() != 2 or accept_index.shape[1] < 1:
        raise ValueError("accept_index must be a 2-D int32 tensor [bs, S] with S >= 1")
    s = accept_index.shape[1]
    _expect(accept_index, "accept_index", torch.int32, (bs, s), dev)
    _expect(accept_token_num, "accept_token_num", torch.int32, (bs,), dev)
    return bs, d, s


def _check_range(name: str, values: torch.Tensor, mask: torch.Tensor, lo: int, hi: int) -> None:
    """Raise ValueError if any ``values[mask]`` lies outside ``[lo, hi)``."""
    if bool((mask & ((values < lo) | (values >= hi))).any()):
        raise ValueError(f"{name} holds an out-of-range value [{lo}, {hi}) at a reachable node")


class _Walk:
    """Shared state of the root-to-leaf walk for a batch; one instance per kernel call."""

    def __init__(self, candidates, retrive_index, retrive_next_token, retrive_next_sibling, s: int):
        self.bs, self.d = candidates.shape
        self.s = s
        self.cand, self.ridx = candidates, retrive_index
        self.next_tok, self.next_sib = retrive_next_token, retrive_next_sibling
        dev = candidates.device
        self.ar = torch.arange(self.bs, device=dev)  # [bs]
        self.last_local = torch.zeros(self.bs, dtype=torch.int64, device=dev)  # [bs]
        self.last_global = retrive_index[:, 0].clone()  # [bs]
        all_rows = torch.ones(self.bs, dtype=torch.bool, device=dev)
        _check_range("retrive_index", self.last_global, all_rows, 0, self.bs * self.d)
        self.path_local = torch.full((self.bs, s), -1, dtype=torch.int64, device=dev)  # [bs, S]
        self.path_local[:, 0] = 0
        self.path_global = torch.full((self.bs, s), -1, dtype=torch.int64, device=dev)  # [bs, S]
        self.path_global[:, 0] = self.last_global
        self.num = torch.zeros(self.bs, dtype=torch.int64, device=dev)  # [bs]
        self.alive = all_rows.clone()  # [bs] the walk continues below the last accepted node
        self.pred_rows: list[torch.Tensor] = []
        self.pred_toks: list[torch.Tensor] = []

    def first_children(self) -> torch.Tensor:
        """Local index of the first child of each alive request's last accepted node, else -1. [bs]"""
        child = self.next_tok[self.ar, self.last_local]  # [bs]
        _check_range("retrive_next_token", child, self.alive, -1, self.d)
        return torch.where(self.alive, child, torch.full_like(child, -1))

    def next_sibling(self, cur: torch.Tensor, searching: torch.Tensor) -> torch.Tensor:
        nxt = self.next_sib[self.ar, cur.clamp(min=0)]  # [bs]
        _check_range("retrive_next_sibling", nxt, searching, -1, self.d)
        return nxt

    def token(self, cur: torch.Tensor, searching: torch.Tensor, vocab: int | None) -> torch.Tensor:
        tok = self.cand[self.ar, cur.clamp(min=0)]  # [bs]
        _check_range("candidates", tok, searching, 0, vocab if vocab is not None else 2**62)
        return tok

    def accept(self, depth: int, chosen: torch.Tensor) -> torch.Tensor:
        """Record accepted children ``chosen`` (local, -1 = none) at ``depth``; return the accepted mask."""
        acc = chosen >= 0  # [bs]
        c = chosen.clamp(min=0)
        glob = self.ridx[self.ar, c]  # [bs]
        _check_range("retrive_index", glob, acc, 0, self.bs * self.d)
        self.pred_rows.append(self.last_global[acc])
        self.pred_toks.append(self.cand[self.ar, c][acc])
        self.path_local[:, depth] = torch.where(acc, chosen, self.path_local[:, depth])
        self.path_global[:, depth] = torch.where(acc, glob, self.path_global[:, depth])
        self.num += acc.to(torch.int64)
        self.last_local = torch.where(acc, chosen, self.last_local)
        self.last_global = torch.where(acc, glob, self.last_global)
        self.alive = acc
        return acc

    def write(self, predicts, accept_index, accept_token_num, bonus: torch.Tensor) -> None:
        """Write all outputs in place (called only after every check passed)."""
        rows = torch.cat([*self.pred_rows, self.last_global])
        toks = torch.cat([*self.pred_toks, bonus])
        predicts[rows] = toks.to(torch.int32)
        accept_index.copy_(self.path_global.to(torch.int32))
        accept_token_num.copy_(self.num.to(torch.int32))


def _sibling_steps_guard(d: int):
    """Range over sibling steps at one depth; more than D steps means a sibling cycle."""
    yield from range(d + 1)
    raise ValueError("retrive_next_sibling contains a cycle (more than D siblings at one level)")


def verify_tree_greedy(
    predicts: torch.Tensor,
    accept_index: torch.Tensor,
    accept_token_num: torch.Tensor,
    candidates: torch.Tensor,
    retrive_index: torch.Tensor,
    retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor,
    target_predict: torch.Tensor,
) -> None:
    """Greedy tree verification (in place). ``target_predict`` int64 ``[bs, D]``: the target's argmax at
    every node. From the root, at each level accept the first child (sibling order) whose token equals
    ``target_predict`` at the parent's global row; stop when none matches or depth S-1 is reached. The
    bonus written at the last accepted node's row is ``target_predict`` there. Raises ValueError on bad
    dtypes, shapes, devices or out-of-range indices at reachable nodes (outputs then untouched).
    """
    bs, d, s = _validate_tree(
        predicts,
        accept_index,
        accept_token_num,
        candidates,
        retrive_index,
        retrive_next_token,
        retrive_next_sibling,
    )
    _expect(target_predict, "target_predict", torch.int64, (bs, d), candidates.device)
    if use_cuda_kernels(predicts, candidates, target_predict):
        accept_index.fill_(-1)
        import_cuda_library(SGL_KERNEL).verify_tree_greedy(
            predicts,
            accept_index,
            accept_token_num,
            candidates,
            retrive_index,
            retrive_next_token,
            retrive_next_sibling,
            target_predict,
        )
        return
    with one_kernel():  # the reference of sgl-kernel's one launch (a simulated device counts it so)
        w = _Walk(candidates, retrive_index, retrive_next_token, retrive_next_sibling, s)
        flat_target = target_predict.reshape(-1)  # [bs*D]
        for depth in range(1, s):
            cur = w.first_children()  # [bs]
            want = flat_target[w.last_global]  # [bs]
            chosen = torch.full_like(cur, -1)  # [bs]
            searching = cur >= 0  # [bs]
            for _ in _sibling_steps_guard(d):
                if not bool(searching.any()):
                    break
                ok = searching & (w.token(cur, searching, None) == want)  # [bs]
                chosen = torch.where(ok, cur, chosen)
                rejected = searching & ~ok
                nxt = w.next_sibling(cur, rejected)
                cur = torch.where(rejected, nxt, cur)
                searching = rejected & (nxt >= 0)
            if not bool(w.accept(depth, chosen).any()):
                break
        w.write(predicts, accept_index, accept_token_num, flat_target[w.last_global])


# sgl-kernel's TreeSpeculativeSamplingTargetOnly addresses target/draft probabilities with a uint32 row
# offset (``bx * num_draft_tokens * d``): a call must keep rows x D x V below 2^32. We cap at 2^31 so a
# build that uses signed 32-bit offsets is safe too (e.g. 163,840 vocab x D 256: 51 requests per call).
SGL_SAMPLING_MAX_ELEMENTS = 2**31
_PER_REQUEST = ("accept_index", "accept_token_num", "candidates", "retrive_index", "retrive_next_token",
                "retrive_next_sibling", "uniform_samples", "uniform_samples_for_final_sampling",
                "target_probs", "draft_probs")


def sgl_sampling_chunks(bs: int, d: int, vocab: int, max_elements: int = SGL_SAMPLING_MAX_ELEMENTS):
    """Request ranges ``[lo, hi)`` per kernel call, each with ``(hi - lo) * d * vocab <= max_elements``."""
    per_call = max_elements // (d * vocab)
    if per_call < 1:
        raise ValueError(f"one request's D x V = {d} x {vocab} exceeds the kernel's {max_elements} elements")
    return [(lo, min(lo + per_call, bs)) for lo in range(0, bs, per_call)]


def _call_sgl_sampling(kwargs: dict, kernel=None, max_elements: int = SGL_SAMPLING_MAX_ELEMENTS) -> None:
    """Run sgl-kernel's sampled verification over request chunks (``sgl_sampling_chunks``). Each call
    gets row slices (contiguous views) of the per-request tensors and the whole ``predicts``:
    ``retrive_index`` holds global rows ``b * D + i``, which the kernel writes to ``predicts`` and
    ``accept_index`` as given. ``kernel`` defaults to sgl-kernel's function (tests pass a stand-in)."""
    fn = kernel or import_cuda_library(SGL_KERNEL).tree_speculative_sampling_target_only
    params = inspect.signature(fn).parameters
    bs, d, vocab = kwargs["target_probs"].shape
    for lo, hi in sgl_sampling_chunks(bs, d, vocab, max_elements):
        part = {k: (v[lo:hi] if k in _PER_REQUEST else v) for k, v in kwargs.items() if k in params}
        fn(**part)  # newer sgl-kernel dropped draft_probs


def tree_speculative_sampling_target_only(
    predicts: torch.Tensor,
    accept_index: torch.Tensor,
    accept_token_num: torch.Tensor,
    candidates: torch.Tensor,
    retrive_index: torch.Tensor,
    retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor,
    uniform_samples: torch.Tensor,
    uniform_samples_for_final_sampling: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    threshold_single: float = 1.0,
    threshold_acc: float = 1.0,
    deterministic: bool = True,
    *,
    coin_rule: CoinRule | None = None,
) -> None:
    """Sampled tree verification (in place), exact for thresholds 1 and zero ``draft_probs``.

    ``uniform_samples`` f32 ``[bs, D]`` (one coin per node), ``uniform_samples_for_final_sampling`` f32
    ``[bs]``, ``target_probs`` / ``draft_probs`` f32 ``[bs, D, V]`` (row = the node whose successor is
    distributed). At each level, with the parent's coin ``u`` and ``acc`` the running sum of the parent
    row's target probabilities of the siblings tried so far (sibling order), a child with target
    probability ``p`` is accepted iff ``u <= acc / threshold_acc or p >= threshold_single`` (``coin_rule``
    ``"le"``, the default ``PINNED_COIN_RULE``) or ``u < acc / threshold_acc or p >= threshold_single``
    (``"lt"``), with ``acc`` summed in float32 in sibling order as the kernel does; the coin then becomes
    the accepted node's own coin. ``coin_rule`` applies to the reference only: the CUDA path runs the
    installed sgl-kernel's own rule. A rejected sibling's ``p`` is copied into
    ``draft_probs`` at the parent row (in place). The walk stops when no child is accepted or at depth
    S-1. Bonus: inverse-CDF draw with the final coin from ``relu(target - draft)`` at the last accepted
    row (draft taken as 0 when depth S-1 was reached). ``deterministic`` only matters for sgl-kernel.

    Raises ValueError on bad dtypes/shapes/devices, out-of-range indices or tokens at reachable nodes,
    coins outside [0, 1], or target rows read by the walk that are not distributions (tolerance
    ``1e-3`` on the sum). Outputs are untouched when it raises.
    """
    bs, d, s = _validate_tree(
        predicts,
        accept_index,
        accept_token_num,
        candidates,
        retrive_index,
        retrive_next_token,
        retrive_next_sibling,
    )
    dev = candidates.device
    if not isinstance(target_probs, torch.Tensor) or target_probs.dim() != 3:
        raise ValueError("target_probs must be a 3-D float32 tensor [bs, D, V]")
    vocab = target_probs.shape[2]
    _expect(target_probs, "target_probs", torch.float32, (bs, d, vocab), dev)
    _expect(draft_probs, "draft_probs", torch.float32, (bs, d, vocab), dev)
    _expect(uniform_samples, "uniform_samples", torch.float32, (bs, d), dev)
    _expect(
        uniform_samples_for_final_sampling, "uniform_samples_for_final_sampling", torch.float32, (bs,), dev
    )
    for name, u in (
        ("uniform_samples", uniform_samples),
        ("uniform_samples_for_final_sampling", uniform_samples_for_final_sampling),
    ):
        if bool(((u < 0) | (u > 1) | torch.isnan(u)).any()):
            raise ValueError(f"{name} must lie in [0, 1]")
    rule = PINNED_COIN_RULE if coin_rule is None else coin_rule
    if rule not in ("le", "lt"):
        raise ValueError(f"coin_rule must be 'le' or 'lt', got {coin_rule!r}")
    thr_single, thr_acc = float(threshold_single), max(float(threshold_acc), 1e-9)
    if use_cuda_kernels(predicts, candidates, target_probs, draft_probs):
        accept_index.fill_(-1)
        _call_sgl_sampling(
            dict(
                predicts=predicts,
                accept_index=accept_index,
                accept_token_num=accept_token_num,
                candidates=candidates,
                retrive_index=retrive_index,
                retrive_next_token=retrive_next_token,
                retrive_next_sibling=retrive_next_sibling,
                uniform_samples=uniform_samples,
                uniform_samples_for_final_sampling=uniform_samples_for_final_sampling,
                target_probs=target_probs,
                draft_probs=draft_probs,
                threshold_single=thr_single,
                threshold_acc=float(threshold_acc),
                deterministic=deterministic,
            )
        )
        return
    with one_kernel():  # the reference of sgl-kernel's one launch (a simulated device counts it so)
        w = _Walk(candidates, retrive_index, retrive_next_token, retrive_next_sibling, s)
        coin = uniform_samples[:, 0].clone()  # [bs]
        rej_b, rej_parent, rej_tok, rej_p = [], [], [], []
        for depth in range(1, s):
            cur = w.first_children()  # [bs]
            chosen = torch.full_like(cur, -1)  # [bs]
            prob_acc = torch.zeros_like(coin)  # [bs]
            searching = cur >= 0  # [bs]
            for _ in _sibling_steps_guard(d):
                if not bool(searching.any()):
                    break
                tok = w.token(cur, searching, vocab)  # [bs]
                p = target_probs[w.ar, w.last_local, tok.clamp(0, vocab - 1)]  # [bs]
                prob_acc = torch.where(searching, prob_acc + p, prob_acc)
                scaled = prob_acc / thr_acc  # [bs]
                coin_ok = coin <= scaled if rule == "le" else coin < scaled  # [bs]
                ok = searching & (coin_ok | (p >= thr_single))  # [bs]
                chosen = torch.where(ok, cur, chosen)
                rejected = searching & ~ok
                rej_b.append(w.ar[rejected])
                rej_parent.append(w.last_local[rejected])
                rej_tok.append(tok[rejected])
                rej_p.append(p[rejected])
                nxt = w.next_sibling(cur, rejected)
                cur = torch.where(rejected, nxt, cur)
                searching = rejected & (nxt >= 0)
            acc = w.accept(depth, chosen)
            coin = torch.where(acc, uniform_samples[w.ar, chosen.clamp(min=0)], coin)
            if not bool(acc.any()):
                break
        # Every target row the walk read is on the accepted path: check those are distributions.
        b_on, depth_on = (w.path_local >= 0).nonzero(as_tuple=True)  # [P], P = sum(accepted + 1)
        rows = target_probs[b_on, w.path_local[b_on, depth_on]]  # [P, V]
        sums = rows.sum(dim=-1)  # [P]
        bad = ((sums - 1).abs() > _SIMPLEX_ATOL) | (rows.amin(dim=-1) < -_NEG_ATOL) | sums.isnan()  # [P]
        if bool(bad.any()):
            raise ValueError("target_probs rows on the verified path must be probability distributions")
        last_draft = draft_probs[w.ar, w.last_local]  # [bs, V]
        if bool((last_draft < -_NEG_ATOL).any()) or not bool(torch.isfinite(last_draft).all()):
            raise ValueError("draft_probs must be finite and non-negative")
        if rej_b:
            draft_probs[torch.cat(rej_b), torch.cat(rej_parent), torch.cat(rej_tok)] = torch.cat(rej_p)
        full_depth = (w.num == s - 1)[:, None]  # [bs, 1] no draft probs for a bonus below the deepest level
        last_draft = torch.where(full_depth, 0.0, draft_probs[w.ar, w.last_local])  # [bs, V]
        residual = (target_probs[w.ar, w.last_local] - last_draft).clamp_min(0)  # [bs, V]
        bonus = inverse_cdf_sample(residual, uniform_samples_for_final_sampling)  # [bs]
        w.write(predicts, accept_index, accept_token_num, bonus)
