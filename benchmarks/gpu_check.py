"""The GPU check driver (benchmarks/gpu_check.sh runs it): every part of benchmarks/gpu/registry.py in its own
process, in order, under one deadline, on whatever torch and Triton the machine has, offline, on one GPU.

    python benchmarks/gpu_check.py [--out DIR] [--deadline-s 525] [--parts a,b] [--work DIR]

Each part ends PASS, FAIL or NOT AVAILABLE (CUDA missing, a library that does not import, fewer GPUs than it
needs, a part it needs did not pass; the reason says which), with its wall time, its numbers and the
backends that ran. A part still running at its timeout (its own, or what is left before the deadline) is a
FAIL that keeps the numbers it had written; a part that would start with too little time left is
"NOT RUN (time)". The parts run in benchmarks/gpu/registry.py's order (by value: comparisons against a reference
first, compiles and speed last), with timeouts that add up within the deadline. Two files go to ``DIR``
(``--out``, default ``$OUT`` else ``bench_out``), both rewritten before and after every part so that a run cut
from outside still reports what it did: ``gpu_check.json`` (the environment and every part's status, reason,
numbers and backends) and ``part_logs.txt`` (each part's output, its last ``LOG_TAIL_CHARS``);
benchmarks/gpu_check.sh adds ``gpu_check.log``. The parts' own files and the checkpoint (a few GB) go to
``--work`` (default ``$TMPDIR/ddtree_gpu_check``), never under ``DIR``.

Exit status: 1 when a part FAILED, else 2 when CUDA is not available (nothing ran), else 0.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.gpu.probe import missing  # noqa: E402
from benchmarks.gpu.registry import DEADLINE_S, PARTS, PROBE_TIMEOUT_S, PROBED, PartSpec  # noqa: E402

DEFAULT_DEADLINE_S = float(DEADLINE_S)  # the check must end before 9 minutes
LOG_TAIL_CHARS = 60_000  # of each part's output, in part_logs.txt
OUT_FILES = ("gpu_check.json", "part_logs.txt")  # what the driver writes under --out (gpu_check.sh adds its log)


def child_env() -> dict[str, str]:
    """The parts' environment: the repository importable, nothing fetched, fallbacks allowed."""
    env = dict(os.environ)
    env.pop("DDTREE_REQUIRE_CUDA_KERNELS", None)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env |= {"DDTREE_ALLOW_TORCH_TREE_WALK": "1",  # a part may run the reference walk: it reports the backend
            "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PIP_NO_INDEX": "1",
            "TOKENIZERS_PARALLELISM": "false"}
    return env


def probe_environment(timeout_s: float = PROBE_TIMEOUT_S) -> dict[str, Any]:
    """benchmarks/gpu/probe.py's facts (in a child: the driver never initialises CUDA)."""
    try:
        p = subprocess.run([sys.executable, "-m", "benchmarks.gpu.probe", *PROBED], capture_output=True, text=True,
                           timeout=timeout_s, env=child_env(), cwd=ROOT)
        return json.loads(p.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, json.JSONDecodeError, IndexError) as e:
        return {"cuda": False, "gpus": 0, "libraries": {}, "probe_error": f"{type(e).__name__}: {e}"}


def blocked(spec: PartSpec, env: dict[str, Any], done: dict[str, dict[str, Any]]) -> str | None:
    """Why ``spec`` cannot run here (its NOT AVAILABLE reason), or None."""
    if not env.get("cuda"):
        return "CUDA not available" + (f" ({env['probe_error']})" if env.get("probe_error") else "")
    if env.get("gpus", 0) < spec.min_gpus:
        return f"needs {spec.min_gpus} GPUs, this machine has {env.get('gpus', 0)}"
    lacking = missing(env, spec.requires)
    if lacking:
        return "missing library: " + ", ".join(f"{m} ({env['libraries'].get(m, 'MISSING')})" for m in lacking)
    for dep in spec.needs:
        status = done.get(dep, {}).get("status", "NOT RUN")
        if status != "PASS":
            return f"needs part {dep}, which is {status}"
    return None


def run_part(spec: PartSpec, timeout_s: float, work: Path) -> dict[str, Any]:
    """Run ``spec`` in a child process (its own session, killed as a group at the timeout); its result JSON and
    log under ``work``."""
    result = work / "parts" / f"{spec.name}.json"
    log = work / "logs" / f"{spec.name}.log"
    result.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "benchmarks.gpu.run_part", spec.name, "--work", str(work), "--result", str(result),
           "--deadline-s", f"{timeout_s:.0f}"]
    t0 = time.monotonic()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=child_env(), cwd=ROOT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
            why = "" if rc == 0 else f"exit status {rc}"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the part's own process group, started above
            proc.wait()
            rc, why = None, f"timed out after {timeout_s:.0f} s"
    wall = time.monotonic() - t0
    try:
        res = json.loads(result.read_text())
    except (OSError, json.JSONDecodeError):
        res = {"status": "RUNNING", "reason": "", "numbers": {}, "backend": {}}
    if res.get("status") in (None, "RUNNING"):  # killed or crashed before it could report
        res["status"], res["reason"] = "FAIL", f"{why or 'ended without a result'}; log tail:\n{_tail(log)}"
    elif rc is None:
        res["reason"] = f"{res.get('reason', '')} ({why})".strip()
    return res | {"wall_s": round(wall, 1)}


def pack_logs(work: Path, out: Path) -> None:
    """``out/part_logs.txt``: every part's log so far (its last ``LOG_TAIL_CHARS``), in the parts' order."""
    chunks = []
    for spec in PARTS:
        log = work / "logs" / f"{spec.name}.log"
        if log.exists():
            chunks.append(f"===== {spec.name} =====\n{_tail(log, LOG_TAIL_CHARS)}\n")
    tmp = out / "part_logs.tmp"
    tmp.write_text("".join(chunks))
    tmp.replace(out / "part_logs.txt")


def _tail(path: Path, chars: int = 2500) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


class Report:
    """``gpu_check.json``: the environment and every part's state, rewritten on each change."""

    def __init__(self, path: Path, env: dict[str, Any], deadline_s: float):
        self.path = path
        self.t0 = time.monotonic()
        self.data: dict[str, Any] = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "deadline_s": deadline_s,
                                     "environment": env, "parts": {}, "finished": False}

    def set(self, spec: PartSpec, entry: dict[str, Any]) -> None:
        self.data["parts"][spec.name] = {"title": spec.title} | entry
        self.write()

    def write(self) -> None:
        self.data["elapsed_s"] = round(time.monotonic() - self.t0, 1)
        statuses = [p["status"] for p in self.data["parts"].values()]
        self.data["summary"] = {s: statuses.count(s) for s in sorted(set(statuses))}
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        tmp.replace(self.path)


def print_table(report: Report) -> None:
    print(f"\n{'part':<18}{'status':<16}{'wall s':>8}  reason / numbers")
    for name, p in report.data["parts"].items():
        nums = {k: v for k, v in p.get("numbers", {}).items() if isinstance(v, int | float | str)}
        note = (p.get("reason") or "").splitlines()[0][:90] if p.get("reason") else json.dumps(nums)[:90]
        print(f"{name:<18}{p['status']:<16}{p.get('wall_s', 0):>8}  {note}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "bench_out"))
    ap.add_argument("--deadline-s", type=float,
                    default=float(os.environ.get("DDTREE_GPU_CHECK_DEADLINE_S", DEFAULT_DEADLINE_S)))
    ap.add_argument("--parts", default=os.environ.get("DDTREE_GPU_CHECK_PARTS", ""),
                    help="comma-separated part names to run (default: all); the others are NOT RUN (not selected)")
    ap.add_argument("--work", default=os.environ.get("DDTREE_GPU_CHECK_WORK")
                    or str(Path(tempfile.gettempdir()) / "ddtree_gpu_check"))
    a = ap.parse_args(argv)
    start = time.monotonic()
    out, work = Path(a.out), Path(a.work)
    for d in (out, work / "parts", work / "logs"):
        d.mkdir(parents=True, exist_ok=True)
    chosen = {n.strip() for n in a.parts.split(",") if n.strip()}
    env = probe_environment()
    report = Report(out / "gpu_check.json", env, a.deadline_s)
    print(f"GPU check: {env.get('device', 'no CUDA device')}, torch {env.get('torch')}, "
          f"libraries {env.get('libraries')}", flush=True)
    for spec in PARTS:
        report.set(spec, {"status": "PENDING"})
    for spec in PARTS:
        left = a.deadline_s - (time.monotonic() - start)
        why = blocked(spec, env, report.data["parts"])
        if chosen and spec.name not in chosen:
            entry = {"status": "NOT RUN (not selected)"}
        elif why is not None:
            entry = {"status": "NOT AVAILABLE", "reason": why}
        elif left < spec.min_start_s:
            entry = {"status": "NOT RUN (time)", "reason": f"{left:.0f} s left before the deadline"}
        else:
            report.set(spec, {"status": "RUNNING", "timeout_s": round(min(spec.timeout_s, left))})
            print(f"=== {spec.name}: {spec.title} (timeout {min(spec.timeout_s, left):.0f} s)", flush=True)
            entry = run_part(spec, min(spec.timeout_s, left), work)
            print(f"--- {spec.name}: {entry['status']} in {entry['wall_s']} s", flush=True)
        report.set(spec, entry)
        pack_logs(work, out)
    statuses = [p["status"] for p in report.data["parts"].values()]
    code = 1 if "FAIL" in statuses else (2 if not env.get("cuda") else 0)
    report.data |= {"finished": True, "exit_code": code}
    report.write()
    print_table(report)
    print(f"\nwrote {report.path}; exit {code}")
    return code


if __name__ == "__main__":
    sys.exit(main())
