"""The engine-level law check of sampled speculative decoding (test helper): the joint law of the second and
third generated tokens against the exact target joint, and its power (a shifted law must be rejected).

Tolerances (fixed): chi-square p > 1e-3 over the cells with >= 5 expected counts and over coarse bins (the 24
likeliest cells, the rest pooled), and a total variation within
0.05 of the one plain decoding's own samples reach with the same N (the sampling-noise floor over ~V^2 cells).
"""

from __future__ import annotations

import numpy as np
import torch

P_MIN, TV_SLACK, TOP_CELLS = 1e-3, 0.05, 24


def joint_counts(outs, vocab: int) -> torch.Tensor:
    """Counts of (t2, t3) over ``outs`` (the first token comes from the prefill): [V, V]."""
    counts = torch.zeros(vocab, vocab)
    for o in outs:
        counts[o.token_ids[1], o.token_ids[2]] += 1
    return counts


def law_check(counts: torch.Tensor, plain_counts: torch.Tensor, exact: torch.Tensor) -> tuple[bool, float, float]:
    """Whether ``counts`` (n draws) pass: chi-square p > P_MIN, TV < TV(plain) + TV_SLACK and nothing where
    ``exact`` is 0. Returns (passed, p, tv)."""
    from scipy.stats import chisquare

    n = float(counts.sum())
    emp = counts / n
    tv = 0.5 * (emp - exact).abs().sum().item()
    tv_plain = 0.5 * (plain_counts / float(plain_counts.sum()) - exact).abs().sum().item()
    cells = exact.flatten() * n >= 5
    obs = counts.flatten()[cells]
    exp = exact.flatten()[cells] * n
    exp = exp * obs.sum() / exp.sum()
    p = float(chisquare(obs.numpy(), exp.numpy()).pvalue)
    # the same test over coarse bins (the TOP_CELLS likeliest cells and the rest): far more power against a
    # bias that moves mass between likely and unlikely outcomes than ~V^2 sparse cells give
    top = torch.topk(exact.flatten(), TOP_CELLS).indices
    rest = torch.ones_like(exact.flatten(), dtype=torch.bool)
    rest[top] = False
    obs_c = torch.cat([counts.flatten()[top], counts.flatten()[rest].sum()[None]])
    exp_c = torch.cat([exact.flatten()[top], exact.flatten()[rest].sum()[None]]) * n
    p = min(p, float(chisquare(obs_c.numpy(), (exp_c * obs_c.sum() / exp_c.sum()).numpy()).pvalue))
    ok = p > P_MIN and tv < tv_plain + TV_SLACK and float(emp.flatten()[exact.flatten() == 0].sum()) == 0
    return ok, p, tv


def shifted(exact: torch.Tensor, mass: float, cells: int = 3) -> torch.Tensor:
    """``exact`` with ``mass`` of probability moved onto its ``cells`` likeliest cells, ``(1 - mass) * exact +
    mass * exact | top``: the kind of bias a verification that accepts drafted (likely) nodes too often makes."""
    flat = exact.flatten()
    top = torch.zeros_like(flat)
    idx = torch.topk(flat, cells).indices
    top[idx] = flat[idx] / flat[idx].sum()
    return ((1 - mass) * flat + mass * top).view_as(exact)


def rejection_rate(exact: torch.Tensor, law: torch.Tensor, n: int, trials: int, seed: int) -> float:
    """Share of ``trials`` simulated runs (n multinomial draws from ``law``, plain draws from ``exact``) that
    ``law_check`` rejects."""
    rng = np.random.default_rng(seed)
    pe, pl = exact.flatten().double().numpy(), law.flatten().double().numpy()
    bad = 0
    for _ in range(trials):
        c = torch.from_numpy(rng.multinomial(n, pl / pl.sum()).astype(np.float32)).view_as(exact)
        ref = torch.from_numpy(rng.multinomial(n, pe / pe.sum()).astype(np.float32)).view_as(exact)
        bad += not law_check(c, ref, exact)[0]
    return bad / trials
