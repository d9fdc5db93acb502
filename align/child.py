"""One child process speaking JSON over pipes: the reward pool's workers, the environment workers, the python
tool's launcher and the Lean REPL all run through ``Child`` (stdlib only: ``align.envs.runner`` and ``align.lean``
import with torch absent).

- **Its own process group** (``start_new_session``): ``kill()`` SIGKILLs the group, so what the child started
  (a reward's subprocess, ``lake exe repl``'s REPL) dies with it, then reaps the child and closes the pipes; once
  (a second ``killpg`` could reach a reused group id).
- **Framed messages**: ``"line"`` (one JSON value per line, the workers' protocol) or ``"block"`` (a JSON value
  followed by a blank line, the Lean REPL's; ``\\r`` dropped).
- **A deadline per request** (``read(deadline)``), and a pid watch while waiting: a child that exited while a
  process it forked holds the pipe open gives no EOF, so its exit is noticed every ``WATCH_S``.
- **Bounded reads in linear time**: bytes go into one ``bytearray``, the frame end is searched only in what
  arrived since the last search, and a message longer than ``max_bytes`` is a ``ChildError("too_big")`` as soon
  as the buffer passes it, never read whole (the caller kills and restarts the child: the stream is out of step).

Failures are ``ChildError`` with ``kind``: ``timeout``, ``eof`` (exited / closed stdout), ``too_big``, ``garbled``
(not JSON). What the caller does with them (a timeout of a call, a verifier error) is the caller's.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import IO, Any

WATCH_S = 0.2  # how often a wait checks that the child is alive (a pipe can outlive the child)
READ_CHUNK = 1 << 16
EXIT_WAIT_S = 1.0  # how long a child that closed its stdout gets to exit, so its exit code can be named
FRAMES = {"line": b"\n", "block": b"\n\n"}


class ChildError(RuntimeError):
    """A child failed to answer; ``kind`` is ``timeout``, ``eof``, ``too_big`` or ``garbled``."""

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


class Child:
    """``argv`` started in its own process group with stdin/stdout pipes (stderr: ``stderr``, default inherited).

    ``send(obj)`` writes one framed JSON message; ``read(deadline)`` returns the next one (``time.monotonic()``
    deadline, ``math.inf`` = none). For several children in one ``select`` (the reward pool): ``fileno()``,
    ``feed()`` (read what is there, False at EOF) and ``pop()`` (a complete message or None)."""

    def __init__(
        self,
        argv: Sequence[str],
        *,
        max_bytes: int,
        framing: str = "line",
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        stderr: IO | int | None = None,
        what: str = "the child process",
    ) -> None:
        if framing not in FRAMES:
            raise ValueError(f"framing must be one of {sorted(FRAMES)}, got {framing!r}")
        self.max_bytes, self.end, self.what = max_bytes, FRAMES[framing], what
        self.proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            env=env,
            cwd=cwd,
            bufsize=0,
            start_new_session=True,  # its own group: kill() ends what it started with it
        )
        self.buf = bytearray()
        self._scanned = 0  # bytes of buf already searched for the frame end
        self.killed = False

    # -------------------------------------------------------------------------------------------- writing

    def send(self, obj: Any) -> None:
        """One message (a JSON-able value, or a str already JSON) framed; ``ChildError("eof")`` if the child is
        gone. A pipe write that a signal interrupts can be partial: the rest is written."""
        text = obj if isinstance(obj, str) else json.dumps(obj)
        view = memoryview(text.encode() + self.end)
        try:
            while view:
                view = view[os.write(self.proc.stdin.fileno(), view) :]
        except (OSError, ValueError) as e:  # BrokenPipeError, or stdin closed by kill()
            raise ChildError(f"{self.what} is gone ({e})", "eof") from None

    # -------------------------------------------------------------------------------------------- reading

    def fileno(self) -> int:
        return self.proc.stdout.fileno()

    def feed(self) -> bool:
        """Read what the pipe holds now (one chunk) into the buffer; False at EOF."""
        chunk = os.read(self.fileno(), READ_CHUNK)
        if not chunk:
            return False
        if self.end == b"\n\n":
            chunk = chunk.replace(b"\r", b"")
        self.buf += chunk
        return True

    def pop(self) -> Any:
        """The next complete message in the buffer (decoded JSON), or None. ``ChildError`` ``garbled`` for one
        that is not JSON, ``too_big`` once the buffer holds more than ``max_bytes`` without a complete message."""
        while True:
            if self.end == b"\n\n":  # the REPL's blank lines between blocks
                skip = 0
                while skip < len(self.buf) and self.buf[skip] == 10:
                    skip += 1
                if skip:
                    del self.buf[:skip]
                    self._scanned = max(0, self._scanned - skip)
            i = self.buf.find(self.end, max(0, self._scanned - len(self.end) + 1))
            if i < 0:
                self._scanned = len(self.buf)
                if len(self.buf) > self.max_bytes:  # never read further: the message has no end within the cap
                    raise ChildError(f"{self.what} sent a message of more than {self.max_bytes} bytes", "too_big")
                return None
            body = bytes(self.buf[:i])
            del self.buf[: i + len(self.end)]
            self._scanned = 0
            if len(body) > self.max_bytes:
                raise ChildError(f"{self.what} sent a message of {len(body)} bytes (cap {self.max_bytes})", "too_big")
            if not body.strip():
                continue
            try:
                return json.loads(body)
            except (ValueError, UnicodeDecodeError) as e:
                raise ChildError(f"{self.what} sent text that is not JSON ({e}): {body[:200]!r}", "garbled") from None

    def readable(self) -> bool:
        """The pipe has bytes (or EOF) to read now: ``feed()`` will not block."""
        with contextlib.suppress(OSError, ValueError):
            return bool(select.select([self.fileno()], [], [], 0)[0])
        return False

    def pending(self) -> bool:
        """Bytes are waiting: in the buffer, or readable from the pipe now (output nobody asked for)."""
        return bool(self.buf.strip()) or self.readable()

    def read(self, deadline: float = math.inf) -> Any:
        """The next message; ``ChildError`` ``timeout`` past ``deadline``, ``eof`` once the child exited with no
        complete message left, ``too_big`` / ``garbled`` for a bad one. The child is left running: ``kill()`` is
        the caller's (after any of these the stream is out of step)."""
        fd = self.fileno()
        while (msg := self.pop()) is None:
            now = time.monotonic()
            if now >= deadline:
                raise ChildError(f"{self.what} did not answer in time", "timeout")
            exited = self.proc.poll() is not None
            if select.select([fd], [], [], 0 if exited else min(deadline - now, WATCH_S))[0]:
                if not self.feed():
                    raise ChildError(f"{self.what} exited{self._code()}", "eof")
            elif exited:
                raise ChildError(f"{self.what} exited{self._code()}", "eof")
        return msg

    def _code(self) -> str:
        """`` (exit code N)`` once it exited; it closed its stdout, so it gets a moment to (and is reaped)."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(EXIT_WAIT_S)
        return "" if self.proc.returncode is None else f" (exit code {self.proc.returncode})"

    # -------------------------------------------------------------------------------------------- lifetime

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return not self.killed and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the child's process group (once), reap the child, close its pipes."""
        if self.killed:
            return
        self.killed = True
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError):
                f.close()

    def close(self, grace_s: float = 5.0) -> None:
        """EOF on its stdin, ``grace_s`` to exit by itself, then ``kill()`` (its group, whatever is left)."""
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=grace_s)
        self.kill()


def close_all(children: Sequence[Child], grace_s: float = 5.0) -> None:
    """``close`` several children with one shared grace period."""
    for c in children:
        with contextlib.suppress(OSError):
            c.proc.stdin.close()
    deadline = time.monotonic() + grace_s
    for c in children:
        with contextlib.suppress(subprocess.TimeoutExpired):
            c.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        c.kill()


def child_stdio() -> tuple[IO[str], IO[str]]:
    """The child's side of ``Child`` (a worker's first call): ``(inp, out)``, the protocol's pipes on the original
    stdin and stdout. What the child's code prints goes to stderr, its reads of stdin see an empty file, and Ctrl-C
    (sent to the whole terminal's group) is ignored: the parent, which gets it too, closes the child."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    inp = os.fdopen(os.dup(0), "r")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return inp, out
