"""Dataclass configs from TOML files and `--section.key=value` flags, whatever the config.

A TOML file's tables and the command line's dotted flags meet as one flat mapping
(`"section.key" -> value`); each value is then converted to the type its dataclass field
declares, so `--train.steps=7` and `steps = 7` under `[train]` are the same setting. A mistake is a
`ConfigError` naming the key, the value and what was expected. megabeta.config applies this to
the run's sections.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import os
import sys
import types
import typing
from collections.abc import Iterable, Mapping
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # the same parser, from PyPI (pyproject's tomli dependency for Python 3.10)
    import tomli as tomllib

from megabeta.model.config import ConfigError


def read_toml(path: str | os.PathLike) -> dict[str, Any]:
    """The TOML file at `path`; ConfigError naming it when it is not valid TOML (a missing file
    raises FileNotFoundError: the caller knows what to suggest instead)."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"config file {path} is not valid TOML: {err}") from None


def flatten(table: Mapping[str, Any]) -> dict[str, Any]:
    """`{"section": {"key": v}, "top": w}` -> `{"section.key": v, "top": w}`."""
    flat: dict[str, Any] = {}
    for key, value in table.items():
        if isinstance(value, dict):
            flat.update({f"{key}.{sub}": v for sub, v in value.items()})
        else:
            flat[key] = value
    return flat


def parse_overrides(overrides: Iterable[str]) -> dict[str, str]:
    """`["--section.key=value", "--key=value"]` -> `{"section.key": "value", "key": "value"}`
    (strings, converted later by `typed_tables`)."""
    flat: dict[str, str] = {}
    for item in overrides:
        key, sep, value = item.removeprefix("--").partition("=")
        if not sep:
            raise ConfigError(f"override {item!r} must look like --section.key=value")
        flat[key] = value
    return flat


def renamed(flat: Mapping[str, Any], renames: Mapping[str, str]) -> dict[str, Any]:
    """`flat` with the keys of `renames` under their new names (both given: an error naming
    them)."""
    out = {}
    for key, value in flat.items():
        new = renames.get(key, key)
        if new in out or (new != key and new in flat):
            raise ConfigError(f"config keys {key!r} and {new!r} are the same setting (renamed "
                              f"{new!r}): keep one")
        out[new] = value
    return out


def unknown_key(name: str, known: Iterable[str]) -> ConfigError:
    """The error for a key no section has: the closest known key, else all of them."""
    known = list(known)
    close = difflib.get_close_matches(name, known, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else f"; known: {', '.join(sorted(known))}"
    return ConfigError(f"unknown config key {name!r}{hint}")


def field_types(cls: type) -> dict[str, Any]:
    """A dataclass's field names -> their declared types (annotations resolved)."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def typed_tables(flat: Mapping[str, Any], kinds: Mapping[str, Any]
                 ) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """(section tables, top-level keys) of `flat`, each value converted to its type in `kinds`
    (`"section.key"` or `"key"` -> type); a key not in `kinds` is an error."""
    tables: dict[str, dict[str, Any]] = {}
    top: dict[str, Any] = {}
    for key, value in flat.items():
        if key not in kinds:
            raise unknown_key(key, kinds)
        typed = coerce(value, kinds[key], key)
        if "." in key:
            section, name = key.split(".", 1)
            tables.setdefault(section, {})[name] = typed
        else:
            top[key] = typed
    return tables, top


def coerce(value: Any, kind: Any, name: str) -> Any:
    """Convert a TOML value or CLI string to the field's declared type."""
    origin = typing.get_origin(kind)
    if origin in (typing.Union, types.UnionType):
        options = [k for k in typing.get_args(kind) if k is not type(None)]
        if isinstance(value, str) and value.lower() in ("none", "null", ""):
            return None
        return coerce(value, options[0], name)
    if origin is list:
        (item,) = typing.get_args(kind)
        if isinstance(value, str) and value.strip().startswith("["):
            # The TOML spelling of a list, as the config file has it: ["a", "b"].
            try:
                value = tomllib.loads(f"value = {value}")["value"]
            except tomllib.TOMLDecodeError as err:
                raise ConfigError(f"{name} = {value}: not a TOML list ({err}); or give the "
                                  "items comma-separated: a,b") from None
        elif isinstance(value, str):
            value = [v for v in value.split(",") if v.strip()]
        if not isinstance(value, list):
            raise ConfigError(f"{name} = {value!r}: expected a list (comma-separated on the CLI)")
        return [coerce(v, item, name) for v in value]
    try:
        if kind is bool:
            if isinstance(value, bool):
                return value
            if str(value).lower() in ("1", "true", "yes", "on"):
                return True
            if str(value).lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if kind is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
        if kind is float:
            return float(value)
        if kind is str:
            return str(value)
    except ValueError:
        raise ConfigError(f"{name} = {value!r}: expected {kind.__name__}") from None
    raise ConfigError(f"{name}: unsupported field type {kind}")


def field_docs(classes: Iterable[type]) -> dict[tuple[str, str], str]:
    """(class name, field) -> the first line of the docstring under the field, read from the
    source (how every config field documents itself)."""
    docs: dict[tuple[str, str], str] = {}
    for cls in classes:
        tree = ast.parse(inspect.getsource(cls))
        body = tree.body[0].body
        for node, nxt in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr)
                    and isinstance(nxt.value, ast.Constant)):
                docs[(cls.__name__, node.target.id)] = str(nxt.value.value).split("\n")[0]
    return docs
