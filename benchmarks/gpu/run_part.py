"""Run one GPU check part in this process (benchmarks/gpu_check.py starts one per part, so a crash or a hang
costs that part only) and write its result JSON:

    python -m benchmarks.gpu.run_part NAME --work DIR --result FILE --deadline-s SECONDS

The result's status is PASS (the part returned True), FAIL (False, or an exception: its traceback's tail is
the reason) or NOT AVAILABLE (``NotAvailable``, or an import of a library outside this repository failed).
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
import traceback
from pathlib import Path

OWN = ("ddtree_serve", "benchmarks", "tests")


def run(name: str, work: Path, result: Path, seconds: float) -> int:
    """Run part ``name`` with ``seconds`` until the driver stops it; 0 on PASS, 1 otherwise."""
    from benchmarks.gpu.parts import NotAvailable, PartContext
    from benchmarks.gpu.registry import part

    spec = part(name)
    ctx = PartContext(name, work, result, time.monotonic() + seconds)
    ctx.flush()
    try:
        module, fn = spec.target.split(":")
        ok = bool(getattr(importlib.import_module(f"benchmarks.gpu.{module}"), fn)(ctx))
        status, reason = ("PASS", "") if ok else ("FAIL", ctx.numbers.get("failure", "a check did not hold"))
    except NotAvailable as e:
        status, reason = "NOT AVAILABLE", str(e)
    except ModuleNotFoundError as e:
        if e.name and e.name.split(".")[0] in OWN:
            status, reason = "FAIL", f"{type(e).__name__}: {e}\n{_tail()}"
        else:
            status, reason = "NOT AVAILABLE", f"missing library {e.name} ({e})"
    except Exception as e:  # noqa: BLE001 - every failure is reported, with its traceback
        status, reason = "FAIL", f"{type(e).__name__}: {e}\n{_tail()}"
    ctx.flush(status, reason)
    print(f"[{name}] {status} {reason.splitlines()[0] if reason else ''}", flush=True)
    return 0 if status == "PASS" else 1


def _tail(chars: int = 3000) -> str:
    return traceback.format_exc()[-chars:]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("name")
    ap.add_argument("--work", required=True)
    ap.add_argument("--result", required=True)
    ap.add_argument("--deadline-s", type=float, default=600.0, help="seconds until the driver stops this part")
    a = ap.parse_args()
    return run(a.name, Path(a.work), Path(a.result), a.deadline_s)


if __name__ == "__main__":
    sys.exit(main())
