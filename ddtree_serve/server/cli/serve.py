"""``ddtree-serve serve``: the OpenAI-compatible HTTP server."""

from __future__ import annotations

import argparse

HELP = "run the OpenAI-compatible server"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ddtree_serve.server.cli.args import add_server_arguments

    add_server_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from ddtree_serve.server.cli.args import config_from_args
    from ddtree_serve.server.launch import launch_server

    return launch_server(config_from_args(args))
