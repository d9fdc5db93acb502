"""Where each setting of a run came from, saved beside ``config.json`` as ``config_sources.json``.

Layers, lowest first: ``default`` (``TrainConfig``'s field, set for a user's checkpoint), ``task`` (the built-in
task's ``TRAIN_DEFAULTS``, only when that task runs: no ``--train-data``, ``--env`` or ``--tools``), ``file``
(``--config``), ``preset`` (``--preset``), ``flag`` (the command line). The Python API (``TrainConfig(...)``
built in code) has no flags: a value other than the default is ``code``.

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


def apply_task_defaults(cfg: Any, defaults: dict) -> None:
    """A built-in task's settings (``TRAIN_DEFAULTS``: {"max_tokens": 10, "envs.max_turns": 2, ...}) for every field
    still at its default; a value from a flag, a file, a preset or code wins. Idempotent (the CLI applied them)."""
    src = sources_of(cfg)
    for key, value in defaults.items():
        if src[key] != "default":
            continue
        *path, name = key.split(".")
        obj = cfg
        for p in path:
            obj = getattr(obj, p)
        setattr(obj, name, value)
        src[key] = "task"
    record(cfg, src)
