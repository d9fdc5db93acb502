"""Command-line flags generated from config dataclasses, so no default exists twice.

A config is a dataclass whose fields carry ``metadata={"help": ...}``; nested dataclass fields are
flattened with an optional prefix (``--adv-scale``). Flags are kebab-case; booleans get
``--flag/--no-flag``. ``--config run.json`` reloads a saved config; flags given on the command line
override it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import types
import typing
from collections.abc import Callable
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


def build_parser(cls: type, prefixes: dict[str, str], description: str = "") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", default=None, help="Reload a saved config.json (flags given here override it).")
    seen: set[str] = set()
    defaults = dataclasses.asdict(cls())
    for flag, path, f, tp in _flags(cls, prefixes):
        if flag in seen:
            raise RuntimeError(f"two config fields map to --{flag}; give one of them a prefix")
        seen.add(flag)
        default = defaults
        for p in path:
            default = default[p]
        kw: dict[str, Any] = {
            "dest": "/".join(path),
            "default": argparse.SUPPRESS,
            "help": f.metadata.get("help", ""),
            "metavar": None if tp is bool else f.name.upper(),
        }
        kw["help"] += f" (default: {default!r})"
        if tp is bool:
            parser.add_argument(f"--{flag}", action=argparse.BooleanOptionalAction, **kw)
        elif tp is list:
            # metadata {"action": "extend"}: the flag may be repeated (--reward a --reward b)
            parser.add_argument(
                f"--{flag}",
                nargs="*",
                type=_list_item_type(hints_of(path, cls)),
                action=f.metadata.get("action", "store"),
                **kw,
            )
        elif tp is dict:
            parser.add_argument(f"--{flag}", type=json.loads, **kw)
        elif tp is tuple:  # a comma list: --lean-banned native_decide,#exit
            parser.add_argument(f"--{flag}", type=_comma_tuple, **kw)
        else:
            parser.add_argument(f"--{flag}", type=tp, **kw)
    return parser


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


def check_value(key: str, value: Any, tp: Any) -> Any:
    """``value`` checked against the annotation ``tp`` (JSON types: no implicit conversion); returns it with
    an int widened to float where a float is expected. Raises ValueError naming the key, type and value."""

    def fail() -> ValueError:
        return ValueError(f"config key {key!r} must be {_type_name(tp)}, got {value!r} ({type(value).__name__})")

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


def from_dict(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    """Build a (nested) config dataclass from a dict, rejecting unknown keys and mistyped values by name.

    Types come from the dataclass annotations: bool only from true/false, int not from a float or bool,
    float from an int or float, lists item by item, ``X | None`` also from null, nested sections only from
    objects. ``prefix`` names the section in messages ('loss.')."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"unknown {cls.__name__} field(s) {unknown}; known: {sorted(names)}")
    kw = {}
    for k, v in data.items():
        v = check_value(prefix + k, v, hints[k])
        kw[k] = (
            from_dict(hints[k], v, f"{prefix}{k}.") if dataclasses.is_dataclass(hints[k]) and isinstance(v, dict) else v
        )
    return cls(**kw)


def load_config_file(path: str) -> dict:
    """A ``--config`` file: a UTF-8 JSON object (a saved ``config.json``); ValueError naming the file (and line)."""
    try:
        with open(path, "rb") as fh:
            raw = fh.read()
    except OSError as e:
        raise ValueError(f"--config {path}: {e.strerror or e}") from None
    try:
        loaded = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise ValueError(f"--config {path}:{line}: not UTF-8 text (byte {raw[e.start : e.start + 1]!r})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"--config {path}:{e.lineno}: not valid JSON ({e.msg})") from None
    if not isinstance(loaded, dict):
        raise ValueError(  # noqa: TRY004 -- a bad file, reported as one argparse error
            f"--config {path}: the top level must be a JSON object of settings (as in a saved config.json), "
            f"got a {type(loaded).__name__}"
        )
    return loaded


def parse(cls: type, argv: list[str] | None, prefixes: dict[str, str], description: str = "") -> Any:
    """Parse ``argv`` into a ``cls`` instance: defaults < ``--config`` file < flags."""
    parser = build_parser(cls, prefixes, description)
    args = vars(parser.parse_args(argv))
    base: dict[str, Any] = dataclasses.asdict(cls())
    config_path = args.pop("config", None)
    if config_path:
        try:
            loaded = load_config_file(config_path)
        except ValueError as e:
            parser.error(str(e))
        base = _merge(base, loaded)
    for dest, value in args.items():
        node = base
        *parents, leaf = dest.split("/")
        for p in parents:
            node = node[p]
        node[leaf] = value
    try:
        return from_dict(cls, base)
    except (ValueError, TypeError) as e:
        parser.error(str(e))


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(base[k], v) if isinstance(v, dict) and isinstance(base.get(k), dict) else v
    return out


# ------------------------------------------------------------------------------------------------ a main()'s shape


SIGNAL_EXIT = {signal.SIGTERM: 143, signal.SIGINT: 130}  # the shell's exit codes


def stop_on_signals(stop_flag: dict) -> dict:
    """SIGTERM / SIGINT handlers for a training loop: before the loop (``stop_flag["loop"]`` unset) a signal raises
    ``Interrupted``; in it, the loop finishes the step, checkpoints and returns; a second signal stops at once.
    Returns the previous handlers (restore them with ``signal.signal``)."""
    from align.rewards import Interrupted

    def on_signal(signum: int, frame: Any) -> None:
        if stop_flag.get("signal"):  # second signal: stop now
            raise KeyboardInterrupt
        stop_flag["signal"] = signum
        if not stop_flag.get("loop"):  # setup (warm start, data, templates, model load): nothing to save yet
            print(f"\n[align] got signal {signum} before the first step: exiting", flush=True)
            raise Interrupted(signum)
        print(f"\n[align] got signal {signum}: finishing this step, writing a checkpoint, then exiting", flush=True)

    return {s: signal.signal(s, on_signal) for s in SIGNAL_EXIT}


def run_main(
    prog: str,
    parse_cfg: Callable[[], Any],
    train: Callable[..., dict],
    report: Callable[[dict], None],
    usage_errors: tuple[type[BaseException], ...] = (),
) -> int:
    """The one shape of ``python -m align.train`` and ``python -m align.sft``: logging, ``parse_cfg()``, the signal
    handlers around ``train(cfg, stop_flag=...)``, its errors mapped to exit codes (2: bad input or a checkpoint that
    cannot resume, and ``usage_errors``; 1: --max-nonfinite-steps reached; 143 / 130: a signal), ``report(summary)``
    on rank 0."""
    import logging
    import sys

    from align.data import InputError
    from align.dist import is_main
    from align.learner import NonFiniteError
    from align.rewards import Interrupted
    from align.run.checkpoint import CheckpointError

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = parse_cfg()
    stop_flag: dict = {}
    old = stop_on_signals(stop_flag)
    try:
        summary = train(cfg, stop_flag=stop_flag)
    except (InputError, CheckpointError, *usage_errors) as e:  # bad input (before the model loads), a resume refused
        print(f"{prog}: error: {e}", file=sys.stderr, flush=True)
        return 2
    except Interrupted as e:  # a signal during setup; the run's parts are closed (open_run, ``with run``)
        return SIGNAL_EXIT[e.signum]
    except NonFiniteError as e:  # --max-nonfinite-steps reached; the last checkpoint is intact
        print(f"{prog}: error: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    if is_main():  # torchrun: one summary line
        report(summary)
    return SIGNAL_EXIT[summary["interrupted"]] if summary["interrupted"] else 0
