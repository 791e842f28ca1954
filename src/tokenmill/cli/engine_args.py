"""Engine flags generated from the config dataclasses, so every field is a flag with its help."""

from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any

from tokenmill.config import SECTIONS


def _flag_type(annotation: Any) -> Any:
    text = str(annotation)
    for name, kind in (("int", int), ("float", float), ("str", str)):
        if name in text:
            return kind
    return str


def add_dataclass_args(parser: argparse.ArgumentParser, klass: type, title: str,
                       skip: tuple[str, ...] = ()) -> None:
    """Add one --flag per field of config dataclass `klass`, with the field's help and default."""
    group = parser.add_argument_group(title)
    hints = typing.get_type_hints(klass)
    for f in dataclasses.fields(klass):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else None
        help_text = f"{f.metadata.get('help', '')} (default: {default})"
        if hints[f.name] in (bool, typing.Optional[bool]):
            group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=default,
                               help=help_text)
            continue
        group.add_argument(flag, dest=f.name, type=f.metadata.get("parse") or _flag_type(hints[f.name]), default=default,
                           choices=f.metadata.get("choices"), nargs=f.metadata.get("nargs"), help=help_text)


def add_engine_args(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """Add one --flag per engine config field (`skip` names fields given another way)."""
    for name, klass in SECTIONS.items():
        add_dataclass_args(parser, klass, f"engine options: {name}", skip)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine keywords present in parsed `args`."""
    names = {f.name for klass in SECTIONS.values() for f in dataclasses.fields(klass)}
    return {k: v for k, v in vars(args).items() if k in names}
