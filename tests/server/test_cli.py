"""CLI flags, YAML presets and the subcommand table."""

from __future__ import annotations

import argparse

import pytest

from ddtree_serve.server.cli.args import (
    add_server_arguments,
    config_field_names,
    config_from_args,
    flag_names,
)
from ddtree_serve.server.cli.main import build_parser, subcommands


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_server_arguments(p)
    return p.parse_args(argv)


def test_every_config_field_has_a_flag() -> None:
    assert config_field_names() == flag_names()


def test_flags_override_yaml(tmp_path) -> None:
    preset = tmp_path / "p.yaml"
    preset.write_text("model-path: /models/x\nport: 1234\ntp_size: 8\nspeculative_algorithm: ddtree\n"
                      "speculative_ddtree_budget: 64\n")
    cfg = config_from_args(_parse(["--config", str(preset), "--port", "9000", "--speculative-ddtree-budget", "32",
                                   "--api-key", "k", "--tool-call-parser", "kimi_k2", "--no-trust-remote-code"]))
    assert cfg.model.model_path == "/models/x" and cfg.parallel.tp_size == 8
    assert cfg.server.port == 9000 and cfg.speculative.ddtree_budget == 32 and cfg.speculative.algorithm == "ddtree"
    assert cfg.server.api_key == "k" and cfg.server.tool_call_parser == "kimi_k2"
    assert cfg.model.trust_remote_code is False
    assert config_from_args(_parse([])).server.port == 30000


def test_bad_yaml_values(tmp_path) -> None:
    preset = tmp_path / "p.yaml"
    preset.write_text("reasoning_parser: nope\n")
    with pytest.raises(ValueError, match="reasoning_parser"):
        config_from_args(_parse(["--config", str(preset)]))
    preset.write_text("not_a_field: 1\n")
    with pytest.raises(ValueError, match="not_a_field"):
        config_from_args(_parse(["--config", str(preset)]))


def test_bad_flag_choice_exits() -> None:
    with pytest.raises(SystemExit):
        _parse(["--speculative-algorithm", "medusa"])


def test_subcommands() -> None:
    cmds = subcommands()
    assert "serve" in cmds and callable(cmds["serve"].run)
    parser, _ = build_parser()
    args = parser.parse_args(["serve", "--port", "1"])
    assert args.command == "serve" and args.port == 1
    help_text = parser._subparsers._group_actions[0].choices["serve"].format_help()
    for flag in ("--model-path", "--speculative-ddtree-budget", "--api-key", "--reasoning-parser", "--config"):
        assert flag in help_text


def test_budget_auto_and_thresholds(tmp_path) -> None:
    cfg = config_from_args(_parse([]))
    assert cfg.speculative.ddtree_budget == "auto" and cfg.speculative.ddtree_max_budget == 64
    assert not cfg.speculative.lossy
    cfg = config_from_args(_parse(["--speculative-ddtree-budget", "auto", "--speculative-ddtree-max-budget", "32",
                                   "--speculative-accept-threshold-single", "0.9"]))
    assert cfg.speculative.ddtree_budget == "auto" and cfg.speculative.ddtree_max_budget == 32
    assert cfg.speculative.accept_threshold_single == 0.9 and cfg.speculative.lossy
    for bad in ("0", "many", "-3"):
        with pytest.raises(SystemExit):
            _parse(["--speculative-ddtree-budget", bad])
    preset = tmp_path / "p.yaml"
    for text, field in (("speculative_ddtree_budget: sometimes\n", "speculative_ddtree_budget"),
                        ("speculative_accept_threshold_acc: 1.5\n", "speculative_accept_threshold_acc"),
                        ("speculative_ddtree_max_budget: 0\n", "speculative_ddtree_max_budget")):
        preset.write_text(text)
        with pytest.raises(ValueError, match=field):
            config_from_args(_parse(["--config", str(preset)]))
