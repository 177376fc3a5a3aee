"""Count real library calls in the GPU tests: wrap a function of sgl-kernel or flashinfer (the real one
still runs) so a test can assert that the library, not the torch reference, computed its result."""

from __future__ import annotations

import functools

import pytest

from ddtree_serve.kernels.dispatch import import_cuda_library


def spy(monkeypatch: pytest.MonkeyPatch, module: str, attr: str) -> list[int]:
    """Wrap ``<module>.<attr>`` (a function, or ``Class.method`` as ``"Class.method"``); returns a list
    whose length is the number of calls. Fails the test when the module does not import."""
    mod = import_cuda_library(module)
    if mod is None:
        pytest.fail(f"{module} does not import")
    owner, name = mod, attr
    if "." in attr:
        cls, name = attr.split(".")
        owner = getattr(mod, cls)
    real = getattr(owner, name)
    calls: list[int] = []

    @functools.wraps(real)
    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)
    return calls
