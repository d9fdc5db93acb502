"""Progress heartbeats for the run's watchdog (``align.run.watchdog``): stdlib only, process-wide, cheap.

The parts that complete work report it: the native sampler per decoded token, a rollout client per answer, the reward
scorer per call, the environment runner per call, the learner per update. ``working(part, **info)`` marks a part
busy for the duration of one call (so a stall names the part that is *in* a call, not the last one that finished)
and lists the call as in flight with its start time and ``info`` (a request id, an engine); ``beat(part)`` is one
unit of progress inside it. A beat is a dict store and a clock read: nothing the sampler's token loop would notice.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

_last: dict[str, float] = {}  # part -> time.monotonic() of its last progress
_inflight: dict[int, tuple[str, float, dict, int | None]] = {}  # call id -> (part, started, info, thread id)
_ids = itertools.count()
_lock = threading.Lock()


def beat(part: str) -> None:
    """``part`` completed a unit of work (a token, a reward, an environment step, an optimizer step)."""
    _last[part] = time.monotonic()


@contextmanager
def working(part: str, *, safe_point: bool = False, **info: Any) -> Iterator[None]:
    """``part`` is in one call for the duration (beats on entry and exit); ``info`` describes it in ``stall.txt``.

    ``safe_point``: the calling thread only waits on ``part`` (another thread does the work) and gives the wait up
    once the run is stopped (the trainer behind a full eval queue): listed with thread None, so a stall there
    stops the run at that safe point instead of exiting at once (``align.run.watchdog``)."""
    key = next(_ids)
    with _lock:
        _inflight[key] = (part, time.monotonic(), info, None if safe_point else threading.get_ident())
    beat(part)
    try:
        yield
    finally:
        with _lock:
            _inflight.pop(key, None)
        beat(part)


def last_progress() -> float | None:
    """The monotonic time of the most recent beat of any part (None: nothing beat yet)."""
    return max(_last.values(), default=None)


def snapshot() -> tuple[dict[str, float], list[tuple[str, float, dict, int | None]]]:
    """(each part's last beat, the calls in flight as (part, started, info, thread id or None: a safe-point wait),
    oldest first)."""
    with _lock:
        return dict(_last), sorted(_inflight.values(), key=lambda c: c[1])


def forget(thread_ids: set[int]) -> None:
    """Drop the calls in flight of abandoned threads (an evicted group's): they no longer hold the run up."""
    with _lock:
        for key in [k for k, c in _inflight.items() if c[3] in thread_ids]:
            del _inflight[key]


def reset() -> None:
    """Forget every beat and call (a new run in this process starts its watchdog from here)."""
    with _lock:
        _last.clear()
        _inflight.clear()
