"""The rollout worker's answers: a generate request in flight (``Running``), the ``completions`` message it becomes,
and the thread that publishes every answer (``ResponseWriter``).

Publishing a response is two fsyncs (the file, then its directory) and a rename of the request into done/: ~10 ms
on a disk shared with other jobs. On the worker's one loop that time kept the engine from stepping, and with one
request per episode turn (multi-turn environments submit each episode's next turn on its own) it was about a third
of the loop's time. The writer publishes in arrival order on its own thread (fsync releases the GIL) while the loop
steps the engine. Nothing is lost if the worker dies first: a request is moved out of claimed/ only after its
response is on disk, and the next worker's ``Spool.recover`` serves the claimed-but-unanswered ones again.

Stdlib only, like ``rollout_worker.py``; plain classes: tests load the worker by path, outside ``sys.modules``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

from align.rollout import protocol as P

log = logging.getLogger("rollout_worker")


class Running:
    """A generate request in flight: its sequences' outputs (prompt-major, then sample) as they finish."""

    def __init__(self, msg: P.Message, claimed_at: float, params: P.SamplingParams, count: int, tokens: int) -> None:
        self.msg, self.claimed_at, self.params = msg, claimed_at, params
        self.outs: list = [None] * count  # vLLM RequestOutput per sequence, None until it finished
        self.left = count  # sequences not finished yet
        self.started = time.perf_counter()  # when added to the engine
        self.tokens_before = tokens  # the worker's finished_tokens then
        self.peak = 0  # most requests in flight during its life


def completions_message(job: Running, comps: list[P.Completion], finished_tokens: int, version: int,
                        basis: str) -> P.Message:  # fmt: skip
    """The answer to ``job``: its completions, and batch figures that cover the engine while it was in flight."""
    msg = job.msg
    gen_s = time.perf_counter() - job.started
    total_tokens = finished_tokens - job.tokens_before
    timings = {
        "queue_s": max(0.0, job.claimed_at - msg.created), "generate_s": gen_s, "batch_requests": job.peak,
        "batch_completion_tokens": total_tokens, "completion_tokens": sum(len(c.token_ids) for c in comps),
        "tokens_per_s": total_tokens / max(gen_s, 1e-9),
        "cached_prompt_tokens": sum(getattr(out, "num_cached_tokens", None) or 0 for out in job.outs if
                                    hasattr(out, "outputs")),  # prefix-cache hits (a cut row's continuation)
    }  # fmt: skip
    body = {"completions": [c.to_dict() for c in comps], "weights_version": version}
    return P.Message("completions", msg.id, {**body, "logprob_basis": basis, "timings": timings})


class ResponseWriter:
    """Publishes responses in the order given, on a thread of its own, by ``publish(msg)`` (the worker's:
    ``spool.respond``, then ``spool.finish``).

    The first failure (a full disk) stops it: ``check`` re-raises it on the caller's thread, where the worker's
    loop fails as it did when it wrote the answers itself; the answers not yet written stay claimed for
    ``Spool.recover``. Safe to ``put`` from several threads (the fleet's router answers from two)."""

    def __init__(self, publish: Callable[[P.Message], None]) -> None:
        self.publish = publish
        self.error: BaseException | None = None
        self._queue: deque[P.Message] = deque()
        self._cond = threading.Condition()
        self._busy = False  # a message taken off the queue and not yet published
        self._closed = False
        self._thread: threading.Thread | None = None

    def put(self, msg: P.Message) -> None:
        self.check()
        with self._cond:
            if self._closed:
                raise RuntimeError(f"response to {msg.id} after the writer closed")
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, daemon=True, name="response-writer")
                self._thread.start()
            self._queue.append(msg)
            self._cond.notify_all()

    def check(self) -> None:
        """Re-raise the writer's failure, if any."""
        if self.error is not None:
            raise self.error

    def pending(self) -> int:
        with self._cond:
            return len(self._queue) + self._busy

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every response put so far is published (or the writer failed); False on timeout."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while (self._queue or self._busy) and self.error is None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout_s: float) -> None:
        """Publish what is queued (at most ``timeout_s``), then stop the thread."""
        if not self.flush(timeout_s):
            log.error("%d response(s) not published within %.0f s; their requests stay claimed", self.pending(),
                      timeout_s)  # fmt: skip
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue or self.error is not None:
                    return
                msg = self._queue.popleft()
                self._busy = True
            try:
                self.publish(msg)
            except BaseException as e:  # noqa: BLE001 - handed to the worker's loop by check()
                log.error("publishing the response to %s failed: %s", msg.id, e)
                self.error = e
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()
