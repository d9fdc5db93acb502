"""Command-line flags generated from config dataclasses, so no default exists twice.

A config is a dataclass whose fields carry ``metadata={"help": ...}``; nested dataclass fields are
flattened with an optional prefix (``--adv-scale``). Flags are kebab-case; booleans get
``--flag/--no-flag``. ``--config run.toml`` (or .yaml / .json, a saved config.json too) reads settings from a file
(``align.run.config_file``); flags given on the command line override it. ``--help`` and errors: ``align.run.help``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import signal
import sys
import typing
from collections.abc import Callable
from typing import Any

from align.run.fields import _comma_tuple, _flags, _list_item_type, check_value, hints_of


def build_parser(cls: type, prefixes: dict[str, str], description: str = "") -> argparse.ArgumentParser:
    from align.run.help import Parser, section_of

    parser = Parser(description=description)
    parser.add_argument(
        "--config",
        default=None,
        help="Read settings from a .toml, .yaml/.yml or .json file (a saved config.json too); flags given here win.",
    )
    seen: set[str] = set()
    defaults = dataclasses.asdict(cls())
    groups: dict[str, Any] = {}
    for flag, path, f, tp in sorted(_flags(cls, prefixes), key=lambda e: section_of(e[1]) != "run"):
        section = section_of(path)
        if section not in groups:
            groups[section] = parser.add_argument_group(section)
        group = groups[section]
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
            group.add_argument(f"--{flag}", action=argparse.BooleanOptionalAction, **kw)
        elif tp is list:
            # metadata {"action": "extend"}: the flag may be repeated (--reward a --reward b)
            group.add_argument(
                f"--{flag}",
                nargs="*",
                type=_list_item_type(hints_of(path, cls)),
                action=f.metadata.get("action", "store"),
                **kw,
            )
        elif tp is dict:
            group.add_argument(f"--{flag}", type=json.loads, **kw)
        elif tp is tuple:  # a comma list: --lean-banned native_decide,#exit
            group.add_argument(f"--{flag}", type=_comma_tuple, **kw)
        else:
            group.add_argument(f"--{flag}", type=tp, **kw)
    return parser


def read_sections(config: Any) -> None:
    """Turn each nested section of the config dataclass ``config`` (``loss``, ``eval``, ...: a field typed with a
    dataclass) that holds a dict (``loss={"eps_high": 0.2}``, a ``--config`` file's) into that dataclass, by
    ``from_dict``: unknown keys and mistyped values refused by name ('loss.')."""
    for name, cls in _sections(type(config)).items():
        if isinstance(getattr(config, name), dict):
            setattr(config, name, from_dict(cls, getattr(config, name), f"{name}."))


@functools.cache
def _sections(cls: type) -> dict[str, type]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if dataclasses.is_dataclass(hints[f.name])}


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
    """A ``--config`` file's top-level mapping (TOML, YAML or JSON: ``align.run.config_file``)."""
    from align.run.config_file import read_file

    return read_file(path)


def parse(
    cls: type, argv: list[str] | None, prefixes: dict[str, str], description: str = "", preset: frozenset = frozenset()
) -> Any:
    """Parse ``argv`` into a ``cls`` instance: defaults < the built-in task's and the backend's (``cls.default_layers``) <
    ``--config`` file < flags (``preset``: the dotted fields whose flags a preset added). Each field's layer is
    recorded on the instance (``align.run.sources``)."""
    from align.run import sources

    parser = build_parser(cls, prefixes, description)
    args = vars(parser.parse_args(_signed_words_joined(sys.argv[1:] if argv is None else argv)))
    base: dict[str, Any] = dataclasses.asdict(cls())
    src: dict[str, str] = {}
    config_path = args.pop("config", None)
    if config_path:
        try:
            from align.run.config_file import load

            loaded = load(config_path, cls, prefixes)
        except ValueError as e:
            parser.error(str(e))
        base = _merge(base, loaded)
        src.update(dict.fromkeys(_dotted(loaded, set(sources.flatten(cls()))), "file"))
    for dest, value in args.items():
        _put(base, dest.split("/"), value)
        dotted = dest.replace("/", ".")
        src[dotted] = "preset" if dotted in preset else "flag"
    layers = getattr(cls, "default_layers", None)
    for label, layer in layers(base) if layers else []:
        for dotted, value in layer.items():
            if dotted not in src:
                _put(base, dotted.split("."), value)
                src[dotted] = label
    try:
        return sources.record(from_dict(cls, base), src)
    except (ValueError, TypeError) as e:
        parser.error(str(e))


def _signed_words_joined(argv: list[str]) -> list[str]:
    """``--flag -inf`` as ``--flag=-inf`` (also ``-nan``, ``-infinity``): argparse reads a word that starts with '-'
    and is no negative number as a flag, so the value's own check (finite, >= 0) never ran and the error named
    nothing useful."""
    out: list[str] = []
    for a in argv:
        if out and out[-1].startswith("--") and "=" not in out[-1] and a.lower() in ("-inf", "-infinity", "-nan"):
            out[-1] = f"{out[-1]}={a}"
        else:
            out.append(a)
    return out


def _put(node: dict, path: list[str], value: Any) -> None:
    for p in path[:-1]:
        node = node[p]
    node[path[-1]] = value


def _dotted(d: dict, leaves: set[str], prefix: str = "") -> list[str]:
    """The dotted fields set in a nested dict (a dict-valued field is one leaf)."""
    out: list[str] = []
    for k, v in d.items():
        leaf = prefix + k in leaves or not isinstance(v, dict)
        out += [prefix + k] if leaf else _dotted(v, leaves, f"{prefix}{k}.")
    return out


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(base[k], v) if isinstance(v, dict) and isinstance(base.get(k), dict) else v
    return out


# ------------------------------------------------------------------------------------------------ a main()'s shape


SIGNAL_EXIT = {signal.SIGTERM: 143, signal.SIGINT: 130}  # the shell's exit codes
STALL_EXIT = 3  # the watchdog ended a run that stopped making progress (align.run.watchdog)


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
    cannot resume, and ``usage_errors``; 1: --max-nonfinite-steps reached; 3: a stall; 143 / 130: a signal), ``report(summary)``
    on rank 0."""
    import logging
    import sys

    from align.atomic import LockHeldError
    from align.dist import is_main
    from align.errors import InputError, Interrupted
    from align.learner import NonFiniteError
    from align.run.checkpoint import CheckpointError

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = parse_cfg()
    stop_flag: dict = {"prog": prog}  # the watchdog's error line names it too
    old = stop_on_signals(stop_flag)
    try:
        summary = train(cfg, stop_flag=stop_flag)
    except (InputError, CheckpointError, LockHeldError, *usage_errors) as e:  # bad input, a resume refused, --out held
        print(f"{prog}: error: {e}", file=sys.stderr, flush=True)
        return 2
    except Interrupted as e:  # a signal during setup; the run's parts are closed (open_run, ``with run``)
        return STALL_EXIT if stop_flag.get("stall") else SIGNAL_EXIT[e.signum]
    except NonFiniteError as e:  # --max-nonfinite-steps reached; the last checkpoint is intact
        print(f"{prog}: error: {e}", file=sys.stderr, flush=True)
        return 1
    except Exception:
        if stop_flag.get("stall"):  # a rollout worker stopped (Watchdog.worker_stopped): its line and stall.txt are out
            return STALL_EXIT
        raise
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    if stop_flag.get("stall"):  # the watchdog ended the run at a safe point (align.run.watchdog); its line is out
        return STALL_EXIT
    if is_main():  # torchrun: one summary line
        report(summary)
    return SIGNAL_EXIT[summary["interrupted"]] if summary["interrupted"] else 0
