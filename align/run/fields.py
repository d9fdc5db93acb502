"""A config dataclass's fields as flags: their types, their kebab-case names, and the check of a value read from a
file or a flag (``align.run.cli`` builds the parser from them, ``align.run.config_file`` checks a file against them).
"""

from __future__ import annotations

import dataclasses
import reprlib
import types
import typing
from typing import Any


def _base_type(tp: Any) -> Any:
    """``int | None`` -> int; ``list[int]`` -> list."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _base_type(args[0])
    return origin or tp


def _list_item_type(tp: Any) -> type:
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    while args and typing.get_origin(args[0]) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(args[0]) if a is not type(None)]
    inner = typing.get_args(args[0]) if args and typing.get_origin(args[0]) is list else typing.get_args(tp)
    return inner[0] if inner else str


def hints_of(path: tuple[str, ...], cls: type) -> Any:
    """The type hint of the (nested) field at ``path``."""
    for p in path[:-1]:
        cls = typing.get_type_hints(cls)[p]
    return typing.get_type_hints(cls)[path[-1]]


def _flags(cls: type, prefixes: dict[str, str], path: tuple[str, ...] = ()) -> list[tuple[str, tuple, Any, Any]]:
    """[(flag, field path, field)] for every leaf field of ``cls``."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if f.name.startswith("_"):
            continue
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            out += _flags(tp, prefixes, path + (f.name,))
            continue
        prefix = prefixes.get(".".join(path), "")
        name = f.name.replace("_", "-")
        flag = path[-1] if (f.name == "name" and path) else prefix + name  # LossConfig.name -> --loss
        out.append((flag, path + (f.name,), f, _base_type(tp)))
    return out


def _comma_tuple(text: str) -> tuple[str, ...]:
    return tuple(w.strip() for w in text.split(",") if w.strip())


def _type_name(tp: Any) -> str:
    if tp is type(None):
        return "null"
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin in (list, tuple):
        args = typing.get_args(tp)
        return f"list of {_type_name(args[0])}" if args else "list"
    if dataclasses.is_dataclass(tp):
        return f"object ({tp.__name__} section)"
    return {bool: "bool (true/false)", int: "int", float: "float", str: "str", dict: "object"}.get(tp, str(tp))


def _short(value: Any) -> str:
    """``repr(value)`` cut short: a YAML alias bomb is a small file whose full repr is gigabytes."""
    r = reprlib.Repr()
    r.maxlevel, r.maxlist, r.maxdict, r.maxstring, r.maxother = 3, 6, 6, 80, 80
    return r.repr(value)


def check_value(key: str, value: Any, tp: Any) -> Any:
    """``value`` checked against the annotation ``tp`` (JSON types: no implicit conversion); returns it with
    an int widened to float where a float is expected. Raises ValueError naming the key, type and value."""

    def fail() -> ValueError:
        return ValueError(f"config key {key!r} must be {_type_name(tp)}, got {_short(value)} ({type(value).__name__})")

    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            if arg is type(None):
                if value is None:
                    return None
                continue
            try:
                return check_value(key, value, arg)
            except ValueError:
                pass
        raise fail()
    if origin is list or tp is list:
        if not isinstance(value, list):
            raise fail()
        args = typing.get_args(tp)
        return [check_value(f"{key}[{i}]", v, args[0]) for i, v in enumerate(value)] if args else value
    if origin is tuple:  # tuple[X, ...]: a JSON list (config.json) or a tuple (defaults, flags)
        if not isinstance(value, (list, tuple)):
            raise fail()
        return tuple(check_value(f"{key}[{i}]", v, typing.get_args(tp)[0]) for i, v in enumerate(value))
    if tp is bool:
        if not isinstance(value, bool):
            raise fail()
    elif tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise fail()
    elif tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise fail()
        return float(value)
    elif tp is str or tp is dict:
        if not isinstance(value, tp):
            raise fail()
    elif dataclasses.is_dataclass(tp) and not isinstance(value, (dict, tp)):
        raise fail()
    return value
