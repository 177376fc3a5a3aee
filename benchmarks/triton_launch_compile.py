"""Compile Triton kernels exactly as their real launches specialise them, without a GPU (Triton's bundled ptxas),
and read ptxas's registers, spills and the cubin's shared memory.

A real launch specialises each argument: a tensor whose address is a multiple of 16, or an integer that is,
gets ``tt.divisibility 16`` (Triton's ``get_tensor_specialization`` / ``get_int_specialization``), which lets
the compiler vectorise loads and pipeline them through shared memory: a kernel compiled without those hints
is not the kernel the GPU runs (it may take less shared memory and fewer registers). Here the host-side launch
code runs on CPU tensors at the real shapes with every kernel launch intercepted (``capture_launches``), and
each captured launch is compiled with the signature, constexprs, hints and options it carried
(``compile_launch``).

Used by benchmarks/triton_smem_check.py (the MLA kernels the presets run, and the sampling kernel) and its
test. Run without ``TRITON_INTERPRET`` (the interpreter compiles nothing).
"""

from __future__ import annotations

import contextlib
import io
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float8_e4m3fn: "fp8e4nv",
          torch.int64: "i64", torch.int32: "i32", torch.uint8: "u8", torch.int8: "i8", torch.bool: "i1"}
LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg", "enable_fp_fusion")


@dataclass
class Launch:
    """One intercepted launch: the kernel (a ``triton.JITFunction``), its grid, arguments and keywords."""

    kernel: Any
    grid: Any
    args: tuple
    kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.kernel.__name__


@dataclass(frozen=True)
class CompileStats:
    shared: int  # bytes of shared memory the launch needs (static + dynamic: ``metadata.shared``)
    registers: int  # per thread
    spill_bytes: int  # ptxas's spill stores + spill loads
    num_warps: int


class _Recorder:
    def __init__(self, kernel: Any, sink: list[Launch]) -> None:  # noqa: ANN401
        self.kernel, self.sink = kernel, sink

    def __getitem__(self, grid: Any):  # noqa: ANN204, ANN401
        return lambda *args, **kwargs: self.sink.append(Launch(self.kernel, grid, args, kwargs))


@contextlib.contextmanager
def capture_launches(targets: dict[Any, tuple[str, ...]]) -> Iterator[list[Launch]]:
    """Within the block, ``module.NAME[grid](...)`` for each ``NAME`` of ``targets[module]`` records a
    ``Launch`` instead of running (the host code around it runs as usual, on whatever tensors it is given)."""
    sink: list[Launch] = []
    saved = []
    for module, names in targets.items():
        for name in names:
            kernel = getattr(module, name)
            saved.append((module, name, kernel))
            setattr(module, name, _Recorder(kernel, sink))
    try:
        yield sink
    finally:
        for module, name, kernel in saved:
            setattr(module, name, kernel)


def _specialize(value: Any) -> tuple[str, str]:  # noqa: ANN401
    """(signature type, specialisation) of one runtime argument, as Triton's launcher computes them."""
    if isinstance(value, torch.Tensor):
        return "*" + _TYPES[value.dtype], "D" if value.data_ptr() % 16 == 0 else ""
    if isinstance(value, bool):
        return "i1", ""
    if isinstance(value, int):
        kind = "i32" if -(2**31) <= value < 2**31 else ("u64" if value >= 2**63 else "i64")
        return kind, "D" if value % 16 == 0 else ""
    if isinstance(value, float):
        return "fp32", ""
    if value is None:
        return "constexpr", ""
    raise TypeError(f"cannot specialise a launch argument of type {type(value).__name__}")


def launch_source(launch: Launch) -> tuple[Any, dict[str, Any]]:  # noqa: ANN401
    """``(ASTSource, options)`` of a captured launch: constexprs from the keywords, each other argument typed and
    hinted as the launcher would (``_specialize``), the launch options (``num_warps``, ``num_stages``)."""
    from triton.compiler import ASTSource

    kernel = launch.kernel
    names = kernel.arg_names
    values = dict(zip(names, launch.args, strict=False))
    options = {k: v for k, v in launch.kwargs.items() if k in LAUNCH_OPTIONS}
    values |= {k: v for k, v in launch.kwargs.items() if k not in LAUNCH_OPTIONS}
    signature, constexprs, attrs = {}, {}, {}
    for i, (name, param) in enumerate(zip(names, kernel.params, strict=True)):
        value = values[name]
        if param.is_constexpr:
            signature[name] = "constexpr"
            constexprs[name] = value
            continue
        kind, spec = _specialize(value)
        signature[name] = kind
        if kind == "constexpr":
            constexprs[name] = value
        elif spec and not param.do_not_specialize and not param.do_not_specialize_on_alignment:
            attrs[(i,)] = [["tt.divisibility", 16]]
    return ASTSource(kernel, signature, constexprs=constexprs, attrs=attrs), options


def compile_launch(launch: Launch, arch: int) -> CompileStats:
    """Compile a captured launch for ``sm<arch>`` (always: Triton's cache would skip ptxas) and read ptxas -v."""
    import triton
    from triton.backends.compiler import GPUTarget

    src, options = launch_source(launch)
    knobs = triton.knobs
    saved = (knobs.compilation.always_compile, knobs.nvidia.dump_ptxas_log)
    knobs.compilation.always_compile, knobs.nvidia.dump_ptxas_log = True, True
    log = io.StringIO()
    try:
        with contextlib.redirect_stdout(log):  # ptxas -v's log, printed by Triton's CUDA backend
            compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    finally:
        knobs.compilation.always_compile, knobs.nvidia.dump_ptxas_log = saved
    text = log.getvalue()
    regs = re.search(r"Used (\d+) registers", text)
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", text)]
    if regs is None or not spills:
        raise RuntimeError(f"no register / spill counts in ptxas's log:\n{text}")
    return CompileStats(int(compiled.metadata.shared), int(regs.group(1)), sum(spills),
                        int(options.get("num_warps", 4)))
