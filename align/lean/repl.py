"""One Lean REPL process speaking the leanprover-community/repl JSON protocol, restarted when it must be.

Wire format (leanprover-community/repl README): a command is one JSON object followed by a blank line on stdin;
a reply is one JSON object (pretty-printed, no blank line inside) followed by a blank line on stdout. A fresh
process runs the import header once (``{"cmd": header}`` -> ``{"env": 0}``); every proof is then compiled in that
environment (``{"cmd": code, "env": 0}``), so Mathlib is imported once per process, not once per proof.

A process is replaced (its whole process group killed: ``lake exe repl`` starts the REPL as a child) when:

- it crashed or closed stdout (``EOF ERROR``), answered text that is not JSON (``JSONDECODE ERROR``), took
  longer than the per-proof timeout (``TIMEOUT ERROR``), sent a reply over ``MAX_REPLY_BYTES`` (``TOO BIG ERROR``,
  refused as soon as the buffer passes the cap, read in linear time) or wrote output that is not the reply to the
  command sent (``STRAY OUTPUT ERROR``, below): ``send`` kills it and raises ``ReplError`` with that name; the
  next ``run`` starts a fresh one;
- it compiled ``max_uses`` proofs, or its resident memory (the group's RSS from ``/proc``) passed ``memory_mb``:
  checked before the next proof, so the proof's own env stays usable for follow-up commands (``#print axioms``).

**A reply is tied to its command.** The REPL numbers nothing, and a proof's program (an ``#eval`` writing to
``/dev/stdout``) could print a JSON block that reads as a verdict. So after the header every command is followed,
in the same write, by a sentinel command ``#print "align-sentinel-<random nonce>"`` in the header's env; the
command's reply must be the next block and the sentinel's reply (an info message holding the nonce, which no proof
can know) the one after, with nothing more waiting. Anything else (an extra block before or after, a stale reply)
is a corrupted process: it is killed and the command fails with ``kind="stray"`` (never retried: the same proof
would do it again), so the proof is a ``verifier_error`` and the next proof gets a fresh process.

The process itself is an ``align.child.Child`` (own process group, blank-line framed JSON, bounded reads).
stdlib only (the rollout venv's ``pipeline_gen_verify.py`` uses it too).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shlex
import signal
import subprocess
import tempfile
import time

from align.child import Child, ChildError
from align.lean.goedel import DEFAULT_IMPORTS

EXIT_WAIT_S = 2.0  # how long a REPL that closed stdout gets to exit before it is killed
MAX_REPLY_BYTES = 16 << 20  # one reply; a real one is KBs (infotrees are off); a bigger one is refused unread
SENTINEL = "align-sentinel-"
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class ReplError(RuntimeError):
    """The REPL failed; the message names how, ``kind`` says it for code: ``eof`` (crashed / closed stdout),
    ``json`` (malformed reply), ``timeout``, ``too_big`` (a reply past ``MAX_REPLY_BYTES``), ``stray`` (output
    that is not the command's reply), ``import`` (the header did not create env 0)."""

    def __init__(self, message: str, kind: str = "eof") -> None:
        super().__init__(message)
        self.kind = kind


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def reap_group(pgid: int, grace_s: float = 10.0) -> None:
    """SIGTERM the whole process group (engine cores, TP workers), SIGKILL what is left after ``grace_s``."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        if not _group_alive(pgid):
            return
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and _group_alive(pgid):
            try:  # reap our own exited children of the group, else they stay zombies and look alive
                while os.waitpid(-pgid, os.WNOHANG)[0]:
                    pass
            except ChildProcessError:
                pass
            if _group_alive(pgid):
                time.sleep(0.1)


def group_rss_mb(pgid: int) -> float:
    """Resident memory of every process in group ``pgid`` (``/proc/*/stat`` pgrp, ``/proc/*/statm`` rss), MiB."""
    total = 0
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", encoding="ascii", errors="replace") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after the (comm): state ppid pgrp ...
            if int(fields[2]) != pgid:
                continue
            with open(f"/proc/{name}/statm", encoding="ascii") as f:
                total += int(f.read().split()[1])
        except (OSError, IndexError, ValueError):
            continue  # the process left meanwhile
    return total * PAGE / 2**20


class Repl:
    """One REPL process (``cmd``, started in ``cwd``); ``run(code)`` compiles one proof in the header's env.

    ``timeout`` bounds one reply (seconds), ``import_timeout`` the header's; ``max_uses`` / ``memory_mb`` (0 =
    off) restart the process before the next proof. ``starts`` counts processes started (tests, logs)."""

    def __init__(
        self,
        cmd: str,
        cwd: str | None = None,
        timeout: float = 300.0,
        import_timeout: float = 100.0,
        header: str = DEFAULT_IMPORTS,
        max_uses: int = 0,
        memory_mb: int = 0,
    ) -> None:
        self.cmd, self.cwd, self.timeout, self.import_timeout = cmd, cwd or None, timeout, import_timeout
        self.header, self.max_uses, self.memory_mb = header, max_uses, memory_mb
        self.child: Child | None = None
        self.stderr = None
        self.env = 0
        self.tied = False  # after the header: every command goes with a sentinel
        self.uses = 0
        self.starts = 0
        self.start()

    def start(self) -> None:
        """(Re)start the process and run the import header; ``ReplError`` if it does not create env 0."""
        self.close()
        # a file, not a pipe, so a chatty REPL never blocks on it; it lives as long as the process
        self.stderr = tempfile.TemporaryFile()  # noqa: SIM115
        self.child = Child(
            shlex.split(self.cmd),
            max_bytes=MAX_REPLY_BYTES,
            framing="block",
            cwd=self.cwd,
            stderr=self.stderr,
            what="the REPL",
        )
        self.uses, self.tied = 0, False
        self.starts += 1
        try:
            reply = self.send({"cmd": self.header}, self.import_timeout)
            if reply.get("env") != 0 or "messages" in reply:
                raise ReplError(f"REPL import command did not create env 0: {reply}", "import")
        except ReplError:
            self.close()
            raise
        self.env, self.tied = reply["env"], True

    @property
    def proc(self):  # the Popen (tests, pipeline_gen_verify)
        return None if self.child is None else self.child.proc

    def _stderr_tail(self) -> str:
        if self.stderr is None:
            return ""
        self.stderr.seek(0, os.SEEK_END)
        self.stderr.seek(max(0, self.stderr.tell() - 400))
        tail = self.stderr.read().decode("utf-8", "replace").strip()
        return f"; stderr: {tail}" if tail else ""

    def _fail(self, text: str, kind: str) -> ReplError:
        """Kill the process (the stream is out of step or the REPL is gone) and name what happened; after an EOF
        the process gets a moment to exit, so its exit code is named."""
        code = None
        if self.child is not None and "(exit code" not in text:
            with contextlib.suppress(subprocess.TimeoutExpired):
                code = self.child.proc.wait(EXIT_WAIT_S) if kind == "eof" else self.child.proc.poll()
        err = ReplError(text + (f" (exit code {code})" if code is not None else "") + self._stderr_tail(), kind)
        self.close()
        return err

    def send(self, obj: dict, timeout: float | None = None) -> dict:
        """One command -> its JSON reply, tied to it by a sentinel after the header (see the module docstring).
        On EOF, malformed JSON, a reply too big, stray output or a timeout the process is killed first."""
        if self.child is None:
            self.start()
        limit = timeout or self.timeout
        deadline = time.monotonic() + limit
        nonce = SENTINEL + secrets.token_hex(8) if self.tied else None
        try:
            self.child.send(obj)
            if nonce is not None:
                self.child.send({"cmd": f'#print "{nonce}"', "env": self.env})
            reply = self.child.read(deadline)
            if nonce is not None:
                tail = self.child.read(deadline)
                if not _holds(tail, nonce) or self.child.pending():
                    raise self._fail(
                        "STRAY OUTPUT ERROR: the REPL wrote output that is not the reply to the command sent (a "
                        f"program the proof ran?); process killed. Got {str(reply)[:120]!r} then {str(tail)[:120]!r}",
                        "stray",
                    )
        except ChildError as e:
            raise self._fail(_ERRORS[e.kind].format(limit=limit, e=e), _KINDS[e.kind]) from None
        if not isinstance(reply, dict):
            raise self._fail(
                f"JSONDECODE ERROR: the REPL answered JSON that is not an object: {str(reply)[:200]!r}", "json"
            )
        return reply

    def run(self, code: str) -> dict:
        """Compile one proof (``compile_view`` text) in the header's env; restarts first when it is due."""
        if self.child is None or (self.max_uses and self.uses >= self.max_uses) or self._over_memory():
            self.start()
        self.uses += 1
        cmd = {"cmd": code, "allTactics": False, "ast": False, "premises": False, "tactics": False, "env": self.env}
        return self.send(cmd)

    def _over_memory(self) -> bool:
        return bool(self.memory_mb) and self.child is not None and group_rss_mb(self.child.pid) > self.memory_mb

    @property
    def pid(self) -> int | None:
        return None if self.child is None else self.child.pid

    def close(self) -> None:
        if self.child is not None:
            self.child.kill()
        if self.stderr is not None:
            self.stderr.close()
            self.stderr = None
        self.child = None


_ERRORS = {  # ChildError.kind -> the message (the names pipeline_gen_verify.py records)
    "eof": "EOF ERROR: {e}",
    "timeout": "TIMEOUT ERROR: no reply within {limit} s (process group killed)",
    "garbled": "JSONDECODE ERROR: the REPL answered malformed JSON ({e})",
    "too_big": "TOO BIG ERROR: {e} (MAX_REPLY_BYTES; process group killed)",
}
_KINDS = {"eof": "eof", "timeout": "timeout", "garbled": "json", "too_big": "too_big"}


def _holds(reply: object, nonce: str) -> bool:
    """The sentinel's reply: an info message whose text is the nonce."""
    msgs = reply.get("messages") if isinstance(reply, dict) else None
    return isinstance(msgs, list) and any(isinstance(m, dict) and m.get("data") == nonce for m in msgs)
