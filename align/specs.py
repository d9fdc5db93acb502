"""Loading a callable from a spec: ``module:name`` or ``path/file.py:name`` (``--reward``, ``--env``, a tool), and the
spec that loads a given callable again in a worker process (``spec_of``). stdlib only: the reward pool's and the
environment runner's worker processes load their callables with it before anything heavy."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from align.errors import InputError


def _load_file_module(path: Path, flag: str = "--reward") -> Any:
    digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:10]
    name = f"align_reward_{path.stem}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise InputError(f"{flag} {path}: cannot load this file as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 -- a user file that fails to import: one line naming file:line
        del sys.modules[name]
        raise InputError(f"{flag} {import_failure(e, path)}") from None
    except BaseException:
        del sys.modules[name]
        raise
    return module


def import_failure(e: BaseException, path: Path | None = None) -> str:
    """``file.py:LINE: ErrorType: message`` for a file or module that failed to import: the line of the file itself
    (a syntax error's, else the deepest traceback frame in ``path``; with no ``path``, the deepest frame)."""
    if isinstance(e, SyntaxError) and e.filename:
        return f"{e.filename}:{e.lineno}: SyntaxError: {e.msg}"
    frames = traceback.extract_tb(e.__traceback__)
    mine = [f for f in frames if path is None or Path(f.filename).resolve() == path.resolve()] or frames[-1:]
    where = f"{mine[-1].filename}:{mine[-1].lineno}" if mine else str(path)
    return f"{where}: {type(e).__name__}: {e}"


def load_spec(spec: str, flag: str = "--reward", kind: str = "function") -> Callable[..., Any]:
    """The callable named by ``module:name`` or ``path/file.py:name``; ``InputError`` naming ``flag`` if there is none
    (``kind`` is what the flag names: a reward function, an environment class)."""
    mod_name, sep, fn_name = spec.rpartition(":")
    if not sep or not mod_name or not fn_name:
        raise InputError(f"{flag} {spec!r}: expected 'module:{kind}' or 'path/to/file.py:{kind}'")
    if mod_name.endswith(".py"):
        path = Path(mod_name)
        if not path.is_file():
            raise InputError(f"{flag} {spec!r}: no such file {path}")
        module = _load_file_module(path, flag)
    else:
        try:
            module = importlib.import_module(mod_name)
        except ModuleNotFoundError as e:
            raise InputError(
                f"{flag} {spec!r}: no module {e.name!r} (is it on PYTHONPATH? a file needs the "
                f"'.py' path: {flag} path/to/file.py:{kind})"
            ) from None
        except Exception as e:  # noqa: BLE001 -- the module itself is broken: one line naming its file and line
            raise InputError(f"{flag} {spec!r}: {import_failure(e)}") from None
    fn = getattr(module, fn_name, None)
    if fn is None:
        raise InputError(f"{flag} {spec!r}: {mod_name} has no attribute {fn_name!r}")
    if not callable(fn):
        raise InputError(f"{flag} {spec!r}: {fn_name} is a {type(fn).__name__}, not a {kind}")
    return fn


def spec_of(fn: Callable[..., Any]) -> str | None:
    """How a worker process loads ``fn`` (a function or a class): ``module:name`` / ``path/file.py:name``; None for
    one defined in ``__main__`` or inside a function."""
    mod, qual = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not mod or mod == "__main__" or "<" in qual or "." in qual:
        return None
    module = sys.modules.get(mod)
    path = getattr(module, "__file__", None)
    if mod.startswith("align_reward_") and path:  # loaded from a file spec
        return f"{path}:{qual}"
    return f"{mod}:{qual}"
