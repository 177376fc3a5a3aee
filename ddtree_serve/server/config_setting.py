"""A configuration field's one definition (docs/DESIGN.md section 5): ``setting(...)`` holds its help text,
allowed values and range (``Setting``) in the dataclass field's metadata; ``Area`` checks every field of an
area against its annotation and ``Setting`` in ``__post_init__``; ``flat_name`` is the one flat-name rule.
ddtree_serve/server/config.py defines the areas with these and re-exports them."""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar

SETTING = "setting"  # the key of a field's ``Setting`` in its dataclass metadata


@dataclass(frozen=True)
class Setting:
    """A field's help text and valid values. ``choices`` lists the allowed values of a text field, or the
    words allowed besides the range for a numeric one (``"auto"``); ``low``/``high`` bound a number
    (``low_open``: ``low`` itself is excluded). ``None`` is valid exactly when the annotation allows it."""

    help: str
    choices: tuple[str, ...] | None = None
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    default_help: str | None = None  # the effective default, where the field's literal one is a placeholder

    def in_range(self, value: float) -> bool:
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or value <= self.high

    def describe(self, kinds: tuple[type, ...], optional: bool) -> str:
        parts = []
        if self.choices:
            parts.append(("one of " if len(self.choices) > 1 else "") + ", ".join(repr(c) for c in self.choices))
        numeric = next((k for k in kinds if k in (int, float)), None)
        if numeric is not None:
            what = "an integer" if numeric is int else "a number"
            if self.low is not None and self.high is not None:
                what += f" in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}]"
            elif self.low is not None:
                what += f" {'>' if self.low_open else '>='} {self.low:g}"
            elif self.high is not None:
                what += f" <= {self.high:g}"
            parts.append(what)
        elif not self.choices:
            parts.append({bool: "true or false", str: "a string"}.get(kinds[0], kinds[0].__name__))
        if optional:
            parts.append("null")
        return " or ".join(parts)


def setting(default: Any, help: str, *, choices: tuple[str, ...] | None = None, low: float | None = None,
            high: float | None = None, low_open: bool = False, default_help: str | None = None) -> Any:
    """A configuration field: its default and its ``Setting`` (the one place its flag is described).
    ``default_help``: what the default does when the literal default stands for something resolved later
    (``None`` = the model's context length, ...); ``--help`` shows it instead of the literal."""
    return field(default=default, metadata={SETTING: Setting(help, choices, low, high, low_open, default_help)})


def field_kinds(cls: type, name: str) -> tuple[tuple[type, ...], bool]:
    """The non-None types a field's annotation allows, and whether it allows None."""
    hint = typing.get_type_hints(cls)[name]
    args = typing.get_args(hint) if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union \
        else (hint,)
    kinds = tuple(a for a in args if a is not type(None))
    return kinds, len(kinds) < len(args)


def check_value(cls: type, name: str, value: Any) -> Any:
    """``value`` if it is valid for field ``name`` of area ``cls`` (a path-like becomes its string), else
    ValueError naming the flat name and what is allowed."""
    meta: Setting = next(f for f in dataclasses.fields(cls) if f.name == name).metadata[SETTING]
    kinds, optional = field_kinds(cls, name)
    if isinstance(value, os.PathLike) and str in kinds:
        value = os.fspath(value)
    if value is None and optional:
        return value
    if isinstance(value, str) and meta.choices is not None and value in meta.choices:
        return value
    if isinstance(value, bool):
        ok = bool in kinds
    elif isinstance(value, int | float):
        ok = (float in kinds or (int in kinds and isinstance(value, int))) and meta.in_range(value)
    else:
        ok = isinstance(value, str) and str in kinds and meta.choices is None
    if not ok:
        raise ValueError(f"{cls.PREFIX}{name} must be {meta.describe(kinds, optional)}; got {value!r}")
    return value


class Area:
    """Base of the per-area dataclasses: ``PREFIX`` starts every flat name of the area, and
    ``__post_init__`` checks every field against its annotation and ``Setting``."""

    PREFIX: ClassVar[str] = ""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            checked = check_value(type(self), f.name, value)
            if checked is not value:
                object.__setattr__(self, f.name, checked)


def flat_name(area: type[Area], name: str) -> str:
    """The one flat-name rule: area prefix + field name (``speculative_`` follows SGLang's flags)."""
    return area.PREFIX + name
