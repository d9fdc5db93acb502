"""One Lean REPL process speaking the leanprover-community/repl JSON protocol, restarted when it must be.

Wire format (leanprover-community/repl README): a command is one JSON object followed by a blank line on stdin;
a reply is one JSON object (pretty-printed, no blank line inside) followed by a blank line on stdout. A fresh
process runs the import header once (``{"cmd": header}`` -> ``{"env": 0}``); every proof is then compiled in that
environment (``{"cmd": code, "env": 0}``), so Mathlib is imported once per process, not once per proof.

A process is replaced (its whole process group killed: ``lake exe repl`` starts the REPL as a child) when:

- it crashed or closed stdout (``EOF ERROR``), answered text that is not JSON (``JSONDECODE ERROR``), or took
  longer than the per-proof timeout (``TIMEOUT ERROR``): ``send`` kills it and raises ``ReplError`` with that
  name; the next ``run`` starts a fresh one;
- it compiled ``max_uses`` proofs, or its resident memory (the group's RSS from ``/proc``) passed ``memory_mb``:
  checked before the next proof, so the proof's own env stays usable for follow-up commands (``#print axioms``).

stdlib only (the rollout venv's ``pipeline_gen_verify.py`` uses it too).
"""

from __future__ import annotations

import json
import os
import selectors
import shlex
import signal
import subprocess
import tempfile
import time

from align.lean.goedel import DEFAULT_IMPORTS

EXIT_WAIT_S = 2.0  # how long a REPL that closed stdout gets to exit before it is killed
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class ReplError(RuntimeError):
    """The REPL failed; the message names how, ``kind`` says it for code: ``eof`` (crashed / closed stdout),
    ``json`` (malformed reply), ``timeout``, ``import`` (the header did not create env 0)."""

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
        self.proc: subprocess.Popen | None = None
        self.stderr = None
        self.env = 0
        self.uses = 0
        self.starts = 0
        self.start()

    def start(self) -> None:
        """(Re)start the process and run the import header; ``ReplError`` if it does not create env 0."""
        self.close()
        # a file, not a pipe, so a chatty REPL never blocks on it; it lives as long as the process
        self.stderr = tempfile.TemporaryFile()  # noqa: SIM115
        self.proc = subprocess.Popen(
            shlex.split(self.cmd),
            cwd=self.cwd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            start_new_session=True,
        )
        self.buf = b""
        self.uses = 0
        self.starts += 1
        try:
            reply = self.send({"cmd": self.header}, self.import_timeout)
            if reply.get("env") != 0 or "messages" in reply:
                raise ReplError(f"REPL import command did not create env 0: {reply}", "import")
        except ReplError:
            self.close()
            raise
        self.env = reply["env"]

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
        if self.proc is not None:
            try:
                code = self.proc.wait(EXIT_WAIT_S) if kind == "eof" else self.proc.poll()
            except subprocess.TimeoutExpired:
                pass
        err = ReplError(text + (f" (exit code {code})" if code is not None else "") + self._stderr_tail(), kind)
        self.close()
        return err

    def send(self, obj: dict, timeout: float | None = None) -> dict:
        """One command -> its JSON reply. On EOF, malformed JSON or timeout the process is killed first."""
        if self.proc is None:
            self.start()
        limit = timeout or self.timeout
        try:
            self.proc.stdin.write((json.dumps(obj) + "\n\n").encode())
            self.proc.stdin.flush()
        except OSError as exc:  # BrokenPipeError: the REPL is gone
            raise self._fail(f"EOF ERROR: {exc}", "eof") from None
        deadline = time.monotonic() + limit
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        try:
            while True:
                text = self.buf.replace(b"\r\n", b"\n").lstrip(b"\n")
                if b"\n\n" in text:
                    body, _, rest = text.partition(b"\n\n")
                    self.buf = rest
                    try:
                        reply = json.loads(body.decode())
                    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                        raise self._fail(
                            f"JSONDECODE ERROR: the REPL answered malformed JSON ({exc}): {body[:200]!r}", "json"
                        ) from None
                    if not isinstance(reply, dict):
                        raise self._fail(
                            f"JSONDECODE ERROR: the REPL answered JSON that is not an object: {body[:200]!r}"
                        )
                    return reply
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(left):
                    raise self._fail(f"TIMEOUT ERROR: no reply within {limit} s (process group killed)", "timeout")
                chunk = os.read(self.proc.stdout.fileno(), 1 << 16)
                if not chunk:
                    raise self._fail("EOF ERROR: the REPL exited", "eof")
                self.buf += chunk
        finally:
            sel.close()

    def run(self, code: str) -> dict:
        """Compile one proof (``compile_view`` text) in the header's env; restarts first when it is due."""
        if self.proc is None or (self.max_uses and self.uses >= self.max_uses) or self._over_memory():
            self.start()
        self.uses += 1
        cmd = {"cmd": code, "allTactics": False, "ast": False, "premises": False, "tactics": False, "env": self.env}
        return self.send(cmd)

    def _over_memory(self) -> bool:
        return bool(self.memory_mb) and self.proc is not None and group_rss_mb(self.proc.pid) > self.memory_mb

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def close(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None or _group_alive(self.proc.pid):
                reap_group(self.proc.pid, grace_s=2)
            self.proc.wait()
            for f in (self.proc.stdin, self.proc.stdout):
                try:
                    f.close()
                except OSError:
                    pass
        if self.stderr is not None:
            self.stderr.close()
            self.stderr = None
        self.proc = None
