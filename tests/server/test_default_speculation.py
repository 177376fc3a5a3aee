"""`ddtree-serve serve` without a model path serves the default model with DDTree and the shipped drafter."""

from __future__ import annotations

import pytest

from ddtree_serve.server.cli.args import config_from_args
from ddtree_serve.server.cli.main import build_parser


def _config(*argv: str):
    parser, _ = build_parser()
    return config_from_args(parser.parse_args(["serve", *argv]))


def test_default_serve_uses_ddtree_with_shipped_drafter():
    from ddtree_serve.model_executor.default_drafter import default_drafter_path

    try:
        default_drafter_path()
    except FileNotFoundError:
        pytest.fail("the default drafter must ship with the package")
    spec = _config().speculative
    assert spec.algorithm == "ddtree" and spec.draft_model_path == "default" and spec.ddtree_budget == "auto"


def test_explicit_choices_win(tmp_path):
    assert _config("--speculative-algorithm", "none").speculative.algorithm == "none"
    assert _config("--model-path", str(tmp_path)).speculative.algorithm == "none"
    assert _config("--speculative-algorithm", "dflash").speculative.algorithm == "dflash"
