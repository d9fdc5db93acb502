"""Where each setting of a run came from, saved beside ``config.json`` as ``config_sources.json``.

Layers, lowest first: ``default`` (``TrainConfig``'s field, set for a user's checkpoint), ``task`` (the built-in
task's ``TRAIN_DEFAULTS``, only when that task runs: no ``--train-data``, ``--env`` or ``--tools``), ``backend``
(the rollout backend's ``TRAIN_DEFAULTS``, a row field of ``align.rollout.backends.BACKENDS``: ``--rollout spool``
turns the rho correction on), ``file`` (``--config``), ``preset`` (``--preset``), ``flag`` (the command line). The
Python API (``TrainConfig(...)`` built in code) has no flags: a value other than the default is ``code``. A resumed
run keeps the value it was started with where today's default depends on the backend (``resume``: a run started
before that default existed resumes with the same command).

``config.json`` stays the plain resolved config (it reloads and resumes as before: every value in it is explicit);
the sources file is for people (``python -m align.report``) and is never read back by a run.
"""

from __future__ import annotations

import dataclasses
from typing import Any

SOURCES_FILE = "config_sources.json"
_ATTR = "_sources"  # not a dataclass field: asdict, ==, config.json never see it


def flatten(cfg: Any, prefix: str = "") -> dict[str, Any]:
    """A config dataclass's leaves by dotted name: ``{"lr": 1e-06, "loss.eps_high": 0.28, ...}``."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if dataclasses.is_dataclass(v):
            out.update(flatten(v, f"{prefix}{f.name}."))
        else:
            out[prefix + f.name] = v
    return out


def builtin_task_runs(data: dict) -> bool:
    """Whether a config (``asdict`` shape) trains the built-in task: no data file, environment or tools."""
    return not (data["data"]["train_data"] or data["envs"]["env"] or data["envs"]["tools"])


def task_layer(data: dict) -> dict[str, Any]:
    """The built-in task's ``TRAIN_DEFAULTS`` (dotted keys) when ``data`` runs it, else ``{}``."""
    from align.tasks import TASKS, load_task

    if not builtin_task_runs(data) or data["task"] not in TASKS:  # an unknown task fails in its own check
        return {}
    return dict(load_task(data["task"]).TRAIN_DEFAULTS)


def backend_layer(data: dict) -> dict[str, Any]:
    """The rollout backend's ``TRAIN_DEFAULTS`` (dotted keys) for ``data`` (``asdict`` shape); ``{}`` for an unknown
    backend (it fails in its own check)."""
    from align.rollout.backends import BACKENDS

    row = BACKENDS.get(data["rollout"])
    return dict(getattr(row, "TRAIN_DEFAULTS", {}))  # a test's toy row may have none


def default_layers(data: dict) -> list[tuple[str, dict[str, Any]]]:
    """The layers between ``default`` and ``file`` for ``data``, lowest first: ``[("task", {...}), ("backend", {...})]``."""
    return [("task", task_layer(data)), ("backend", backend_layer(data))]


def record(cfg: Any, sources: dict[str, str]) -> Any:
    """Attach ``sources`` (dotted field -> layer) to ``cfg``; returns ``cfg``."""
    cfg.__dict__[_ATTR] = dict(sources)
    return cfg


def sources_of(cfg: Any) -> dict[str, str]:
    """Every field of ``cfg`` (dotted) -> its layer: the recorded one, else ``default`` / ``code`` by comparison."""
    values = flatten(cfg)
    recorded = cfg.__dict__.get(_ATTR)
    if recorded is not None:
        return {k: recorded.get(k, "default") for k in values}
    defaults = flatten(type(cfg)())
    return {k: "default" if defaults.get(k) == v else "code" for k, v in values.items()}


def apply_task_defaults(cfg: Any, defaults: dict, layer: str = "task") -> None:
    """A built-in task's settings (``TRAIN_DEFAULTS``: {"max_tokens": 10, "envs.max_turns": 2, ...}), or a backend's
    (``layer="backend"``), for every field still at its default; a value from a flag, a file, a preset or code wins.
    Idempotent (the CLI applied them)."""
    src = sources_of(cfg)
    for key, value in defaults.items():
        if src[key] != "default":
            continue
        _set(cfg, key, value)
        src[key] = layer
    record(cfg, src)


def apply_backend_defaults(cfg: Any) -> None:
    """The rollout backend's ``TRAIN_DEFAULTS`` where nothing was said (the Python API; the CLI applied them)."""
    apply_task_defaults(cfg, backend_layer({"rollout": cfg.rollout}), "backend")


def keep_resumed(cfg: Any, saved: dict) -> list[str]:
    """Resuming: each ``backend`` value that differs from the resumed run's ``config.json`` (``saved``, asdict shape)
    takes the saved one (layer ``resume``); returns them as 'key: new -> saved' for the log. A key the saved config
    lacks keeps today's value."""
    src, kept = sources_of(cfg), []
    flat = flatten(cfg)
    for key, layer in src.items():
        if layer != "backend":
            continue
        node: Any = saved
        for p in key.split("."):
            node = node.get(p, _MISSING) if isinstance(node, dict) else _MISSING
        if node is not _MISSING and node != flat[key]:
            kept.append(f"{key}: {flat[key]!r} -> {node!r}")
            _set(cfg, key, node)
            src[key] = "resume"
    record(cfg, src)
    return kept


_MISSING = object()


def _set(cfg: Any, key: str, value: Any) -> None:
    *path, name = key.split(".")
    obj = cfg
    for p in path:
        obj = getattr(obj, p)
    setattr(obj, name, value)
