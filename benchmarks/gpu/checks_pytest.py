"""GPU check parts that run tests/gpu under pytest (fallbacks allowed: a missing flashinfer / sgl-kernel means the
torch / Triton paths run; tests that need a library skip). Two parts, so that the comparisons against a
reference that nothing else in the check makes run first: ``pytest_reference`` (the seeded sampling kernel at
Kimi's vocabulary, tree verification and sampling, the coin rule, the DCP 8 MLA kernel's decode / extend /
verify, the mixed batch, each against the torch reference) and ``pytest_rest`` (every other tests/gpu test,
most of which repeat what earlier parts check at other sizes)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from benchmarks.gpu.parts import PartContext

ROOT = Path(__file__).resolve().parents[2]

REFERENCE_TESTS = (
    "tests/gpu/test_triton_cuda.py::test_triton_sampling_matches_reference_on_cuda",
    "tests/gpu/test_mla_dcp_cuda.py",
    "tests/gpu/test_kernels_cuda.py::test_tree_sampling_matches_reference",
    "tests/gpu/test_kernels_cuda.py::test_verify_tree_greedy_matches_reference",
    "tests/gpu/test_coin_rule_cuda.py",
    "tests/gpu/test_mixed_batches_cuda.py::test_mixed_batch_matches_reference_under_the_kernel_rule",
)


def run_pytest(ctx: PartContext, args: list[str]) -> bool:
    """``pytest -m gpu ARGS`` in a child, cut before the part's time ends: counts, failures, skips and the
    backend lines the tests print (tests/gpu/conftest.py) into ``ctx``; True when pytest exits 0."""
    env = dict(os.environ)
    env.pop("DDTREE_REQUIRE_CUDA_KERNELS", None)
    try:
        p = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", *args, "-q", "-rfEs", "-p", "no:cacheprovider"],
                           capture_output=True, text=True, cwd=ROOT, env=env, timeout=max(5.0, ctx.left() - 5))
        text, rc = p.stdout + p.stderr, p.returncode
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        text, rc = out + "\n[cut: the part's time ran out]", None
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", text)}
    lines = text.splitlines()
    marker = next((i for i, x in enumerate(lines) if "backends that ran" in x), None)
    backends = lines[marker + 1:] if marker is not None else []
    ctx.numbers |= {"exit": rc, "counts": counts,
                    "failures": [x for x in lines if x.startswith(("FAILED", "ERROR"))][:40],
                    "skips": [x for x in lines if x.startswith("SKIPPED")][:40], "output_tail": text[-4000:]}
    ctx.backend["tests"] = "; ".join(x.strip() for x in backends if x.strip() and not x.startswith("="))[:2000]
    if rc is None:
        ctx.numbers["failure"] = "pytest did not finish in the part's time"
    return rc == 0


def part_pytest_reference(ctx: PartContext) -> bool:
    """``REFERENCE_TESTS``: the comparisons against the torch reference that only tests/gpu makes."""
    return run_pytest(ctx, list(REFERENCE_TESTS))


def part_pytest_rest(ctx: PartContext) -> bool:
    """Every other ``pytest -m gpu tests/gpu`` test (``REFERENCE_TESTS`` deselected)."""
    return run_pytest(ctx, ["tests/gpu", *(f"--deselect={t}" for t in REFERENCE_TESTS)])
