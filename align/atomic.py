"""Atomic files and committed directories: the one place that decides what a reader may trust. stdlib only.

A file is written to a temporary name in the same directory, fsync'ed, then ``os.replace``d onto its name
(``atomic_write_text``): a reader sees nothing or the whole file. A directory (an HF snapshot, a checkpoint) is
written under a temporary name and committed by a marker file written last, then renamed into place
(``commit_dir``); a reader never touches a directory without its marker (``is_committed`` / ``snapshot_marker``).
align's own marker is ``COMMIT_MARKER``; ``SNAPSHOT_MARKERS`` adds the seed's ``STABLE``, which an external exporter
may write instead. Imported by the model, the checkpoints, the run files, eval and the spool protocol (which
re-exports these names for the vLLM worker: it imports only ``align.rollout.protocol``).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import socket
import stat
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import IO

COMMIT_MARKER = ".complete"  # written last into a saved directory; readers require it
SNAPSHOT_MARKERS = (COMMIT_MARKER, "STABLE")  # either commits a snapshot directory (DESIGN.md)
EXPORT_MARKER = ".align-export.json"  # which run exported a dir (--save-hf, eval snapshots): align.run.safety


def atomic_write_text(
    path: str | os.PathLike, text: str, tmp_dir: str | os.PathLike | None = None, shared: bool = False
) -> None:
    """Write ``text`` to ``path`` so a reader sees either nothing or the whole file.

    temp file in ``tmp_dir`` (same filesystem), write, fsync, ``os.replace``, fsync the directory.
    On any failure the temp file is removed and ``path`` is untouched. The temp file is 0600 (``mkstemp``);
    ``shared=True`` (a file the run writes for others: config.json, plot.svg, report.html) gives it the mode a plain
    ``open()`` would, 0666 & ~umask.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=tmp_dir or path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
            if shared:
                os.fchmod(f.fileno(), 0o666 & ~umask())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def umask() -> int:
    """The process umask, read without changing it where Linux shows it (/proc/self/status), else set back at once."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def fsync_dir(path: str | os.PathLike) -> None:
    """fsync a directory so a rename inside it is durable (best effort)."""
    with contextlib.suppress(OSError):  # some filesystems cannot fsync a directory; the rename is still atomic
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def commit_dir(tmp: Path, path: Path, marker: dict) -> None:
    """Commit a directory written under the temporary name ``tmp``: fsync its files, write the commit marker last,
    then rename it onto ``path`` (an existing directory there is moved aside first and removed after).

    Every file gets the mode a new file gets under the umask (the marker's): writers that create 0600 files
    (safetensors' temp-file-and-rename) would leave an export a server running as another user cannot read."""
    for f in tmp.iterdir():
        with open(f, "rb+") as fh:
            os.fsync(fh.fileno())
    (tmp / COMMIT_MARKER).write_text(json.dumps(marker))
    with open(tmp / COMMIT_MARKER, "rb+") as fh:
        os.fsync(fh.fileno())
    mode = stat.S_IMODE((tmp / COMMIT_MARKER).stat().st_mode)  # 0o666 & ~umask
    for f in tmp.iterdir():
        if stat.S_IMODE(f.stat().st_mode) != mode:
            os.chmod(f, mode)
    fsync_dir(tmp)
    if path.exists():
        old = path.parent / f".{path.name}.old-{uuid.uuid4().hex[:8]}"
        os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, path)
    fsync_dir(path.parent)


def write_export_marker(path: str | os.PathLike, rid: str, step: int) -> None:
    """Mark the dir ``path`` (written, not yet renamed into place) as run ``rid``'s export of ``step``: the marker
    lists the name and size of every file in it, so ``export_problem`` can tell an untouched export."""
    path = Path(path)
    files = {f.name: f.stat().st_size for f in path.iterdir() if f.is_file() and not f.is_symlink()}
    (path / EXPORT_MARKER).write_text(json.dumps({"run_id": rid, "step": step, "files": files}) + "\n")


def export_owner(path: str | os.PathLike) -> str | None:
    """The run id in dir ``path``'s export marker (None: not a dir, no readable marker)."""
    path = Path(path)
    if path.is_symlink() or not path.is_dir():
        return None
    try:
        owner = json.loads((path / EXPORT_MARKER).read_text()).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None
    return owner if isinstance(owner, str) else None


def is_committed(path: str | os.PathLike) -> bool:
    """True when ``path`` is a snapshot whose commit marker exists (safe to read)."""
    return (Path(path) / COMMIT_MARKER).is_file()


def snapshot_marker(path: str | os.PathLike) -> Path | None:
    """The commit marker of snapshot ``path`` if present (a reader never touches an uncommitted snapshot)."""
    for name in SNAPSHOT_MARKERS:
        if (Path(path) / name).is_file():
            return Path(path) / name
    return None


def check_hf_dir(path: str | os.PathLike) -> Path:
    """An HF checkpoint directory: valid config.json and weight files; else ValueError naming what is wrong."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"model directory {path} does not exist (pass an HF checkpoint directory)")
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"model directory {path} has no config.json: not an HF checkpoint") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"model directory {path}: config.json is not valid JSON ({e})") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise ValueError(f"model directory {path}: config.json has no model_type")
    if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        raise ValueError(f"model directory {path} has no *.safetensors / *.bin weight files")
    for f in path.glob("*.safetensors"):
        safetensors_header(f)  # a truncated or corrupt header: ValueError naming the file
    return path


def safetensors_header(f: Path) -> dict:
    """The JSON header of safetensors file ``f`` (tensor name -> dtype, shape, offsets), read with the stdlib: a
    little-endian u64 length, then that many bytes of JSON (at most 100 MB, as the format says). The file must hold
    every byte the header's offsets name (a copy cut short passes the header, then fails mid-load)."""
    try:
        size = f.stat().st_size
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n)) if 8 + n <= min(size, 8 + (100 << 20)) else None
    except (OSError, ValueError):
        header = None
    if not isinstance(header, dict):
        raise ValueError(f"{f} is not a valid safetensors file (bad header): a truncated or corrupt checkpoint")  # noqa: TRY004
    try:
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    except (TypeError, KeyError, IndexError):
        raise ValueError(f"{f} is not a valid safetensors file (a tensor without data_offsets)") from None
    if 8 + n + end > size:
        raise ValueError(
            f"{f} is truncated: {size} bytes, its header places tensor data up to byte {8 + n + end} (a copy or "
            "download cut short); copy the checkpoint again"
        )
    return header


def checkpoint_layout(files: list[Path]) -> tuple[int, list | None]:
    """(layers, embed_tokens shape) of an HF checkpoint's safetensors files, from their headers alone."""
    shapes = {k: v.get("shape") for f in files for k, v in safetensors_header(f).items() if k != "__metadata__"}
    layers = 1 + max((int(k.split(".")[2]) for k in shapes if k.startswith("model.layers.")), default=-1)
    return layers, shapes.get("model.embed_tokens.weight")


# ---------------------------------------------------------------------------------------------
# Private directories and secrets (the spool's trust model: docs/rollout.md)


def check_private_dir(path: str | os.PathLike, what: str) -> None:
    """Refuse directory ``path`` unless this user owns it and neither group nor others can write to it: whoever
    can write there can forge, swap or delete what this process reads. RuntimeError naming the fix."""
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise RuntimeError(f"{what} {path} is not a directory (a symlink or file); pass a directory of your own")
    if st.st_uid != os.getuid():
        raise RuntimeError(
            f"{what} {path} is owned by uid {st.st_uid}, not by this user (uid {os.getuid()}): its owner could forge "
            f"or swap messages. Use a directory of your own (removing it lets align create it 0700)"
        )
    if st.st_mode & 0o022:
        raise RuntimeError(
            f"{what} {path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o}): they could forge or "
            f"swap messages. Fix: chmod 700 {path}"
        )


def private_secret(path: str | os.PathLike, nbytes: int = 32) -> bytes:
    """The secret in file ``path``, created (mode 0600, ``nbytes`` random bytes, hex) when absent. The file must be
    a regular file of this user's that group and others cannot read or write, else RuntimeError naming the fix."""
    path = Path(path)
    if not path.exists() and not path.is_symlink():
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)  # mode 0600
        try:
            with os.fdopen(fd, "w", encoding="ascii") as f:
                f.write(os.urandom(nbytes).hex() + "\n")
                f.flush()
                os.fsync(f.fileno())
            with contextlib.suppress(FileExistsError):  # link: never replaces a secret another process wrote first
                os.link(tmp, path)
        finally:
            os.unlink(tmp)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise RuntimeError(
                f"secret {path} is not a private file of this user (uid {st.st_uid}, mode "
                f"{stat.S_IMODE(st.st_mode):o}, need uid {os.getuid()} and mode 600); remove it to make a new one"
            )
        key = os.read(fd, 4096).strip()
    finally:
        os.close(fd)
    if len(key) < 32:
        raise RuntimeError(f"secret {path} holds {len(key)} bytes (< 32); remove it to make a new one")
    return key


class LockHeldError(RuntimeError):
    """A lock ``hold_lock`` could not take: another process holds it (the message names the holder and the fix)."""


def hold_lock(path: str | os.PathLike, in_use: Callable[[str], str]) -> IO[str]:
    """An exclusive ``flock`` on ``path``, held until the returned file is closed or this process dies (a kill -9
    frees it), stamped with this process's pid and host. Held by another process: LockHeldError(``in_use(holder)``),
    at once (never waits)."""
    f = open(path, "a+", encoding="utf-8")  # noqa: SIM115 - held for the caller's life
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "pid unknown"
        f.close()
        raise LockHeldError(in_use(holder)) from None
    f.truncate(0)
    f.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
    f.flush()
    return f
