"""Offline check of a refactor of the Triton MLA kernels (no GPU needed): dump each kernel's LLVM IR and PTX,
without debug information, over a grid of configurations, and compare two dumps.

    mkdir /tmp/before && git archive HEAD kernels | tar -x -C /tmp/before    # the kernels before the change
    PYTHONPATH=$PWD python benchmarks/triton_ir_dump.py dump /tmp/ir-before --src /tmp/before
    PYTHONPATH=$PWD python benchmarks/triton_ir_dump.py dump /tmp/ir-after
    PYTHONPATH=$PWD python benchmarks/triton_ir_dump.py compare /tmp/ir-before /tmp/ir-after

The grid: the kernels of ``triton_smem_check.mla_kernels`` (``--kernels single,split,dcp``), sm90 and sm120
(``--archs``), float32 / bfloat16 / bfloat16 over an fp8 cache, 8 and 64 heads (``--heads``) at the tiles
``choose_mla_tiles`` picks there (``--src``: import the kernels from that tree; this tree's compile set-up), causal and tree-masked; Kimi K2.6's latent 512 + rope 64. A pure refactor
(code moved into inlined ``@triton.jit`` helpers) leaves the LLVM IR and the PTX equal; the TTIR is not
compared (the frontend orders the hoisted constants and names the values after their source lines). ``compare``
exits 1 when a file differs or is missing. Run without ``TRITON_INTERPRET`` (the interpreter compiles nothing).
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import sys
from pathlib import Path

import torch

from benchmarks.triton_smem_check import compile_mla, mla_kernels

DTYPES = {"float32": (torch.float32, False), "bfloat16": (torch.bfloat16, False), "bfloat16_fp8": (torch.bfloat16, True)}


def strip_llir(text: str) -> str:
    """LLVM IR without its debug metadata (``!dbg`` references and ``!N = ...`` lines)."""
    text = re.sub(r",? !dbg !\d+", "", text)
    return "\n".join(line for line in text.splitlines() if not re.match(r"^!\d+ = ", line))


def strip_ptx(text: str) -> str:
    """PTX without ``.loc`` / ``.file`` lines, the inlining scope labels ``$L__tmp`` and the debug sections."""
    text = text.split(".section\t.debug", 1)[0]
    lines = (line for line in text.splitlines() if not re.match(r"^\s*(\.loc|\.file)\b", line))
    return "\n".join(line for line in lines if not re.match(r"^\$L__tmp\d+:$", line.strip()))


def dump(out: Path, kernels: list[str], archs: list[int], heads: list[int]) -> None:
    import triton

    from ddtree_serve.kernels.triton_mla_plan import SMEM_OPTIN_BYTES, choose_mla_tiles

    out.mkdir(parents=True, exist_ok=True)
    triton.knobs.compilation.always_compile = True
    table = mla_kernels()
    for name, arch, dname, h, tree in itertools.product(kernels, archs, DTYPES, heads, (False, True)):
        dtype, fp8 = DTYPES[dname]
        limit = SMEM_OPTIN_BYTES[(arch // 10, arch % 10)]
        tiles = choose_mla_tiles(h, 512, 64, dtype, limit, arch, torch.float8_e4m3fn if fp8 else None)
        c = compile_mla(table[name], dtype, arch, tiles, 512, 64, fp8, tree)
        tag = f"{name}_sm{arch}_{dname}_h{h}_{'tree' if tree else 'causal'}"
        (out / f"{tag}.llir").write_text(strip_llir(c.asm["llir"]))
        (out / f"{tag}.ptx").write_text(strip_ptx(c.asm["ptx"]))
        print(f"{tag}: shared {c.metadata.shared:,} B", flush=True)


def compare(before: Path, after: Path) -> bool:
    names = sorted({p.name for p in before.iterdir()} | {p.name for p in after.iterdir()})
    ok = True
    for n in names:
        a, b = before / n, after / n
        same = a.exists() and b.exists() and a.read_text() == b.read_text()
        ok &= same
        print(f"{n}: {'same' if same else 'DIFFERENT' if a.exists() and b.exists() else 'MISSING'}")
    print(f"{len(names)} files: {'ALL SAME' if ok else 'DIFFERENCES'}")
    return ok


def main() -> int:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("dump")
    d.add_argument("out", type=Path)
    d.add_argument("--kernels", default="single,split,dcp")
    d.add_argument("--archs", default="90,120")
    d.add_argument("--heads", default="8,64")
    d.add_argument("--src", default=None, help="a tree whose kernels/ package to compile (default: this one)")
    c = sub.add_parser("compare")
    c.add_argument("before", type=Path)
    c.add_argument("after", type=Path)
    args = ap.parse_args()
    if args.cmd == "compare":
        return 0 if compare(args.before, args.after) else 1
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET: the interpreter compiles nothing")
        return 2
    if args.src:  # before the first import of the kernels package (mla_kernels imports it lazily)
        sys.path.insert(0, args.src)
    dump(args.out, args.kernels.split(","), [int(a) for a in args.archs.split(",")],
         [int(h) for h in args.heads.split(",")])  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
