"""``serve --help`` and ``plan --help`` state the defaults that run: every ``(default: X)`` parsed from the
rendered help is compared with the configuration serve resolves from no flags."""

from __future__ import annotations

import argparse
import re

import pytest

from ddtree_serve.server.cli.args import config_from_args
from ddtree_serve.server.cli.main import build_parser
from ddtree_serve.server.config import SETTING, config_fields, is_default_path
from ddtree_serve.server.startup import resolve_config


def _help_defaults(command: str) -> dict[str, str]:
    """Flag dest -> the text of its ``(default: ...)``, from the help as printed (wrapped lines joined)."""
    parser, _ = build_parser()
    sub = parser._subparsers._group_actions[0].choices[command]
    text = sub.format_help()
    out = {}
    for action in sub._actions:
        flag = next((o for o in action.option_strings if o.startswith("--")), None)
        if flag is None or action.help is None or action.dest == "help":
            continue
        block = re.search(rf"\n  {re.escape(flag)}[ ,\n].*?(?=\n  -|\n\n|\Z)", text, re.S)
        assert block, flag
        shown = " ".join(block.group(0).split())
        m = re.search(r"\(default: (.*)\)$", shown)
        assert m, f"{flag}: no default shown in {shown!r}"
        out[action.dest] = m.group(1)
    return out


def _serve_config(argv: list[str]):
    parser, _ = build_parser()
    return config_from_args(parser.parse_args(["serve", *argv]))


def test_every_literal_default_shown_is_the_one_that_runs() -> None:
    shown = _help_defaults("serve")
    config = _serve_config([])  # what `ddtree-serve serve` with no flags runs ('default' and 'auto' as given)
    for flat, area, _, f in config_fields():
        meta = f.metadata[SETTING]
        assert meta.default_help or f.default is not None, f"{flat}: help would show 'None'"
        if meta.default_help is None:
            assert shown[flat] == repr(getattr(getattr(config, area), f.name)), flat
        else:
            assert shown[flat] == meta.default_help and "None" not in shown[flat], flat


def test_effective_defaults_of_speculation(tmp_path, default_model_path) -> None:
    """The default model runs ddtree with its shipped drafter; any other model runs without speculation:
    what --help says for --speculative-algorithm and --speculative-draft-model-path."""
    shown = _help_defaults("serve")
    default = _serve_config([])
    assert default.speculative.algorithm == "ddtree" and shown["speculative_algorithm"].startswith("'ddtree'")
    assert is_default_path(default.speculative.draft_model_path)
    assert shown["speculative_draft_model_path"].startswith("'default'")
    resolved = resolve_config(default)
    assert resolved.speculative.uses_drafter and resolved.speculative.draft_sources == "dflash,suffix"
    other = _serve_config(["--model-path", default_model_path])
    assert other.speculative.algorithm == "none" and "'none' for any other model" in shown["speculative_algorithm"]
    assert other.speculative.draft_model_path is None


def test_budget_help_matches_what_the_flag_accepts() -> None:
    shown = " ".join(build_parser()[0]._subparsers._group_actions[0].choices["serve"].format_help().split())
    budget = re.search(r"--speculative-ddtree-budget BUDGET (.*?)\(default", shown).group(1)
    assert "integer >= 1" in budget and "0 =" not in budget
    parser = argparse.ArgumentParser()
    from ddtree_serve.server.cli.args import add_server_arguments

    add_server_arguments(parser)
    for bad in ("0", "-1"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--speculative-ddtree-budget", bad])
    assert parser.parse_args(["--speculative-ddtree-budget", "1"]).speculative_ddtree_budget == 1


def test_plan_help_shows_serves_defaults_and_its_own() -> None:
    serve, plan = _help_defaults("serve"), _help_defaults("plan")
    assert {k: plan[k] for k in serve} == serve  # the same flags, the same defaults
    assert plan["overhead_gb"] == "2.0" and plan["gpu_memory_gb"].startswith("the --machine class's")
    assert _serve_config([]) == config_from_args(build_parser()[0].parse_args(["plan"]))
