"""The ``sleep`` / ``wake_up`` requests of the spool protocol (minor version 3): vLLM's sleep mode, so the trainer
and a vLLM worker share one GPU (``--colocate``). stdlib only.

    request  sleep    {"level": 1 | 2}   answer  slept  {"level": L, "seconds": s, "freed_bytes": n}
    request  wake_up  {}                 answer  awake  {"seconds": s}

``sleep`` is vLLM's ``LLM.sleep(level)``: level 1 offloads the weights to CPU memory and drops the KV cache; level 2
drops both (the next ``sync_weights`` must load the weights again). ``wake_up`` is ``LLM.wake_up()``. While asleep the
worker answers ``generate`` and ``score`` with an error; ``sync_weights`` wakes it first. ``freed_bytes``: the GPU
memory the device reports free after the sleep minus before (0 where unknown).

Versions: a worker announces its minor version in its heartbeat; one below ``SLEEP_MINOR`` is refused before anything
is sent (``WorkerTooOldError``), as is one that answers ``unknown message kind``. A worker whose engine has no sleep
mode (the vLLM CPU build; a GPU worker started without ``--enable-sleep-mode``) answers ``error: unsupported``:
``SleepModeUnsupported``.
"""

from __future__ import annotations

from typing import Any

from align.rollout.message import WorkerTooOldError, require_minor, worker_minor, worker_too_old
from align.rollout.protocol import Message, new_id

SLEEP_MINOR = 3
SLEEP_LEVELS = (1, 2)


class SleepModeUnsupported(RuntimeError):
    """The worker's engine has no sleep mode (the CPU build, or started without ``--enable-sleep-mode``)."""


def sleep_request(level: int, id: str | None = None) -> Message:
    if level not in SLEEP_LEVELS:
        raise ValueError(f"sleep level {level!r} is not one of {SLEEP_LEVELS}")
    return Message("sleep", id or new_id("z"), {"level": int(level)})


def sleep(client: Any, level: int = 1) -> dict:
    """Put the worker behind ``client`` (an ``align.rollout.client.SpoolClient``) to sleep; the ``slept`` body."""
    return _ask(client, sleep_request(level), "slept")


def wake_up(client: Any) -> dict:
    """Wake the worker behind ``client``; the ``awake`` body."""
    return _ask(client, Message("wake_up", new_id("w"), {}), "awake")


def _ask(client: Any, msg: Message, expect: str) -> dict:
    from align.rollout.client import RolloutError

    require_minor(client.spool.root, client.spool.read_heartbeat(), SLEEP_MINOR, _too_old)
    client.spool.submit(msg)
    try:
        return client.wait(msg.id, expect=expect)
    except RolloutError as e:
        if f"unknown message kind '{msg.kind}'" in str(e):  # a worker that announced a minor it does not serve
            raise _too_old(client.spool.root, worker_minor(client.spool.read_heartbeat())) from None
        if ": unsupported: " in str(e):
            raise SleepModeUnsupported(str(e).split(": unsupported: ", 1)[1]) from None
        raise


def _too_old(root: object, minor: object) -> WorkerTooOldError:
    return worker_too_old(root, minor, "sleep / wake_up (--colocate) need", SLEEP_MINOR, "drop --colocate")
