"""tests/gpu: with DDTREE_REQUIRE_CUDA_KERNELS=1 (set it to demand the CUDA libraries; benchmarks/gpu_check.sh
does not, so a missing library falls back and is reported) a skipped test is a failure (no CUDA, a library
that does not import, a model not carried), and the terminal summary lists which backend ran each part
(``backend_report``)."""

from __future__ import annotations

import pytest

from ddtree_serve.kernels.dispatch import REQUIRE_ENV, cuda_kernels_required

_REPORT = pytest.StashKey[list]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and cuda_kernels_required() and "tests/gpu" in str(item.fspath).replace("\\", "/"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped under {REQUIRE_ENV}=1, which makes a skip a failure: {reason}"


@pytest.fixture(scope="session")
def backend_report(pytestconfig) -> list:
    """Lines ``part: backend (details)`` printed at the end of the run."""
    return pytestconfig.stash.setdefault(_REPORT, [])


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    lines = config.stash.get(_REPORT, [])
    if lines:
        terminalreporter.section("backends that ran (tests/gpu)")
        for line in lines:
            terminalreporter.write_line(line)
