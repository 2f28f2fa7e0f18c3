"""Command-line flags generated from the config dataclasses, so that a setting is named,
typed, defaulted and explained once (in `EngineConfig` / `GatewayConfig`, via `option`).

A field `max_num_seqs: int = option(32, "...")` becomes `--max-num-seqs N`; `X | None` fields
default to None; a bool that defaults to True becomes `--no-<name>` (`enable_` dropped:
`enable_prefix_cache` -> `--no-prefix-cache`), one that defaults to False `--<name>`; a tuple
takes zero or more values (with `repeat`: one per use of the flag). Metadata may rename the
flag, give choices, accept sizes (2GiB) or name an environment variable that supplies the
default.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import types
import typing
from typing import Any, TypeVar

T = TypeVar("T")

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """'4GiB', '512M', '1.5g', '1000000' -> bytes (K/M/G/T are powers of 1024)."""
    match = _SIZE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 2GiB or 512M)")
    number, unit = float(match.group(1)), match.group(2).lower()
    return int(number * 1024 ** " kmgt".index(unit or " "))


def add_config_args(
    parser: argparse.ArgumentParser, config_type: type[Any], title: str, skip: tuple[str, ...] = ()
) -> None:
    """One flag per documented field of the dataclass `config_type` (fields in `skip` and
    fields without `option` help are left out), in a group called `title`."""
    group = parser.add_argument_group(title)
    hints = typing.get_type_hints(config_type)
    for field in _documented_fields(config_type, skip):
        group.add_argument(*_flag_names(field), **_argument(field, hints[field.name]))


def config_from_args(
    config_type: type[T], args: argparse.Namespace, skip: tuple[str, ...] = (), **extra: Any
) -> T:
    """Build `config_type` from the parsed flags of `add_config_args`, plus `extra` fields."""
    values = {f.name: getattr(args, f.name) for f in _documented_fields(config_type, skip)}
    for field in _documented_fields(config_type, skip):
        if field.metadata.get("repeat") and values[field.name] is None:
            values[field.name] = _default_values(field)
    for name, value in values.items():
        if isinstance(value, list):
            values[name] = tuple(value)
    return config_type(**values, **extra)


def _documented_fields(config_type: type[Any], skip: tuple[str, ...]) -> list[Any]:
    return [
        f for f in dataclasses.fields(config_type) if "help" in f.metadata and f.name not in skip
    ]


def _flag_names(field: Any) -> list[str]:
    if "flag" in field.metadata:
        return [field.metadata["flag"]]
    name = field.name.replace("_", "-")
    if field.default is True:
        return ["--no-" + name.removeprefix("enable-")]
    return ["--" + name]


def _argument(field: Any, hint: Any) -> dict[str, Any]:
    meta = field.metadata
    default = os.environ.get(meta["env"], field.default) if "env" in meta else field.default
    argument: dict[str, Any] = {"dest": field.name, "default": default, "help": meta["help"]}
    base = _without_none(hint)
    if base is bool:
        return {**argument, "action": "store_false" if field.default else "store_true"}
    if typing.get_origin(base) is tuple:
        if meta.get("repeat"):  # None: not given (argparse would append to a default list)
            return {**argument, "action": "append", "default": None, "metavar": "VALUE"}
        return {**argument, "nargs": "*", "default": list(default), "metavar": "VALUE"}
    if "choices" in meta:
        argument["choices"] = meta["choices"]
    argument["type"] = parse_size if meta.get("size") else base
    if default is not None and "default" not in meta["help"]:
        argument["help"] += f" (default: {default})"
    return argument


def _default_values(field: Any) -> list[Any]:
    """A repeatable flag's values when it is not given: its environment variable's (one
    value), else the field's default."""
    env = field.metadata.get("env")
    if env is not None and os.environ.get(env):
        return [os.environ[env]]
    return list(field.default)


def _without_none(hint: Any) -> Any:
    if isinstance(hint, types.UnionType):
        (base,) = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        return base
    return hint
