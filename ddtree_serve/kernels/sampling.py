"""Probability filters and inverse-CDF sampling with flashinfer's names and semantics.

All functions take row-stochastic ``probs`` ``[n, V]`` (float) and per-row parameters given either as a
Python scalar (same value for every row) or as a tensor ``[n]``. Filters return a new tensor; the input is
never modified. Kept entries are renormalised to sum to 1; a row whose parameter disables the filter
(``top_k <= 0`` or ``top_k >= V``; ``top_p >= 1``; ``min_p <= 0``) is returned bit-for-bit unchanged.

CUDA path: ``flashinfer.sampling.top_k_renorm_probs`` / ``top_p_renorm_probs`` when the tensors are on
CUDA and flashinfer imports (see ``ddtree_serve.kernels.dispatch``), always with ``is_deterministic=True``: by
default flashinfer's top-p accumulates its radix histogram with float atomics and its multi-block top-k
sums partial masses with atomics, so two TP ranks (or a seeded replay) could keep different boundary
tokens. A flashinfer without that argument is not used (the reference runs instead, which is
deterministic). Everything else is the vectorised PyTorch reference below (which also runs on CUDA). ``sampling_from_probs`` always uses the reference,
because flashinfer draws its own random numbers while this contract takes explicit uniforms.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch

from ddtree_serve.kernels.dispatch import (
    FLASHINFER,
    CudaKernelUnavailable,
    cuda_kernels_required,
    import_cuda_library,
    one_kernel,
    use_cuda_kernels,
)

_FI_SAMPLING = FLASHINFER + ".sampling"
_FI_TOP_K = ("top_k_renorm_probs", "top_k_renorm_prob")
_FI_TOP_P = ("top_p_renorm_probs", "top_p_renorm_prob")
# Top-p first tries a partial top-k of these sizes before falling back to a full sort of the row.
_TOP_P_PARTIAL_KS = (256, 4096)


def _flashinfer_filter(probs: torch.Tensor, names: tuple[str, ...]) -> Callable | None:
    """The flashinfer filter to run on ``probs`` (None: the reference runs). Under
    ``DDTREE_REQUIRE_CUDA_KERNELS=1`` a flashinfer without a deterministic mode is an error."""
    if not use_cuda_kernels(probs, library=_FI_SAMPLING):
        return None
    fn = deterministic_flashinfer_filter(names)
    if fn is None and cuda_kernels_required():
        raise CudaKernelUnavailable(f"flashinfer.sampling.{names[0]} has no is_deterministic argument")
    return fn


def deterministic_flashinfer_filter(names: tuple[str, ...]) -> Callable | None:
    """The first of ``flashinfer.sampling.<names>`` that accepts ``is_deterministic``, else None."""
    fi = import_cuda_library(_FI_SAMPLING)
    for name in names:
        fn = getattr(fi, name, None)
        if fn is None:
            continue
        try:
            params = inspect.signature(fn).parameters
        except (TypeError, ValueError):
            continue
        if "is_deterministic" in params:
            return fn
    return None


def _check_probs(probs: torch.Tensor, name: str = "probs") -> None:
    if not isinstance(probs, torch.Tensor) or probs.dim() != 2:
        raise ValueError(f"{name} must be a 2-D tensor [n, V]")
    if not probs.is_floating_point():
        raise ValueError(f"{name} must be a floating tensor, got {probs.dtype}")
    if probs.shape[1] == 0:
        raise ValueError(f"{name} must have a non-empty vocabulary dimension")


def _row_param(
    value: torch.Tensor | float | int, probs: torch.Tensor, dtype: torch.dtype, name: str, validate: bool = True
) -> torch.Tensor:
    """Broadcast a scalar or ``[n]`` tensor parameter to ``[n]`` on probs' device; ``validate``: refuse NaN (a
    read back; callers whose values were checked on the host skip it)."""
    n = probs.shape[0]
    if isinstance(value, torch.Tensor):
        if value.dim() == 0:
            value = value.reshape(1).expand(n)
        if value.dim() != 1 or value.shape[0] != n:
            raise ValueError(f"{name} must be a scalar or a tensor of shape [{n}], got {tuple(value.shape)}")
        out = value.to(device=probs.device, dtype=dtype)
    else:
        out = torch.full((n,), value, dtype=dtype, device=probs.device)
    if validate and dtype.is_floating_point and bool(torch.isnan(out).any()):
        raise ValueError(f"{name} contains NaN")
    return out


def _renorm(probs: torch.Tensor, keep: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
    """Zero ``~keep``, renormalise rows; rows with ``~active`` are returned unchanged."""
    kept = torch.where(keep, probs, torch.zeros_like(probs))  # [n, V]
    total = kept.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(probs.dtype).tiny)  # [n, 1]
    return torch.where(active[:, None], kept / total, probs)


def top_k_renorm_prob(probs: torch.Tensor, top_k: torch.Tensor | int, maybe_active: bool | None = None
                      ) -> torch.Tensor:
    """Keep, per row, every probability ``>=`` the row's k-th largest value (ties at the k-th value are
    kept, so more than k entries may survive), zero the rest, renormalise.

    probs ``[n, V]``; top_k int or int tensor ``[n]``. ``top_k <= 0`` or ``>= V`` leaves the row unchanged.
    ``maybe_active``: whether any row may filter, as the caller knows it (no read back; values taken as
    checked); None: read it back.
    """
    _check_probs(probs)
    vocab = probs.shape[1]
    k = _row_param(top_k, probs, torch.int64, "top_k", validate=maybe_active is None)  # [n]
    active = (k > 0) & (k < vocab)  # [n]
    if probs.shape[0] == 0 or not (bool(active.any()) if maybe_active is None else maybe_active):
        return probs.clone()
    fn = _flashinfer_filter(probs, _FI_TOP_K)
    if fn:
        kk = torch.where(active, k, torch.full_like(k, vocab)).to(torch.int32)
        out = fn(probs.float(), kk, is_deterministic=True)
        return torch.where(active[:, None], out.to(probs.dtype), probs)
    with one_kernel():  # the reference of flashinfer's one launch (a simulated device counts it so)
        k_max = int(torch.where(active, k, 1).max())
        top_vals = torch.topk(probs, k_max, dim=-1, sorted=True).values  # [n, k_max]
        kth = top_vals.gather(1, (k.clamp(1, k_max) - 1)[:, None])  # [n, 1]
        return _renorm(probs, probs >= kth, active)


def _top_p_threshold(rows: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of ``rows [m, V]``: the value ending the shortest descending prefix whose mass reaches ``p``.

    Tries partial top-k of growing size before a full sort. Returns (threshold [m], found [m])."""
    vocab = rows.shape[1]
    thr = torch.zeros(rows.shape[0], dtype=rows.dtype, device=rows.device)  # [m]
    found = torch.zeros(rows.shape[0], dtype=torch.bool, device=rows.device)  # [m]
    for k in (*[k for k in _TOP_P_PARTIAL_KS if k < vocab], vocab):
        todo = ~found  # [m]
        if not bool(todo.any()):
            break
        sub = rows[todo]  # [r, V]
        vals = (
            torch.topk(sub, k, dim=-1, sorted=True).values
            if k < vocab
            else sub.sort(dim=-1, descending=True).values
        )
        cum = vals.cumsum(dim=-1)  # [r, k]
        p_sub = p[todo]  # [r]
        # Entries needed: those whose preceding (strictly earlier) mass is still below p.
        n_keep = ((cum - vals) < p_sub[:, None]).sum(dim=-1).clamp(1, k)  # [r]
        ok = (cum[:, -1] >= p_sub) | (k == vocab)  # [r] the prefix ends inside the first k entries
        t = vals.gather(1, (n_keep - 1)[:, None])[:, 0]  # [r]
        idx = todo.nonzero()[:, 0]  # [r]
        thr[idx[ok]] = t[ok]
        found[idx[ok]] = True
    return thr, found


def top_p_renorm_prob(probs: torch.Tensor, top_p: torch.Tensor | float, maybe_active: bool | None = None
                      ) -> torch.Tensor:
    """Nucleus filter: keep the probabilities ``>= t`` where ``t`` is the largest threshold whose kept
    mass reaches ``top_p`` (the shortest descending prefix with mass ``>= top_p``, extended by ties),
    zero the rest, renormalise. probs ``[n, V]``; top_p float or ``[n]``; ``top_p >= 1`` leaves the row
    unchanged; ``top_p <= 0`` keeps only the maximum (and its ties). ``maybe_active``: as ``top_k_renorm_prob``."""
    _check_probs(probs)
    p = _row_param(top_p, probs, torch.float32, "top_p", validate=maybe_active is None)  # [n]
    active = p < 1.0  # [n]
    if probs.shape[0] == 0 or not (bool(active.any()) if maybe_active is None else maybe_active):
        return probs.clone()
    fn = _flashinfer_filter(probs, _FI_TOP_P)
    if fn:
        out = fn(probs.float(), torch.where(active, p, torch.ones_like(p)), is_deterministic=True)
        return torch.where(active[:, None], out.to(probs.dtype), probs)
    with one_kernel():  # the reference of flashinfer's one launch (a simulated device counts it so)
        thr = torch.zeros(probs.shape[0], dtype=probs.dtype, device=probs.device)  # [n]
        act_idx = active.nonzero()[:, 0]  # [a]
        thr[act_idx] = _top_p_threshold(probs[act_idx], p[act_idx].to(probs.dtype))[0]
        return _renorm(probs, probs >= thr[:, None], active)


def min_p_renorm_prob(probs: torch.Tensor, min_p: torch.Tensor | float, maybe_active: bool | None = None
                      ) -> torch.Tensor:
    """Keep probabilities ``>= min_p * max(row)``, zero the rest, renormalise. ``min_p <= 0`` leaves the
    row unchanged. probs ``[n, V]``; min_p float or ``[n]``. ``maybe_active``: as ``top_k_renorm_prob``."""
    _check_probs(probs)
    mp = _row_param(min_p, probs, probs.dtype, "min_p", validate=maybe_active is None)  # [n]
    active = mp > 0  # [n]
    if probs.shape[0] == 0 or not (bool(active.any()) if maybe_active is None else maybe_active):
        return probs.clone()
    pivot = probs.max(dim=-1).values * mp  # [n]
    return _renorm(probs, probs >= pivot[:, None], active)


def inverse_cdf_sample(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw from non-negative, unnormalised ``weights [n, V]`` with ``uniforms [n]`` in [0, 1).

    Returns int64 ``[n]``: the first index whose inclusive prefix sum exceeds ``u * sum(row)`` among
    indices with positive weight. A zero-weight index is never returned while the row has a positive
    entry: if rounding leaves no index past the threshold (u near 1), the last positive index is used;
    an all-zero row returns ``V - 1`` (flashinfer's convention).
    """
    vocab = weights.shape[-1]
    positive = weights > 0  # [n, V]
    cdf = weights.cumsum(dim=-1)  # [n, V]
    target = uniforms.to(cdf.dtype) * cdf[:, -1]  # [n]
    hit = (cdf > target[:, None]) & positive  # [n, V]
    first = hit.to(torch.uint8).argmax(dim=-1)  # [n] first True (argmax returns the first maximum)
    last_pos = vocab - 1 - positive.flip(-1).to(torch.uint8).argmax(dim=-1)  # [n]
    fallback = torch.where(positive.any(dim=-1), last_pos, torch.full_like(last_pos, vocab - 1))
    return torch.where(hit.any(dim=-1), first, fallback).to(torch.int64)


def sampling_from_probs(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Draw one token per row of ``probs [bs, V]`` by inverse CDF with ``uniforms [bs]`` (f32 in [0, 1]).

    Returns int64 ``[bs]``. Never returns a zero-probability token (unless the whole row is zero, then
    ``V - 1``). Rows need not be exactly normalised: the threshold is ``u * sum(row)``.
    """
    _check_probs(probs)
    if not isinstance(uniforms, torch.Tensor) or uniforms.dim() != 1 or uniforms.shape[0] != probs.shape[0]:
        raise ValueError(f"uniforms must be a tensor of shape [{probs.shape[0]}]")
    if uniforms.device != probs.device:
        raise ValueError("uniforms must be on the same device as probs")
    if bool(((uniforms < 0) | (uniforms > 1) | torch.isnan(uniforms)).any()):
        raise ValueError("uniforms must lie in [0, 1]")
    if bool((probs < 0).any()) or not bool(torch.isfinite(probs).all()):
        raise ValueError("probs must be finite and non-negative")
    return inverse_cdf_sample(probs, uniforms)


def warm_up_filters(device: torch.device | str, vocab: int) -> str:
    """Run the top-k and top-p filters once on ``device`` (flashinfer JIT-compiles its sampling module at
    first use; call at start-up so no request pays for it). Returns the backend that ran."""
    probs = torch.full((2, vocab), 1.0 / vocab, device=device)  # [2, V]
    fn = _flashinfer_filter(probs, _FI_TOP_K)
    top_p_renorm_prob(top_k_renorm_prob(probs, 1), 0.5)
    return "flashinfer" if fn is not None else "torch reference"
