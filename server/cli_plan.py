"""``ddtree-serve plan``: size a deployment from config.json alone (no weights needed).

    ddtree-serve plan --model-path DIR --tp-size 8 --gpu-memory-gb 96

Prints weight bytes per rank, KV bytes per token, the verify workspace and max verify tokens, the KV token
capacity and the DDTree budget x batch table, computed with the server's own sizing functions
(model_executor/memory.py; model_executor/plan.py documents the memory model). ``--json`` prints the plan as JSON instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from model_executor.plan import make_plan

HELP = "plan memory per GPU (weights, KV cache, DDTree budget x batch) from config.json alone"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-path", required=True, help="model directory (or its config.json)")
    parser.add_argument("--tp-size", type=int, default=8)
    parser.add_argument("--gpu-memory-gb", type=float, default=96.0, help="memory per GPU, GiB")
    parser.add_argument("--mem-fraction-static", type=float, default=0.88,
                        help="share of GPU memory for weights + verify workspace + KV cache")
    parser.add_argument("--context-len", type=int, default=8192, help="context length planned per request")
    parser.add_argument("--overhead-gb", type=float, default=2.0, help="CUDA context, NCCL, graphs (GiB)")
    parser.add_argument("--speculative-draft-model-path", default=None, help="DFlash drafter to count too")
    parser.add_argument("--expert-parallel", action="store_true", help="whole routed experts per rank (EP)")
    parser.add_argument("--max-running-requests", type=int, default=64, help="requests decoded at once")
    parser.add_argument("--speculative-ddtree-budget", type=int, default=16, help="DDTree budget per request")
    parser.add_argument("--speculative-block-size", type=int, default=None, help="drafter block (default: its config's, else 8)")
    parser.add_argument("--verify-workspace-gb", type=float, default=None,
                        help="step workspace per GPU, GiB (default: the full batch x budget)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "bfloat16", "fp8_e4m3"),
                        help="KV cache dtype (auto = bfloat16 on CUDA; fp8_e4m3: MLA models, ~half the bytes)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run(args: argparse.Namespace) -> int:
    path = Path(args.model_path)
    if not (path / "config.json").exists() and not (path.is_file() and path.suffix == ".json"):
        raise ValueError(f"--model-path {args.model_path!r} holds no config.json")
    plan = make_plan(path, tp_size=args.tp_size, gpu_memory_gb=args.gpu_memory_gb,
                     mem_fraction=args.mem_fraction_static, context_len=args.context_len,
                     overhead_gib=args.overhead_gb, draft_model_path=args.speculative_draft_model_path,
                     expert_parallel=args.expert_parallel, max_running_requests=args.max_running_requests,
                     budget=args.speculative_ddtree_budget, block_size=args.speculative_block_size,
                     verify_workspace_gb=args.verify_workspace_gb, kv_cache_dtype=args.kv_cache_dtype)
    if args.json:
        d = dataclasses.asdict(plan)
        best = plan.best
        d["best"] = dataclasses.asdict(best) if best else None
        print(json.dumps(d, indent=2))
    else:
        print(plan.table())
    return 0
