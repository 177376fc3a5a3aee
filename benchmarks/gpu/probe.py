"""What the machine has, as JSON on stdout (benchmarks/gpu_check.py runs it in its own process so the driver
never holds a CUDA context): torch / CUDA / GPUs, and for each library the check may use its version or why
it does not import.

    python -m benchmarks.gpu.probe MODULE [MODULE ...]
"""

from __future__ import annotations

import importlib
import json
import shutil
import subprocess
import sys
from typing import Any


def probe(modules: list[str]) -> dict[str, Any]:
    """The environment facts (module docstring)."""
    out: dict[str, Any] = {"python": sys.version.split()[0]}
    try:
        import torch
    except Exception as e:  # noqa: BLE001 - reported, not raised
        return out | {"torch": f"does not import ({type(e).__name__}: {e})", "cuda": False, "gpus": 0,
                      "libraries": {}}
    cuda = torch.cuda.is_available()
    out |= {"torch": torch.__version__, "torch_cuda": torch.version.cuda, "cuda": cuda,
            "gpus": torch.cuda.device_count() if cuda else 0}
    if cuda:
        props = torch.cuda.get_device_properties(0)
        out |= {"device": props.name, "capability": f"sm{props.major}{props.minor}",
                "memory_gib": round(props.total_memory / 2**30, 1), "sms": props.multi_processor_count}
        try:
            out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception as e:  # noqa: BLE001
            out["nccl"] = f"unknown ({type(e).__name__})"
    libs: dict[str, str] = {}
    for name in modules:
        try:
            mod = importlib.import_module(name)
            libs[name] = str(getattr(mod, "__version__", "present"))
        except Exception as e:  # noqa: BLE001 - any reason a library cannot load is a reason to report
            libs[name] = f"MISSING ({type(e).__name__}: {str(e)[:200]})"
    out["libraries"] = libs
    if cuda and shutil.which("nvidia-smi"):
        try:
            topo = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=20)
            out["topology"] = topo.stdout.strip()[-2000:]
        except (OSError, subprocess.SubprocessError) as e:
            out["topology"] = f"nvidia-smi topo -m failed ({e})"
    return out


def missing(env: dict[str, Any], modules: tuple[str, ...]) -> list[str]:
    """The modules of ``modules`` that did not import in ``env`` (a probe's result)."""
    libs = env.get("libraries", {})
    return [m for m in modules if str(libs.get(m, "MISSING")).startswith("MISSING")]


if __name__ == "__main__":
    print(json.dumps(probe(sys.argv[1:])))
