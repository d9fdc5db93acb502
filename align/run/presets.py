"""Algorithm presets: ``--preset grpo|dapo|dr_grpo|gspo|cispo`` sets the loss and advantage options together.

A preset is a table of config values (dotted paths into ``TrainConfig``; a callable computes a value from other
resolved fields, e.g. ``max_tokens``). Precedence, lowest first:

    field defaults  <  preset  <  --config file  <  flags on the command line

so anything the user states explicitly (a flag, or a key of the ``--config`` file) wins over the preset. The
resolved values land in the config itself, so ``config.json`` records what ran; reloading it with ``--config``
gives the same run (every key of a saved config is explicit, so the preset adds nothing on reload). ``parse``
prints one line naming what the preset set and which of its keys were overridden.

What each preset sets, and why (the papers' choices this repo supports; anything not listed keeps its default):

- ``grpo`` (Shao et al. 2024): per-sequence token mean, group-std advantages, symmetric clip 0.2. No KL term:
  the paper's beta = 0.04 with k3 needs ``--kl-coef 0.04`` (and loads a reference model).
- ``dapo`` (Yu et al. 2025): token-level mean, clip-higher (0.2 / 0.28), no KL, zero-variance groups masked
  (dynamic sampling, here without resampling), soft overlong punishment with L_cache = max_tokens / 5 (the
  paper's 4096 of 20480). Truncated completions keep their (punished) gradient: overlong *filtering*
  (``--adv-mask-truncated``) is the paper's alternative, not combined with the punishment.
- ``dr_grpo`` (Liu et al. 2025): constant normaliser B * max_tokens over every sequence (``seq_count all``,
  the paper's form), unscaled advantages (``adv.scale none``), mean baseline. With an environment (``--env``,
  ``--tools``, ``--task multiturn``) a sample is an episode: the normaliser is its most policy tokens,
  ``--max-turns`` x ``--max-tokens`` capped by ``--max-episode-tokens`` (which also counts environment tokens, so
  the cap is an upper bound).
- ``gspo`` (Zheng et al. 2025): sequence-level ratio, clip 3e-4 / 4e-4 (the paper's ranges), group advantages.
- ``cispo`` (MiniMax-M1, 2025): clipped, stop-gradient IS weight on every token, no lower bound
  (``eps_low 1``); the upper bound is a tuning knob the paper does not pin: ``--eps-high`` (default 0.2).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from align.run import cli

Value = Any | Callable[[Callable[[str], Any]], Any]  # a value, or f(get) -> value with get("max_tokens") etc.

PRESETS: dict[str, dict[str, Value]] = {
    "grpo": {
        "loss.name": "seq_mean_token_mean",
        "loss.eps_low": 0.2,
        "loss.eps_high": 0.2,
        "adv.scale": "group",
        "adv.baseline": "mean",
    },
    "dapo": {
        "loss.name": "token_mean",
        "loss.eps_low": 0.2,
        "loss.eps_high": 0.28,
        "loss.kl_coef": 0.0,
        "adv.scale": "group",
        "adv.baseline": "mean",
        "adv.filter_zero_variance": True,
        "adv.overlong_buffer": lambda get: max(1, get("max_tokens") // 5),
        "adv.overlong_penalty": 1.0,
    },
    "dr_grpo": {
        "loss.name": "constant_norm",
        "loss.max_len_norm": lambda get: policy_token_budget(get),
        "loss.seq_count": "all",
        "adv.scale": "none",
        "adv.baseline": "mean",
    },
    "gspo": {
        "loss.name": "gspo",
        "loss.eps_low": 3e-4,
        "loss.eps_high": 4e-4,
        "adv.scale": "group",
        "adv.baseline": "mean",
    },
    "cispo": {
        "loss.name": "cispo",
        "loss.eps_low": 1.0,
        "adv.scale": "group",
        "adv.baseline": "mean",
    },
}
PRESET_NAMES = ("none", *PRESETS)


def policy_token_budget(get: Callable[[str], Any]) -> int:
    """The most policy tokens one sample may hold (Dr. GRPO's constant normaliser): ``--max-tokens``, or for an
    episode (``--env``, ``--tools``, ``--task multiturn``) every turn's, capped by ``--max-episode-tokens``."""
    from align.tasks import is_multi_turn

    n = get("max_tokens")
    if get("envs.env") or get("envs.tools") or is_multi_turn(get("task")):
        n *= get("envs.max_turns")
        if get("envs.max_episode_tokens"):
            n = min(n, get("envs.max_episode_tokens"))
    return n


def _paths(d: dict, prefix: tuple[str, ...] = ()) -> set[tuple[str, ...]]:
    out: set[tuple[str, ...]] = set()
    for k, v in d.items():
        out |= _paths(v, (*prefix, k)) if isinstance(v, dict) else {(*prefix, k)}
    return out


def _lookup(d: dict, path: tuple[str, ...]) -> Any:
    for p in path:
        d = d[p]
    return d


def parse(
    cls: type, argv: list[str] | None, prefixes: dict[str, str], description: str = "", log: Callable = print
) -> Any:
    """``align.run.cli.parse`` with the ``preset`` field applied between the defaults and what the user states."""
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = cli.build_parser(cls, prefixes, description)
    given, _ = parser.parse_known_args(argv)  # defaults are SUPPRESS: exactly the flags on the command line
    given = vars(given)
    loaded: dict = {}
    if given.get("config"):
        try:
            from align.run.config_file import load

            loaded = load(given["config"], cls, prefixes)
        except ValueError:
            loaded = {}  # cli.parse reports it
    name = given.get("preset", loaded.get("preset", "none") if isinstance(loaded, dict) else "none")
    if name not in PRESETS:
        return cli.parse(cls, argv, prefixes, description)  # "none", or an unknown name it rejects
    explicit = {tuple(d.split("/")) for d in given if d != "config"} | (
        _paths(loaded) if isinstance(loaded, dict) else set()
    )
    defaults = dataclasses.asdict(cls())
    if (layers := getattr(cls, "default_layers", None)) is not None:  # the task's and the backend's settings
        seen = cli._merge(defaults, loaded if isinstance(loaded, dict) else {})
        for dest, value in given.items():
            if dest != "config":
                cli._put(seen, dest.split("/"), value)
        for _, layer in reversed(layers(seen)):  # the lowest layer's value last: it wins, as in cli.parse
            for dotted, value in layer.items():
                cli._put(defaults, dotted.split("."), value)

    def get(dotted: str) -> Any:
        path = tuple(dotted.split("."))
        if "/".join(path) in given:
            return given["/".join(path)]
        try:
            return _lookup(loaded, path)
        except (KeyError, TypeError):
            return _lookup(defaults, path)

    flag_of = {path: (flag, tp) for flag, path, _, tp in cli._flags(cls, prefixes)}
    extra: list[str] = []
    applied, kept, by_preset = [], [], set()
    for dotted, value in PRESETS[name].items():
        path = tuple(dotted.split("."))
        if path in explicit:
            kept.append(dotted)
            continue
        value = value(get) if callable(value) else value
        flag, tp = flag_of[path]
        extra += [f"--{flag}" if value else f"--no-{flag}"] if tp is bool else [f"--{flag}", str(value)]
        applied.append(f"{dotted}={value}")
        by_preset.add(dotted)
    cfg = cli.parse(cls, extra + argv, prefixes, description, frozenset(by_preset))  # preset flags first
    resolved = dataclasses.asdict(cfg)
    line = f"[align] preset {name}: {', '.join(applied) or 'nothing'}"
    if kept:
        line += "; explicit values kept: " + ", ".join(f"{d}={_lookup(resolved, tuple(d.split('.')))}" for d in kept)
    log(line)
    return cfg


def build(cls: type, name: str, overrides: dict | None = None) -> Any:
    """The Python API's preset: ``cls`` from defaults < preset ``name`` < ``overrides`` (a nested dict).

    ``build(TrainConfig, "dr_grpo", {"max_tokens": 256, "loss": {"kl_coef": 0.01}})``. ``TrainConfig(preset=...)``
    alone only records the name; the values come from here or from the CLI (``parse``)."""
    if name not in PRESETS:
        raise ValueError(f"preset {name!r} is unknown; valid: {', '.join(PRESETS)}")
    overrides = dict(overrides or {})
    data = dataclasses.asdict(cls())
    explicit = _paths(overrides)
    if (layers := getattr(cls, "default_layers", None)) is not None:  # the task's and the backend's settings
        for _, layer in reversed(layers(cli._merge(data, overrides))):  # the lowest layer's value last: it wins
            for dotted, value in layer.items():
                if tuple(dotted.split(".")) not in explicit:
                    cli._put(data, dotted.split("."), value)

    def get(dotted: str) -> Any:
        path = tuple(dotted.split("."))
        try:
            return _lookup(overrides, path)
        except (KeyError, TypeError):
            return _lookup(data, path)

    for dotted, value in PRESETS[name].items():
        path = tuple(dotted.split("."))
        if path not in explicit:
            _lookup(data, path[:-1])[path[-1]] = value(get) if callable(value) else value
    data = cli._merge(data, overrides)  # unknown keys are rejected by from_dict, by name
    data["preset"] = name
    return cli.from_dict(cls, data)
