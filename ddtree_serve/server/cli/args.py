"""Command-line flags of ``ddtree-serve serve`` (SGLang names), over an optional YAML preset.

The flags are built from the configuration fields (ddtree_serve/server/config.py): one flag per field, named
``--`` + its flat name with ``-`` for ``_``, its help, choices and range taken from the field's
``Setting``. ``--config preset.yaml`` holds flat keys (``ServerConfig.from_flat``); flags given on the
command line override the preset.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ddtree_serve.server.config import (
    SETTING,
    ServerConfig,
    check_value,
    config_fields,
    field_kinds,
    is_default_path,
)


def config_field_names() -> set[str]:
    """Flat names of every ServerConfig field (what --config YAML keys and flags map to)."""
    return {flat for flat, *_ in config_fields()}


def flag_names() -> set[str]:
    """Dest names of the configuration flags the parser really has (``--config`` aside)."""
    parser = argparse.ArgumentParser(add_help=False)
    add_server_arguments(parser)
    return {a.dest for a in parser._actions if a.dest != "config"}


def _parse_text(klass: type, f: dataclasses.Field) -> Callable[[str], Any]:
    """The argparse ``type`` of a field: text -> value by the annotation, checked like ``__post_init__``."""
    kinds, _ = field_kinds(klass, f.name)
    choices = f.metadata[SETTING].choices

    def parse(text: str) -> Any:
        value: Any = text
        for kind in (int, float) if not (choices and text in choices) else ():
            if kind in kinds:
                try:
                    value = kind(text)
                    break
                except ValueError:
                    continue
        try:
            return check_value(klass, f.name, value)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return parse


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=str, default=None, metavar="YAML",
                        help="YAML preset of flat config keys (e.g. configs/kimi-k2.6-8x-b300.yaml); flags override it. "
                             "(default: none)")
    for dest, _, klass, f in config_fields():
        meta = f.metadata[SETTING]
        flag = "--" + dest.replace("_", "-")
        shown = f"{meta.help} (default: {meta.default_help or repr(f.default)})"
        kinds, _ = field_kinds(klass, f.name)
        if kinds == (bool,):
            parser.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction,
                                default=argparse.SUPPRESS, help=shown)
            continue
        text_choices = meta.choices if kinds == (str,) else None  # argparse lists them in --help
        parser.add_argument(flag, dest=dest, type=_parse_text(klass, f), choices=text_choices,
                            default=argparse.SUPPRESS, help=shown,
                            metavar=None if text_choices else dest.split("_")[-1].upper())


def load_yaml(path: str) -> dict[str, Any]:
    import yaml

    data = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a config preset must be a mapping of flat keys")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    """YAML preset (if any), then the flags given on the command line, into one validated ServerConfig."""
    flat: dict[str, Any] = load_yaml(args.config) if getattr(args, "config", None) else {}
    known = config_field_names()
    given = {key: value for key, value in vars(args).items() if key in known}
    if given.get("speculative_ddtree_budget", "auto") != "auto" and "speculative_ddtree_max_budget" not in given:
        flat.pop("speculative_ddtree_max_budget", None)  # a fixed budget flag replaces the preset's auto bound
    flat.update(given)
    apply_default_speculation(flat)
    return ServerConfig.from_flat(flat)


def apply_default_speculation(flat: dict[str, Any]) -> None:
    """The default model is served with DDTree and its shipped drafter unless the user chose an algorithm."""
    if not is_default_path(flat.get("model_path")) or "speculative_algorithm" in flat:
        return
    from ddtree_serve.model_executor.default_drafter import default_drafter_path

    try:
        default_drafter_path()
    except FileNotFoundError:
        return
    flat["speculative_algorithm"] = "ddtree"
    flat.setdefault("speculative_draft_model_path", "default")
