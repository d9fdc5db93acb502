"""The built-in ``python`` tool: the model's code runs in a fresh ``sys.executable -I`` subprocess with limits.

What it bounds, and how:

- **time**: a wall timeout; the code runs in its own session (``start_new_session``), and the whole process group
  is SIGKILLed on the timeout and again after a normal exit, so no child it spawned outlives the call (a child that
  calls ``setsid()`` itself leaves the group and is not tracked);
- **resources**: rlimits set in ``preexec_fn`` (``resource``): CPU seconds, address space, file size, number of
  processes, no core dumps. Linux does not enforce ``RLIMIT_NPROC`` for uid 0, so when the trainer runs as root the
  child drops ``CAP_SYS_ADMIN`` and ``CAP_SYS_RESOURCE`` from its bounding set and takes ``nobody`` (65534) as its
  *real* uid (its effective uid stays 0, so it can still read the interpreter): the process limit then holds.
  ``RLIMIT_NPROC`` counts every task of that real uid, so the limit is that uid's task count now + ``max_procs``;
- **the environment**: only ``PATH``, ``LANG`` and ``HOME`` (= the temporary directory) reach it, and ``-I``
  ignores ``PYTHON*`` variables and the user's site-packages: the trainer's secrets in ``os.environ`` do not;
- **the filesystem it writes**: a fresh temporary directory is its cwd (and ``HOME``), removed after the call;
- **output**: stdout and stderr together, cut at ``max_output_chars`` with a marker saying so (the rest is read
  and dropped, so the code is not blocked on a full pipe).

What it does NOT isolate: the network (the code can open sockets), the filesystem outside its cwd (readable, and
writable wherever the trainer's user can write; as root that is everywhere), other processes of the same user,
and code that deliberately undoes the limits (as root it can take its real uid back). Use a container or a VM
for untrusted code.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import resource
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

__all__ = ["PythonLimits", "PythonRun", "python", "run_python"]

_NOBODY = 65534
_PR_CAPBSET_DROP = 24
_CAP_SYS_ADMIN, _CAP_SYS_RESOURCE = 21, 24  # the capabilities that exempt a process from RLIMIT_NPROC
_READ_CHUNK = 65536
_DRAIN_READS = 64  # at most 4 MiB read after the end


@dataclass(frozen=True)
class PythonLimits:
    """The python tool's bounds (see the module docstring for what each one does)."""

    timeout_s: float = 10.0  # wall clock
    cpu_s: int = 10
    memory_mb: int = 1024  # address space (RLIMIT_AS)
    file_mb: int = 16  # the largest file it may write (RLIMIT_FSIZE)
    max_procs: int = 16  # processes and threads beyond what its real uid runs now (RLIMIT_NPROC)
    max_output_chars: int = 4000

    def __post_init__(self) -> None:
        for name in ("timeout_s", "cpu_s", "memory_mb", "file_mb", "max_procs", "max_output_chars"):
            if not getattr(self, name) > 0:
                raise ValueError(f"PythonLimits.{name} must be > 0, got {getattr(self, name)!r}")


class PythonRun(NamedTuple):
    output: str  # what the code printed (cut), then a line for a timeout, a signal or a non-zero exit status
    timed_out: bool


def python(code: str) -> str:
    """Run Python code in a fresh interpreter and return what it printed (stdout and stderr).

    Each call starts from scratch: no variables, imports or files persist between calls. The working directory
    is an empty temporary directory. Print the values you want to see.

    Args:
        code: The Python source code to run.
    """
    return run_python(code, PythonLimits()).output


def run_python(code: str, limits: PythonLimits) -> PythonRun:
    """Run ``code`` under ``limits``: its output (cut at ``limits.max_output_chars``) plus one line for a timeout,
    a kill by a signal or a non-zero exit status, and whether the wall timeout ended it."""
    tmp = Path(tempfile.mkdtemp(prefix="align_python_"))
    try:
        (tmp / "main.py").write_text(code, encoding="utf-8")
        env = {"PATH": os.environ.get("PATH", os.defpath), "LANG": os.environ.get("LANG", "C.UTF-8"), "HOME": str(tmp)}
        proc = subprocess.Popen(
            [sys.executable, "-I", "-u", "main.py"],  # -u: stdout and stderr interleave as written
            cwd=tmp,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            # preexec_fn after fork in a threaded trainer: it only calls into C (prctl, setresuid, setrlimit) with
            # everything computed before the fork, no import, no lock a thread may hold
            preexec_fn=_limiter(limits),  # noqa: PLW1509
        )
        assert proc.stdout is not None
        out = _Output(limits.max_output_chars)
        try:
            timed_out = _read_until(proc, time.monotonic() + limits.timeout_s, out)
        finally:
            _kill_group(proc)
        out.drain(proc.stdout.fileno())  # what was written just before the end (every writer is dead now)
        proc.stdout.close()
        return PythonRun(out.text() + _status(timed_out, proc.returncode, limits), timed_out)
    finally:
        _remove_tree(tmp)


def _limiter(limits: PythonLimits) -> Callable[[], None]:
    """The ``preexec_fn`` (run in the child between fork and exec): computed here, so the child only calls C."""
    as_root = os.geteuid() == 0
    nproc = _tasks_of(_NOBODY if as_root else os.getuid()) + limits.max_procs
    libc = ctypes.CDLL(None, use_errno=True) if as_root else None
    rlimits = [  # (which, soft, hard): the CPU hard limit 1 s later, so SIGXCPU (named in the output) comes first
        (resource.RLIMIT_CPU, limits.cpu_s, limits.cpu_s + 1),
        (resource.RLIMIT_AS, limits.memory_mb << 20, limits.memory_mb << 20),
        (resource.RLIMIT_FSIZE, limits.file_mb << 20, limits.file_mb << 20),
        (resource.RLIMIT_NPROC, nproc, nproc),
        (resource.RLIMIT_CORE, 0, 0),
    ]

    def preexec() -> None:
        if libc is not None:
            for cap in (_CAP_SYS_ADMIN, _CAP_SYS_RESOURCE):
                if libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
                    raise OSError(ctypes.get_errno(), f"prctl(PR_CAPBSET_DROP, {cap})")
            os.setresuid(_NOBODY, 0, 0)
        for which, soft, hard in rlimits:
            resource.setrlimit(which, (soft, hard))

    return preexec


def _tasks_of(uid: int) -> int:
    """How many tasks (processes and threads) run with real uid ``uid`` now: what ``RLIMIT_NPROC`` counts."""
    n = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):  # the process ended while we read
            status = Path(entry.path, "status").read_text()
            fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
            if int(fields["Uid"].split()[0]) == uid:
                n += int(fields["Threads"])
    return n


class _Output:
    """The first bytes of the output (4 per character: enough for ``max_chars`` UTF-8 characters) and the total."""

    def __init__(self, max_chars: int) -> None:
        self.max_chars, self.kept, self.total = max_chars, bytearray(), 0

    def add(self, chunk: bytes) -> None:
        self.total += len(chunk)
        self.kept += chunk[: max(0, 4 * self.max_chars + 4 - len(self.kept))]

    def drain(self, fd: int) -> None:
        """What is left in the pipe; bounded, since a child that left the group with setsid() may still write."""
        with contextlib.suppress(BlockingIOError):
            for _ in range(_DRAIN_READS):
                if not (chunk := os.read(fd, _READ_CHUNK)):
                    return
                self.add(chunk)

    def text(self) -> str:
        text = self.kept.decode("utf-8", errors="replace")
        if len(text) <= self.max_chars and self.total == len(self.kept):
            return text
        return text[: self.max_chars] + f"\n[output cut: the first {self.max_chars} characters of {self.total} bytes]"


def _read_until(proc: subprocess.Popen, deadline: float, out: _Output) -> bool:
    """Read the output until the code's process exits or the deadline passes; True = the deadline passed."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    os.set_blocking(fd, False)
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while (left := deadline - time.monotonic()) > 0:
            # a short slice: a background child may hold the pipe open after the code itself has exited
            if sel.select(min(left, 0.05)):
                chunk = os.read(fd, _READ_CHUNK)
                if not chunk:  # every writer closed the pipe
                    return False
                out.add(chunk)
            elif proc.poll() is not None:
                return False
    return True


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the code's process group (it leads its own session) and reap the code's process."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _status(timed_out: bool, returncode: int | None, limits: PythonLimits) -> str:
    """The line appended to the output for a timeout, a kill by a signal or a non-zero exit status."""
    if timed_out:
        return f"\n[timed out after {limits.timeout_s:g} s: the process and its children were killed]"
    if returncode is not None and returncode < 0:
        why = f" (the {limits.cpu_s} s CPU limit)" if -returncode == signal.SIGXCPU else ""
        return f"\n[killed by {signal.Signals(-returncode).name}{why}]"
    return f"\n[exit status {returncode}]" if returncode else ""


def _remove_tree(path: Path) -> None:
    """Remove the temporary directory, even where the code took away its own permissions on it."""
    with contextlib.suppress(OSError):
        os.chmod(path, 0o700)
    for root, dirs, _files in os.walk(path):
        for d in dirs:
            sub = os.path.join(root, d)
            if not os.path.islink(sub):  # never chmod what a link points to (outside the directory)
                with contextlib.suppress(OSError):
                    os.chmod(sub, 0o700)
    shutil.rmtree(path)
