"""Building align's C++ CPU kernels (``align.fused_cpu``, ``align.rollout.cpu_kernel``) against the installed torch.

``load()``: build and load a library's ops, or say why not (the callers then keep their torch paths: a kernel costs
speed, never correctness). ``compiler()``: ``$CXX``, ``c++`` or ``g++``, else None. ``build()``: the
shared library of ``source`` with ``flags`` (plus torch's include and ABI flags), cached under
``$XDG_CACHE_HOME/align`` (default ``~/.cache/align``) by a hash of ``key`` and the flags, so each source, torch
build and flag set is compiled once; concurrent processes wait on an exclusive ``flock`` and build it once; the
library is renamed into place only when complete, and what a killed builder left (``.cpp``, ``.so.tmp``) is removed
by the next one. The text ``@NS@`` in the source becomes the library's stem (an op namespace of its own)."""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import threading
import warnings
from pathlib import Path

import torch


def cpu_lines() -> list[str]:
    """The first processor's block of /proc/cpuinfo, as lines (``vendor_id\t: AuthenticAMD``, ``flags\t\t: ...``):
    what the kernels' cache keys and the backend choices read; [] where it cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            return f.read().split("\n\n", 1)[0].splitlines()
    except OSError:
        return []


def compiler() -> str | None:
    """The C++ compiler to build with: ``$CXX``, ``c++`` or ``g++`` on the PATH, else None."""
    for name in (os.environ.get("CXX"), "c++", "g++"):
        if name and (path := shutil.which(name)):
            return path
    return None


def build(cxx: str, prefix: str, source: str, flags: list[str] | tuple[str, ...], key: list[str]) -> Path:
    """The library ``{cache}/{prefix}_{hash}.so`` of ``source`` (built here unless it exists). Raises
    ``RuntimeError`` (the compiler's last lines) or ``OSError`` when it cannot be built."""
    torch_dir = Path(torch.__file__).resolve().parent
    flags = [
        *flags,
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
        f"-I{torch_dir / 'include'}",
        f"-I{torch_dir / 'include' / 'torch' / 'csrc' / 'api' / 'include'}",
    ]
    libs = [f"-L{torch_dir / 'lib'}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{torch_dir / 'lib'}"]
    digest = hashlib.sha256("\0".join([*key, torch.__version__, str(torch_dir), *flags]).encode()).hexdigest()[:16]
    stem = f"{prefix}_{digest}"
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "align"
    cache.mkdir(parents=True, exist_ok=True)
    lib = cache / f"{stem}.so"
    if lib.exists():
        return lib
    with open(cache / f"{stem}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building the same key
        if lib.exists():
            return lib
        for stale in cache.glob(f"{stem}.*.*"):  # left by a builder that was killed (we hold the lock)
            if stale.suffix in (".cpp", ".tmp"):
                stale.unlink(missing_ok=True)
        src, tmp = cache / f"{stem}.{os.getpid()}.cpp", cache / f"{stem}.{os.getpid()}.so.tmp"
        try:
            src.write_text(source.replace("@NS@", stem))
            proc = subprocess.run(
                [cxx, *flags, str(src), "-o", str(tmp), *libs], capture_output=True, text=True, timeout=600, check=False
            )
            if proc.returncode != 0:
                tail = " | ".join(proc.stderr.strip().splitlines()[-3:])
                raise RuntimeError(f"{cxx} exited with {proc.returncode}" + (f": {tail}" if tail else ""))
            os.replace(tmp, lib)
        finally:
            src.unlink(missing_ok=True)
            tmp.unlink(missing_ok=True)
    return lib


_LOADED: dict[tuple, tuple[object | None, str]] = {}  # one outcome per library and process
_LOADING = threading.Lock()  # threads asking at once wait for one build, one load, one warning


def load(
    prefix: str, source: str, flags: list[str], key: list[str], namespace: str | None, what: str, fallback: str
) -> tuple[object | None, str]:
    """``(torch.ops.<namespace>, "built with <cxx>")`` (``namespace`` None: the library's stem, ``@NS@`` in the
    source), or ``(None, why not)``: no compiler, a failed build (a warning: ``what`` is unavailable, why, and the
    ``fallback``), a library that does not load (removed, so the next process rebuilds it). Tried once per process
    for each library (the same outcome after), under a lock."""
    memo = (prefix, source, tuple(flags), tuple(key), namespace)
    with _LOADING:
        if memo not in _LOADED:
            _LOADED[memo] = _load(prefix, source, flags, key, namespace, what, fallback)
        return _LOADED[memo]


def _load(prefix, source, flags, key, namespace, what, fallback) -> tuple[object | None, str]:
    if (cxx := compiler()) is None:
        return None, "no C++ compiler found (set CXX, or install g++)"
    lib = None
    try:
        lib = build(cxx, prefix, source, flags, key)
        torch.ops.load_library(str(lib))
        return getattr(torch.ops, namespace or lib.stem), f"built with {cxx}"
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        why = f"build failed: {e}"
        if lib is not None and lib.exists():  # built but unloadable (e.g. damaged): the next process rebuilds
            lib.unlink(missing_ok=True)
            why = f"{lib} did not load ({e}); removed it, the next run rebuilds"
        warnings.warn(f"align: {what} unavailable ({why}); {fallback}", stacklevel=5)
        return None, why
