"""The spool: the filesystem transport of the rollout protocol (``protocol.py``). stdlib only, by contract.

After CPython's ``mailbox.Maildir``: one JSON file per message (``message.Message``).

    spool/tmp/          staging; a message is written here, fsync'ed, then ``os.replace``d
    spool/requests/     published requests (trainer -> worker), processed in file-name order
    spool/claimed/      a request the worker took, by ``os.rename`` (only one reader can win)
    spool/done/         requests whose response is published (kept: request ids stay unique)
    spool/responses/    published responses, named by the request id (worker -> trainer)
    spool/rejected/     malformed files, moved aside with the reason logged
    spool/waiters/      one lock per request id a client waits on (only one can take the response)
    spool/heartbeat.json  the worker's liveness record, rewritten atomically every second
    spool/worker.lock     the worker's flock: one worker per spool
    spool/secret          the spool's key (0600, made with the spool): every message carries its HMAC

Trust: the spool is this user's (0700; one of another user's, or writable by group / others, is refused), and a
message is read only from a regular file of this user's whose ``mac`` (``message.message_mac``) checks; anything
else is moved to rejected/, counted (``Spool.untrusted``) and never answered. A ``heartbeat.json`` of another user
is ignored (read as no heartbeat), counted (``Spool.foreign_heartbeats``) and warned about once per ``Spool``.

A message is never modified after it is published. The response to request ``X`` is ``responses/X.json``
(``id`` = ``X``), so responses are idempotent by request id: a worker restarted on the same spool moves its
unfinished ``claimed/`` requests back to ``requests/`` and skips any whose response already exists.
Imported by the vLLM worker's venv too (through ``protocol``, which re-exports the public names here), so it must
import with torch absent (``tests/test_dependency_firewall.py`` checks it).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import stat
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

from align.atomic import atomic_write_text, check_private_dir, private_secret
from align.rollout.message import (
    PROTOCOL,
    PROTOCOL_MINOR,
    PROTOCOL_VERSION,
    REQUEST_KINDS,
    RESPONSE_KINDS,
    Message,
    ProtocolError,
    UntrustedMessageError,
)
from align.rollout.process import pid_alive

log = logging.getLogger(__name__)

HEARTBEAT_MAX_BYTES = 1 << 20  # a heartbeat is ~200 bytes; a bigger file is not one (e.g. a link to /dev/zero)
_SPOOL_DIRS = ("tmp", "requests", "claimed", "done", "responses", "rejected", "waiters")


class AlreadyWaitingError(RuntimeError):
    """Another client already waits for this request id (only one can take its response)."""


def read_message(path: str | os.PathLike) -> Message:
    """Read and validate one message file; ProtocolError names the file on any defect.

    Only a regular file is read: a directory, FIFO, socket or device named ``*.json`` is refused without
    blocking (opened ``O_NONBLOCK``, checked with ``fstat`` before any read)."""
    return Message.from_json(_read_text(path, path), source=str(path))


def _read_text(
    path: str | os.PathLike, source: str | os.PathLike, owner: int | None = None, max_bytes: int | None = None
) -> str:
    """The UTF-8 text of regular file ``path`` (of uid ``owner`` if given; at most ``max_bytes`` if given); anything
    else raises ProtocolError (UntrustedMessageError for another owner) naming ``source``."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR):
            raise ProtocolError(f"{source}: not a regular file ({e.strerror}); rejected") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ProtocolError(f"{source}: not a regular file ({_file_kind(st.st_mode)}); rejected")
        if owner is not None and st.st_uid != owner:
            raise UntrustedMessageError(f"{source}: written by uid {st.st_uid}, not the spool's owner uid {owner}")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read() if max_bytes is None else f.read(max_bytes + 1)
        if max_bytes is not None and len(data) > max_bytes:
            raise ProtocolError(f"{source}: larger than {max_bytes} bytes; rejected")
    finally:
        os.close(fd)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ProtocolError(f"{source}: not UTF-8 text ({e}); rejected") from None


def _file_kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "a device or special file"


class Spool:
    """A spool directory: publish, claim, answer and read messages; the worker's heartbeat.

    Single worker per spool (the worker holds ``worker.lock``); any number of trainers may submit.
    """

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        for name in _SPOOL_DIRS:
            setattr(self, name, self.root / name)
        self.heartbeat_path = self.root / "heartbeat.json"
        self.lock_path = self.root / "worker.lock"
        self.secret_path = self.root / "secret"
        self._key: bytes | None = None
        self.untrusted = 0  # messages refused by ``read``: not the owner's, or no valid MAC
        self.foreign_heartbeats = 0  # heartbeat reads that found another user's file (ignored)

    @property
    def key(self) -> bytes:
        """The spool's secret (``secret``, 0600), made on first use."""
        if self._key is None:
            self._key = private_secret(self.secret_path)
        return self._key

    def ensure(self) -> Spool:
        """Create the spool folders (0700) and its secret; prove the directory is writable and private (this user's,
        not writable by group or others), or raise RuntimeError saying so."""
        try:
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
            check_private_dir(self.root, "spool directory")
            for name in _SPOOL_DIRS:
                (self.root / name).mkdir(mode=0o700, exist_ok=True)
                check_private_dir(self.root / name, "spool directory")
            self._key = private_secret(self.secret_path)
            fd, probe = tempfile.mkstemp(prefix=".probe.", dir=self.root / "tmp")
            os.close(fd)
            os.unlink(probe)
        except OSError as e:
            raise RuntimeError(
                f"spool directory {self.root} is not usable ({e.__class__.__name__}: {e}); "
                f"pass a writable directory on a local or shared filesystem"
            ) from None
        return self

    def _path(self, folder: str, msg_id: str) -> Path:
        return self.root / folder / f"{msg_id}.json"

    # -- trainer side ---------------------------------------------------------------------------
    def submit(self, msg: Message) -> Path:
        """Publish a request. A request id is used once: resubmitting a known id raises ValueError."""
        if msg.kind not in REQUEST_KINDS:
            raise ValueError(f"{msg.kind!r} is not a request kind {REQUEST_KINDS}")
        if self.request_state(msg.id) is not None:
            raise ValueError(f"request id {msg.id} already exists in spool {self.root} ({self.request_state(msg.id)})")
        target = self._path("requests", msg.id)
        atomic_write_text(target, msg.to_json(self.key), tmp_dir=self.root / "tmp")
        return target

    def read(self, path: str | os.PathLike, source: str | os.PathLike | None = None) -> Message:
        """Read message file ``path`` (named ``source`` in errors): a file of another uid, or one without a valid
        MAC of this spool's secret, raises UntrustedMessageError (the caller moves it aside: ``reject_untrusted``)."""
        text = _read_text(path, source or path, owner=os.getuid())
        return Message.from_json(text, source=str(source or path), secret=self.key)

    def reject_untrusted(self, path: Path, name: str | None = None) -> Path:
        """Move an untrusted file to rejected/ and count it (``untrusted``); it is never answered."""
        self.untrusted += 1
        return self.reject(path, name)

    def request_state(self, msg_id: str) -> str | None:
        """'answered' | 'done' | 'claimed' | 'pending', or None for an unknown id.

        A request moves while this looks (requests/ -> claimed/; its response written, then claimed/ -> done/), so
        the folders are looked at in that order, and a response is looked for after the request was found past
        requests/: each look can only find it where it was or further on. (Looking at responses/ before done/
        read a request answered between the two looks as 'done', its response consumed.) ``recover`` moves a
        claimed request back to requests/ once per worker start: a miss is looked at once more."""
        for _ in range(2):
            if self._path("requests", msg_id).exists():
                return "pending"
            claimed = self._path("claimed", msg_id).exists()
            if self._path("responses", msg_id).exists():
                return "answered"
            if claimed:
                return "claimed"
            if self._path("done", msg_id).exists():
                return "answered" if self._path("responses", msg_id).exists() else "done"
        return None

    def take_response(self, msg_id: str, check: Callable[[Message, str], None] | None = None) -> Message | None:
        """Claim (rename) and read the response to ``msg_id``, then delete it; None if not there yet.

        The response must be a response kind whose ``id`` is ``msg_id``; ``check(msg, source)`` may refuse it
        further (raising ProtocolError naming ``source``). A refused response is kept in rejected/; an untrusted one
        (``read``) is counted there and waited past (None: the worker's answer may still come)."""
        src = self._path("responses", msg_id)
        taken = self.root / "tmp" / f"{msg_id}.taken-{os.getpid()}-{uuid.uuid4().hex[:6]}.json"
        try:
            os.rename(src, taken)
        except FileNotFoundError:
            return None
        try:
            msg = self.read(taken, src)
            if msg.kind not in RESPONSE_KINDS:
                raise ProtocolError(f"{src}: a {msg.kind!r} message in responses/; rejected")
            if msg.id != msg_id:
                raise ProtocolError(f"{src}: the response's id {msg.id!r} is not the request id {msg_id!r}; rejected")
            if check is not None and msg.kind not in ("error", "stopped"):
                check(msg, str(src))
        except UntrustedMessageError:
            self.reject_untrusted(taken, name=f"{msg_id}.json")
            return None
        except ProtocolError:
            self.reject(taken, name=f"{msg_id}.json")
            raise
        os.unlink(taken)
        return msg

    @contextlib.contextmanager
    def waiting(self, msg_id: str) -> Iterator[None]:
        """Register this process as the one waiter for ``msg_id`` (a flock on waiters/<id>.lock, released at exit
        even on kill -9). A second waiter raises AlreadyWaitingError at once: only one can take the response."""
        path = self._path("waiters", msg_id).with_suffix(".lock")
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = ""
                for _ in range(50):  # the holder writes who it is just after taking the lock
                    holder = os.pread(fd, 200, 0).decode(errors="replace").strip()
                    if holder:
                        break
                    time.sleep(0.01)
                os.close(fd)
                raise AlreadyWaitingError(
                    f"another client ({holder or 'unknown'}) is already waiting for request {msg_id} in {self.root}: "
                    f"only one can take its response; wait in that process or use a new request id"
                ) from None
            try:  # the holder unlinks the file before unlocking: a lock on an unlinked inode is no lock
                same = os.fstat(fd).st_ino == os.stat(path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} thread {threading.get_ident()}".encode(), 0)
            yield
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            os.close(fd)

    # -- worker side ----------------------------------------------------------------------------
    def pending(self) -> list[Path]:
        """Published requests in service order (file name = id, ids sort by creation time)."""
        return sorted(p for p in (self.root / "requests").iterdir() if p.suffix == ".json")

    def claim(self, path: Path) -> Path | None:
        """Take a request by rename into claimed/; None if another reader took it first."""
        dst = self.root / "claimed" / path.name
        try:
            os.rename(path, dst)
        except FileNotFoundError:
            return None
        return dst

    def respond(self, msg: Message) -> Path:
        """Publish the response to request ``msg.id``; an existing response is kept (idempotent by id)."""
        if msg.kind not in RESPONSE_KINDS:
            raise ValueError(f"{msg.kind!r} is not a response kind {RESPONSE_KINDS}")
        target = self._path("responses", msg.id)
        if not target.exists():
            atomic_write_text(target, msg.to_json(self.key), tmp_dir=self.root / "tmp")
        return target

    def finish(self, msg_id: str) -> None:
        """Move an answered request from claimed/ to done/."""
        with contextlib.suppress(FileNotFoundError):
            os.replace(self._path("claimed", msg_id), self._path("done", msg_id))

    def reject(self, path: Path, name: str | None = None) -> Path:
        """Move a malformed file (or a directory / FIFO named ``*.json``) aside: never half-read, never retried."""
        dst = self.root / "rejected" / (name or path.name)
        if dst.exists() or dst.is_symlink():
            dst = dst.with_name(f"{dst.stem}.{time.time_ns()}-{uuid.uuid4().hex[:6]}{dst.suffix}")
        os.rename(path, dst)
        return dst

    def recover(self) -> list[str]:
        """At worker start: requeue claimed-but-unanswered requests; finish the answered ones. Returns requeued ids."""
        requeued = []
        for path in sorted((self.root / "claimed").glob("*.json")):
            msg_id = path.stem
            if self._path("responses", msg_id).exists() or self._path("done", msg_id).exists():
                self.finish(msg_id)
            else:
                os.replace(path, self._path("requests", msg_id))
                requeued.append(msg_id)
        for stale in (self.root / "tmp").iterdir():  # half-written temp files of a dead writer
            if stale.name.startswith(".") and stale.name.endswith(".tmp"):
                with contextlib.suppress(FileNotFoundError):
                    stale.unlink()
        return requeued

    # -- heartbeat ------------------------------------------------------------------------------
    def write_heartbeat(self, state: str, **info: object) -> None:
        """Rewrite heartbeat.json atomically: state is 'starting' | 'ready' | 'busy' | 'stopped' | 'failed'."""
        hb = {"protocol": PROTOCOL, "version": PROTOCOL_VERSION, "minor": PROTOCOL_MINOR, "kind": "heartbeat"}
        hb["state"] = state
        hb.update(pid=os.getpid(), host=socket.gethostname(), time=time.time(), **info)
        atomic_write_text(self.heartbeat_path, json.dumps(hb), tmp_dir=self.root / "tmp")

    def read_heartbeat(self) -> dict | None:
        """The last heartbeat, or None when the worker has not written one yet. Read as a message is (a FIFO,
        device or symlink is refused without blocking; a file of another user than the spool's owner is ignored:
        None, counted in ``foreign_heartbeats``, warned about once), and at most ``HEARTBEAT_MAX_BYTES``. Unlike a
        message it carries no MAC: it is rewritten every second and decides nothing but liveness."""
        try:
            text = _read_text(self.heartbeat_path, self.heartbeat_path, os.getuid(), HEARTBEAT_MAX_BYTES)
        except FileNotFoundError:
            return None
        except UntrustedMessageError as e:
            self.foreign_heartbeats += 1
            if self.foreign_heartbeats == 1:
                log.warning("%s; ignored (the spool's worker runs as this user; remove the file)", e)
            return None
        try:
            hb = json.loads(text)
        except json.JSONDecodeError as e:
            raise ProtocolError(f"{self.heartbeat_path}: malformed heartbeat ({e})") from None
        if not isinstance(hb, dict) or hb.get("version") != PROTOCOL_VERSION or not isinstance(hb.get("time"), float):
            raise ProtocolError(f"{self.heartbeat_path}: unsupported heartbeat {str(hb)[:200]}")
        return hb


def heartbeat_problem(hb: dict | None, stale_s: float, now: float | None = None) -> str | None:
    """Why the worker behind heartbeat ``hb`` is not alive, or None if it looks alive (or has not started)."""
    if hb is None:
        return None
    if hb.get("state") in ("stopped", "failed"):
        err = hb.get("error")
        return f"worker (pid {hb.get('pid')}) is {hb['state']}" + (f": {err}" if err else "")
    if hb.get("host") == socket.gethostname() and not pid_alive(int(hb.get("pid", -1))):
        return f"worker process {hb.get('pid')} is gone (no clean shutdown recorded)"
    age = (time.time() if now is None else now) - hb["time"]
    if age > stale_s:
        return f"worker (pid {hb.get('pid')} on {hb.get('host')}) stopped heart-beating {age:.1f} s ago"
    return None
