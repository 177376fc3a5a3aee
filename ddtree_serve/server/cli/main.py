"""The ``ddtree-serve`` command. Each subcommand is a module with ``HELP``, ``add_arguments(parser)`` and
``run(args) -> int``; add one by listing it in ``subcommand_modules``."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable
from typing import NamedTuple


class Subcommand(NamedTuple):
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def subcommand_modules() -> dict[str, str]:
    """Subcommand name -> module. Colleagues: add e.g. ``"plan": "ddtree_serve.server.cli.plan"``."""
    return {
        "serve": "ddtree_serve.server.cli.serve",
        "train-drafter": "ddtree_serve.server.cli.train",
        "plan": "ddtree_serve.server.cli.plan",
    }


def subcommands() -> dict[str, Subcommand]:
    out = {}
    for name, module_name in subcommand_modules().items():
        mod = importlib.import_module(module_name)
        out[name] = Subcommand(mod.HELP, mod.add_arguments, mod.run)
    return out


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, Subcommand]]:
    parser = argparse.ArgumentParser(prog="ddtree-serve",
                                     description="OpenAI-compatible LLM server with DFlash + DDTree speculative decoding")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    commands = subcommands()
    for name, cmd in commands.items():
        p = sub.add_parser(name, help=cmd.help, description=cmd.help)
        cmd.add_arguments(p)
    return parser, commands


def main(argv: list[str] | None = None) -> int:
    parser, commands = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(commands[args.command].run(args) or 0)
    except ValueError as e:  # configuration errors: a message, not a traceback
        print(f"ddtree-serve {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
