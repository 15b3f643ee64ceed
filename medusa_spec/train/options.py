"""The argparse flags built from a config dataclass's fields (fields.py), and the config resolved from them.

Defaults live once, in the dataclass. A command's settings come from a recipe (--config FILE.json,
one section per command) overridden by the flags given on the command line. A field made with `shared`
is an option other subcommands take too (medusa_spec.flags): its flag, type and help are defined there.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import typing
from pathlib import Path

from ..config import read_json_object
from ..flags import add_flag


def _old_keys(cls) -> dict[str, str]:
    """{old recipe key: field name} from the fields' flag aliases ("--output-dir" was the key "output_dir")."""
    return {alias.removeprefix("--").replace("-", "_"): f.name
            for f in dataclasses.fields(cls) for alias in f.metadata.get("aliases", ())}


def add_options(parser: argparse.ArgumentParser, cls) -> None:
    """One --flag per field of `cls`; only flags given on the command line land in the namespace."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        if f.metadata.get("shared"):
            add_flag(parser, f.name, default, required=f.metadata.get("required", False), suppress=True,
                     aliases=f.metadata.get("aliases", ()))
            continue
        kind = hints[f.name]
        if typing.get_origin(kind) is not list:  # X | None -> X
            kind = next((a for a in typing.get_args(kind) if a is not type(None)), kind)
        if "head_default" in f.metadata:
            default = f"{f.metadata['head_default']}; with --init-heads, the saved heads'"
        help_text = f.metadata["help"] + ("" if f.metadata.get("required") else f" (default: {default})")
        flag = "--" + f.name.replace("_", "-")
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=help_text)
        elif typing.get_origin(kind) is list:
            item = typing.get_args(kind)[0]
            numbers = item is int  # numbers may be none (an empty list); files, at least one
            parser.add_argument(flag, nargs="*" if numbers else "+", type=item, metavar="N" if numbers else "FILE",
                                default=argparse.SUPPRESS, help=help_text)
        else:
            parser.add_argument(flag, type=kind, choices=f.metadata.get("choices"), default=argparse.SUPPRESS,
                                help=help_text)
    parser.add_argument("--config", metavar="RECIPE.json", help="recipe file; flags given here override it")


def _field_type(kind) -> tuple[object, bool]:
    """A field's type hint as (its type, whether null is allowed): `int | None` -> (int, True)."""
    args = typing.get_args(kind)
    if typing.get_origin(kind) is list or not args:
        return kind, False
    return next(a for a in args if a is not type(None)), type(None) in args


def _is_json(value, kind) -> bool:
    """Whether a recipe's value has the field's type `kind` (int, float, str, bool, list[X], each maybe | None)."""
    base, optional = _field_type(kind)
    if value is None:
        return optional
    if typing.get_origin(base) is list:
        return isinstance(value, list) and all(_is_json(v, typing.get_args(base)[0]) for v in value)
    if base in (int, float):  # JSON's true is no number; an integer is a number
        return isinstance(value, (int, float) if base is float else int) and not isinstance(value, bool)
    return isinstance(value, base)


def _json_type(kind) -> str:
    base, optional = _field_type(kind)
    if typing.get_origin(base) is list:
        return f"an array of {_json_type(typing.get_args(base)[0]).removeprefix('a ').removeprefix('an ')}s"
    name = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(base, str(base))
    return name + (" or null" if optional else "")


def _json_kind(value) -> str:
    return {list: "array", str: "string", bool: "boolean", type(None): "null"}.get(type(value), "number")


def resolve(cls, args: argparse.Namespace, section: str):
    """An instance of `cls` from the recipe's `section`, then the flags given."""
    names = {f.name for f in dataclasses.fields(cls)}
    values = {}
    if getattr(args, "config", None):
        recipe = read_json_object(Path(args.config), fix="--config takes a recipe: a JSON object with one section "
                                  "per command, as in training/recipes/medusa1.json")
        values = recipe.get(section, {})
        if not isinstance(values, dict):  # dict() would fail on it without naming the file or the section
            raise ValueError(f"{args.config}: the recipe's {section!r} section is a JSON {_json_kind(values)}, not an "
                             f"object; write it as {{\"setting\": value, ...}}, the settings named as the flags, with "
                             f"_ for -")
        values = dict(values)
        for old, new in _old_keys(cls).items():  # a recipe written before a rename reads as it did
            if old in values:
                if new in values and values[new] != values[old]:
                    raise ValueError(f"{args.config}: {section!r} sets both {new!r} and its old name {old!r}, to "
                                     f"different values; keep {new!r}")
                values[new] = values.pop(old)
        unknown = sorted(set(values) - names)
        if unknown:
            raise ValueError(f"{args.config}: unknown {section!r} settings {unknown}; the names are those of the "
                             f"flags, with _ for -")
        hints = typing.get_type_hints(cls)
        for name, value in values.items():
            if not _is_json(value, hints[name]):
                raise ValueError(f"{args.config}: the recipe's {section!r} setting {name!r} must be "
                                 f"{_json_type(hints[name])}, got {json.dumps(value)}")
    values.update({k: v for k, v in vars(args).items() if k in names})
    missing = [f.name for f in dataclasses.fields(cls) if f.metadata.get("required") and values.get(f.name) is None]
    if missing:
        flags = ", ".join("--" + m.replace("_", "-") for m in missing)
        raise ValueError(f"{section} needs {flags} (on the command line or in the recipe's {section!r} section)")
    return cls(**values)
