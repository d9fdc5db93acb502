"""The built-in ``python`` tool: the model's code runs in a fresh ``python -I`` process with limits, started by a
clean launcher (``align/envs/launcher.py``), as another uid when the trainer is root.

What it bounds, and how (each a test in tests/test_tools.py or tests/test_sandbox_secrets.py):

- **the trainer's secrets**: the code's parent is the launcher, a fresh interpreter the trainer starts with a
  scrubbed environment (``PATH``, ``LANG``, ``HOME`` = the temporary directory) and only the limits on its command
  line: ``/proc/$PPID/environ`` holds no secret. When the trainer runs as root, the code runs as ``nobody``
  (65534: every uid and gid, no supplementary groups, so no capabilities): ``/proc`` of the trainer and of the
  launcher (root's, mode 0400) are unreadable, and so are the run's files that are not world-readable (the
  spool's 0600 ``secret``), and it cannot write in the run's ``--out`` (root's directories). Its interpreter is
  ``sys.executable`` when ``nobody`` can execute it, else the system's ``python3`` (one under ``/root`` is not);
- **time**: a wall timeout; the launcher leads its own session, and the whole process group is SIGKILLed on the
  timeout and again after a normal exit, so no child the code spawned outlives the call (a child that calls
  ``setsid()`` itself leaves the group and is not tracked);
- **resources**: rlimits the launcher sets in the code's process: CPU seconds, address space, file size, number
  of processes (``RLIMIT_NPROC``: its uid's task count now + ``max_procs``; Linux does not enforce it for root,
  which the code never is), no core dumps;
- **the filesystem it writes**: a fresh temporary directory is its cwd (and ``HOME``), removed after the call;
- **output**: stdout and stderr together, cut at ``max_output_chars`` with a marker saying so (the rest is read
  and dropped, so the code is not blocked on a full pipe).

What it does NOT isolate: the network (the code can open sockets); the filesystem outside its cwd (readable where
``nobody`` / the trainer's user can read, e.g. world-readable files of ``--out``; as an ordinary user, writable
wherever that user can write). When the trainer is NOT root the code runs as the trainer's user: the launcher keeps
``/proc/$PPID`` clean, but the trainer itself (``/proc/<its pid>/environ``, found through the launcher's PPid)
and every other process of that user stay readable. Use a container or a VM for untrusted code.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from align.child import Child

__all__ = ["PythonLimits", "PythonRun", "python", "run_python"]

_NOBODY = 65534  # the code's uid when the trainer is root
LAUNCHER = Path(__file__).with_name("launcher.py")
SYSTEM_PYTHONS = ("/usr/bin/python3", "/usr/local/bin/python3")  # for nobody, when sys.executable is under /root
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
        uid = _NOBODY if os.geteuid() == 0 else None
        if uid is not None:  # its own directory, and only it: nobody may write there
            os.chown(tmp / "main.py", uid, uid)
            os.chown(tmp, uid, uid)
        env = {"PATH": os.environ.get("PATH", os.defpath), "LANG": os.environ.get("LANG", "C.UTF-8"), "HOME": str(tmp)}
        spec = {
            "interpreters": _interpreters(uid),
            "args": ["-I", "-u", "main.py"],  # -u: stdout and stderr interleave as written
            "uid": uid,
            "rlimits": _rlimits(limits, uid),
        }
        child = Child(
            [sys.executable, "-I", "-S", str(LAUNCHER), json.dumps(spec)],
            max_bytes=0,  # the output is read raw below, never as messages
            env=env,
            cwd=str(tmp),
            stderr=subprocess.STDOUT,
            what="the python tool",
        )
        with contextlib.suppress(OSError):
            child.proc.stdin.close()  # the code reads an empty stdin
        out = _Output(limits.max_output_chars)
        try:
            timed_out = _read_until(child, time.monotonic() + limits.timeout_s, out)
        finally:
            fd = os.dup(child.fileno())  # what was written just before the end is read after the kill
            child.kill()  # the launcher's process group: the code and everything it started
        try:
            out.drain(fd)  # (every writer is dead now)
        finally:
            os.close(fd)
        return PythonRun(out.text() + _status(timed_out, child.proc.returncode, limits), timed_out)
    finally:
        _remove_tree(tmp)


def _interpreters(uid: int | None) -> list[str]:
    """The trainer's interpreter, then (run as another uid, which may not reach one under ``/root``) the system's."""
    found = [sys.executable]
    if uid is not None:
        found += [p for p in SYSTEM_PYTHONS if os.path.exists(p) and p != sys.executable]
    return found


def _rlimits(limits: PythonLimits, uid: int | None) -> list[tuple[int, int, int]]:
    """(which, soft, hard): the CPU hard limit 1 s later, so SIGXCPU (named in the output) comes first.
    ``RLIMIT_NPROC`` counts every task of the code's real uid: its count now + ``max_procs``."""
    nproc = _tasks_of(os.getuid() if uid is None else uid) + limits.max_procs
    return [
        (resource.RLIMIT_CPU, limits.cpu_s, limits.cpu_s + 1),
        (resource.RLIMIT_AS, limits.memory_mb << 20, limits.memory_mb << 20),
        (resource.RLIMIT_FSIZE, limits.file_mb << 20, limits.file_mb << 20),
        (resource.RLIMIT_NPROC, nproc, nproc),
        (resource.RLIMIT_CORE, 0, 0),
    ]


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


def _read_until(child: Child, deadline: float, out: _Output) -> bool:
    """Read the output until the code's process exits or the deadline passes; True = the deadline passed."""
    fd = child.fileno()
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
            elif child.proc.poll() is not None:
                return False
    return True


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
