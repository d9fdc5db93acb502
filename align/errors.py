"""``InputError``, the one error for bad user input, and the checked readers that raise it; ``Interrupted``, the stop
signal that ends a wait.

A module of its own so that ``align.data`` (rows, prompts) and ``align.chat`` (tokenizer, chat template, turns)
both import it without importing each other in a circle; ``from align.data import InputError`` stays the
public spelling."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any


class InputError(ValueError):
    """Bad user input (data file, tokenizer, reward spec, flags), found before the model is loaded."""


@contextlib.contextmanager
def as_input_error(prefix: str) -> Iterator[None]:
    """A ``ValueError`` raised inside (a contradicting config, say) re-raised as an ``InputError`` after ``prefix``:
    the CLI's one-line error, not a traceback."""
    try:
        yield
    except InputError:
        raise
    except ValueError as e:
        raise InputError(f"{prefix}{e}") from None


def need_extra(module: str, extra: str, what: str) -> Any:
    """``module`` imported, or an ``InputError`` naming the optional extra that installs it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise InputError(
            f"{what} needs the optional package {module.split('.')[0]!r}: pip install 'align[{extra}]'"
        ) from None


def read_text(path: Path, what: str) -> str:
    """A UTF-8 text file; a byte that is not UTF-8 is an ``InputError`` naming ``file:line``."""
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise InputError(f"{path}:{line}: not UTF-8 text (byte {raw[e.start : e.start + 1]!r}); {what}") from None


def read_json(path: Path) -> dict:
    """A JSON object file ({} when the file is absent or not an object); invalid JSON is an ``InputError``."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(read_text(path, "a tokenizer's JSON files are UTF-8"))
    except json.JSONDecodeError as e:
        raise InputError(f"{path}: not valid JSON ({e})") from None
    return data if isinstance(data, dict) else {}


class Interrupted(BaseException):
    """A stop signal (SIGTERM / SIGINT) that ends a wait: raised by ``align.train.main``'s handler before the loop
    starts, by the rollout pipeline's waits once a stop is flagged, and by reward scoring on the main thread
    (``RewardScorer.score(should_stop=...)``), so neither setup, a stuck producer nor a reward stuck in a sleep
    holds the trainer thread. A ``BaseException``: a reward's ``except Exception`` does not swallow it."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by signal {signum}")
        self.signum = signum
