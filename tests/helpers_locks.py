"""flock checks for the tests where a killed process must leave its lock to a rerun; whether a process has exited."""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path

# A process reads as gone (pid_alive) once its thread-group leader is a zombie, while its other threads, and so its
# open files, may still be exiting: seen to take a moment under load.
LOCK_RELEASE_S = 5.0


def flock_free(path: Path) -> bool:
    """Whether a new process would get the exclusive flock on ``path`` now."""
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def assert_flock_released(path: Path, within_s: float = LOCK_RELEASE_S) -> None:
    """``flock_free(path)`` within ``within_s`` seconds, else an AssertionError naming the lock."""
    t0 = time.monotonic()
    while not flock_free(path):
        assert time.monotonic() - t0 < within_s, f"{path} still locked {within_s} s later"
        time.sleep(0.1)


def alive(pid: int) -> bool:
    """The process ``pid`` exists and has not exited (a zombie, exited but not reaped yet, has)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:  # gone (a vanished /proc entry may also say ESRCH)
        return False
