"""Choose between the PyTorch reference and a CUDA library (sgl-kernel, flashinfer) per call.

The CUDA path is taken only when every tensor of the call lives on a CUDA device, the library imports,
and the environment does not force the reference (``DDTREE_KERNELS=torch``). sgl-kernel raises
ImportError on machines without CUDA (missing libnvrtc), so imports are probed inside try/except.
No module-level mutable state: the import probe is memoised with ``functools.cache``.

``DDTREE_REQUIRE_CUDA_KERNELS=1`` (the GPU check sets it) turns every silent fallback into an error: a
call on CUDA tensors whose library does not import raises ``CudaKernelUnavailable`` (with the import
error) instead of running the reference, so a check cannot pass without exercising the libraries.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType

import torch

SGL_KERNEL = "sgl_kernel"
FLASHINFER = "flashinfer"
_ENV = "DDTREE_KERNELS"
REQUIRE_ENV = "DDTREE_REQUIRE_CUDA_KERNELS"
FLASHINFER_ARCH_ENV = "FLASHINFER_CUDA_ARCH_LIST"

# Human names of the implementations, as the GPU check prints them.
BACKEND_NAMES = {SGL_KERNEL: "sgl-kernel", FLASHINFER: "flashinfer", "torch": "torch reference"}

logger = logging.getLogger(__name__)


class CudaKernelUnavailable(RuntimeError):
    """A CUDA library was required (``DDTREE_REQUIRE_CUDA_KERNELS=1``) but cannot run."""


def cuda_kernels_required() -> bool:
    """True when ``DDTREE_REQUIRE_CUDA_KERNELS`` is set to 1/true/yes."""
    return os.environ.get(REQUIRE_ENV, "").strip().lower() in ("1", "true", "yes")


def target_detected_cuda_arch() -> str | None:
    """Make flashinfer's JIT compile for the GPU in use only: when neither ``FLASHINFER_CUDA_ARCH_LIST``
    is set nor CUDA is unavailable, set it to the current device's ``major.minor`` (flashinfer adds the
    ``a``/``f`` suffix itself). Must run before flashinfer is imported (it reads the variable at import).
    Returns the value in effect, None without CUDA."""
    if FLASHINFER_ARCH_ENV in os.environ:
        return os.environ[FLASHINFER_ARCH_ENV]
    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    os.environ[FLASHINFER_ARCH_ENV] = f"{major}.{minor}"
    return os.environ[FLASHINFER_ARCH_ENV]


@functools.cache
def _import(name: str) -> tuple[ModuleType | None, str]:
    if name.split(".")[0] == FLASHINFER:
        target_detected_cuda_arch()
    try:
        return importlib.import_module(name), ""
    except (ImportError, OSError, RuntimeError) as e:
        return None, f"{type(e).__name__}: {e}"


def import_cuda_library(name: str) -> ModuleType | None:
    """Import ``name`` (``"sgl_kernel"``, ``"flashinfer"`` or a submodule such as ``"flashinfer.sampling"``)
    once; None when it is not installed or cannot load (no CUDA runtime)."""
    return _import(name)[0]


def import_error(name: str) -> str:
    """Why ``name`` did not import ("" when it did)."""
    return _import(name)[1]


def require_cuda_library(name: str, what: str) -> ModuleType:
    """Import ``name`` or raise ``CudaKernelUnavailable`` naming ``what`` needed it and why it failed."""
    mod = import_cuda_library(name)
    if mod is None:
        raise CudaKernelUnavailable(f"{what} needs {name}, which does not import ({import_error(name)})")
    return mod


def kernels_forced_to_torch() -> bool:
    """True when ``DDTREE_KERNELS=torch`` asks for the PyTorch reference everywhere."""
    return os.environ.get(_ENV, "").strip().lower() == "torch"


def use_cuda_kernels(*tensors: torch.Tensor, library: str = SGL_KERNEL) -> bool:
    """True when the CUDA implementation of ``library`` should run for a call on ``tensors``.

    Requires: CUDA available, every tensor on a CUDA device (at least one tensor given), ``library``
    importable, and ``DDTREE_KERNELS`` not set to ``torch``. Under ``DDTREE_REQUIRE_CUDA_KERNELS=1`` a
    call on CUDA tensors whose library is forced off or does not import raises ``CudaKernelUnavailable``.
    """
    if not tensors or not torch.cuda.is_available():
        return False
    if not all(isinstance(t, torch.Tensor) and t.is_cuda for t in tensors):
        return False
    if kernels_forced_to_torch():
        if cuda_kernels_required():
            raise CudaKernelUnavailable(f"{REQUIRE_ENV}=1 contradicts {_ENV}=torch")
        return False
    if import_cuda_library(library) is None:
        if cuda_kernels_required():
            raise CudaKernelUnavailable(
                f"{library} does not import ({import_error(library)}) and {REQUIRE_ENV}=1 forbids the fallback"
            )
        return False
    return True


ALLOW_TORCH_TREE_WALK_ENV = "DDTREE_ALLOW_TORCH_TREE_WALK"


def check_tree_walk(device: torch.device | str) -> None:
    """A start-up check for a speculative worker on ``device``: on CUDA the tree walk is sgl-kernel's, or the
    operator asked for the torch reference (``DDTREE_KERNELS=torch`` or ``DDTREE_ALLOW_TORCH_TREE_WALK=1``).
    Otherwise a missing sgl-kernel raises ``CudaKernelUnavailable`` here rather than falling back silently: the
    reference walk loops over depth and siblings on the host and reads the device back 85-111 more times a
    step (docs/DESIGN.md 4.17)."""
    if torch.device(device).type != "cuda" or kernels_forced_to_torch():
        return
    if os.environ.get(ALLOW_TORCH_TREE_WALK_ENV, "").strip().lower() in ("1", "true", "yes"):
        logger.warning("%s=1: the DDTree step walks trees with the torch reference on CUDA (%s)",
                       ALLOW_TORCH_TREE_WALK_ENV, import_error(SGL_KERNEL) or "sgl-kernel imports")
        return
    if import_cuda_library(SGL_KERNEL) is None:
        raise CudaKernelUnavailable(
            f"speculative decoding on CUDA needs sgl-kernel's tree walk, and sgl-kernel does not import "
            f"({import_error(SGL_KERNEL)}); install the pinned sgl-kernel (docs/DEPLOY.md), or set "
            f"{ALLOW_TORCH_TREE_WALK_ENV}=1 to run the torch reference walk knowingly (85-111 more host syncs a "
            f"step)")


def backend_name(*tensors: torch.Tensor, library: str = SGL_KERNEL) -> str:
    """Which implementation a call on ``tensors`` runs: ``"sgl-kernel"``, ``"flashinfer"`` or
    ``"torch reference"`` (what the GPU check prints for each part)."""
    lib = library.split(".")[0]
    return BACKEND_NAMES[lib] if use_cuda_kernels(*tensors, library=library) else BACKEND_NAMES["torch"]


def _tracker_region(name: str):
    """The ``name`` region of the innermost torch function mode that has one (a device simulator's), else None."""
    stack = [torch._C._get_function_stack_at(i) for i in range(torch._C._len_torch_function_stack())]
    return next((getattr(m, name) for m in reversed(stack) if hasattr(m, name)), None)


@contextmanager
def graph_replay() -> Iterator[None]:
    """Marks torch ops that a GPU runs as one replay of a CUDA graph captured from them: a device simulator (a
    torch function mode with a ``graph_region`` method: ddtree_serve/sim/device_tracker.py) charges the host one
    replay for the region, whatever its ops and Python cost, and raises on a synchronising act inside it (a
    capture cannot hold one). Elsewhere it does nothing."""
    region = _tracker_region("graph_region")
    if region is None:
        yield
        return
    with region():
        yield


@contextmanager
def one_kernel() -> Iterator[None]:
    """Marks a torch reference that stands for one CUDA kernel launch (its CUDA path is a single kernel): a device
    simulator that tracks torch calls (a torch function mode with a ``kernel_region`` method:
    ddtree_serve/sim/device_tracker.py) counts the region as that one launch, not as the reference's own ops and
    host reads. Elsewhere it does nothing."""
    region = _tracker_region("kernel_region")
    if region is None:
        yield
        return
    with region():
        yield


class _Done:
    """An event on a device whose work is synchronous (the CPU): always complete."""

    def synchronize(self) -> None:
        """Nothing to wait for."""


def record_event(device: torch.device) -> object:
    """A point in ``device``'s stream, recorded now, with ``synchronize()``, which blocks the host until the work
    queued before it is done and no later: a CUDA event on a GPU; under a device simulator (a torch function mode
    with a ``record_event`` method: ddtree_serve/sim/device_tracker.py) the modelled queue's end at this point, its
    wait charged as one synchronising read; elsewhere already complete."""
    record = _tracker_region("record_event")
    if record is not None:
        return record()
    if torch.device(device).type == "cuda":
        event = torch.cuda.Event()
        event.record()
        return event
    return _Done()
