"""``ddtree-serve plan``: what ``serve`` with the same flags and preset will size at start-up, from config.json
alone (no weights needed).

    ddtree-serve plan --config configs/kimi-k2.6-8x-b300.yaml

Takes every serve flag (one definition: ddtree_serve/server/cli/args.py) with serve's defaults, plus the planned device's
memory (``--gpu-memory-gb``; default: the configuration's ``machine`` class, else this machine's device) and
the memory assumed in use besides the weights (``--overhead-gb``). Prints the weights per rank, the line the
scheduler logs at start-up for KV sizing (ddtree_serve/server/plan.py, ddtree_serve/server/memory_sizing.py) and the DDTree budget x
batch table; ``--json`` prints the plan as JSON instead.
"""

from __future__ import annotations

import argparse
import json

HELP = "size a deployment as serve will (same flags and presets) from config.json alone"


def _positive(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _non_negative(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ddtree_serve.server.cli.args import add_server_arguments

    add_server_arguments(parser)
    plan = parser.add_argument_group("plan only")
    plan.add_argument("--gpu-memory-gb", type=_positive, default=None, metavar="GIB",
                      help="memory per GPU in GiB (default: the --machine class's, else this machine's device)")
    plan.add_argument("--overhead-gb", type=_non_negative, default=2.0, metavar="GIB",
                      help="memory in use per GPU besides weights and drafter: CUDA context, NCCL, kernel "
                           "workspaces (default: 2.0)")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON instead of a table (default: off)")


def run(args: argparse.Namespace) -> int:
    from ddtree_serve.server.cli.args import config_from_args
    from ddtree_serve.server.plan import make_plan

    plan = make_plan(config_from_args(args), args.gpu_memory_gb, args.overhead_gb)
    print(json.dumps(plan.as_dict(), indent=2) if args.json else plan.table())
    return 0
