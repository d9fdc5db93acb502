"""The rollout pipeline: the trainer's one door to rollouts. ``next(t)`` gives step ``t``'s scored groups,
``publish(t, policy)`` hands the weights after step ``t`` to the rollout engine (every backend, every K), ``pin_eval``
makes eval epochs share the engine pinned to one version (seed 002), ``checkpoint_state`` is what a checkpoint
keeps. Engines and request splitting: ``align.rollout.engines``.

Asynchronous rollouts with bounded staleness (``--max-async-steps K``): a producer thread generates and scores the
batches of the next steps while the trainer trains on the current one.

Staleness rule: the rollouts of trainer step ``t`` (1-based) come from exactly the weights after step
``v(t) = max(0, t - 1 - K)`` (``version_for``); every completion carries that ``weights_version`` and the pipeline
checks it. ``K = 0`` is the synchronous loop (the trainer collects its own batch; no thread). The producer runs the
trainer's own ``collect(t, version, client)`` (prompts -> rollouts -> rewards, seeds from (seed, step, round)), so
prompt order, sampling seeds and rewards do not depend on K or on timing: a run is deterministic for a given K.

Engines (``NativeEngine``, ``SpoolEngine``: what the producer samples with, ``publish`` after a step, ``use(v)`` at a
version boundary, under the engine's lock) are ``align.rollout.engines``'s.

Checkpoints (``checkpoint_state``): after step ``s`` the batches ``s+1 .. s+K`` come from versions older than the
checkpoint's weights, so they are finished and stored in the checkpoint as plain data (token ids, logprobs, finish
reasons, versions, rewards: ``weights_only``-safe) with the data cursor after them; a resumed run replays them and
generates ``s+K+1`` on from the checkpoint's weights, exactly as the uninterrupted run did.

In-flight permits (``--max-inflight-requests``, in completions): a request carries whole groups (the n samples of a
prompt), at most ``permits // n`` prompts, so a group never spans two requests, engines or versions. With K >= 1 one
``Permits`` pool bounds train and eval requests together: a request takes its completions' permits before it is sent
and returns them when its answer is back. An eval epoch dispatches its complete cohort first (it has priority over
train for permits; train is drained before it anyway); once the cohort is out, the permits its finished requests
return go to train while the eval tail finishes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from align.errors import Interrupted  # also raised by the reward scoring
from align.rewards import Scores
from align.rollout.engines import (
    WAIT_POLL_S,
    PermitClient,
    Permits,
    SpoolEngine,
    check_weights_version,
    split_requests,
)
from align.rollout.groups import Episode, Groups
from align.rollout.partial import plain
from align.rollout.protocol import Completion, SamplingParams

log = logging.getLogger(__name__)


STOP_WAIT_S = 10.0  # after a stop signal, how long a checkpoint waits for its pending batches before saving fewer
STOP_JOIN_S = 2.0  # after a stop signal, how long close waits for a producer (it may be stuck in a reward's sleep)


def version_for(step: int, max_async_steps: int, floor: int = 0) -> int:
    """The weights version the rollouts of trainer step ``step`` (1-based) come from: ``max(floor, step-1-K)``.

    ``floor`` is the oldest version the run still has (the resumed checkpoint's step): batches before it were stored
    in the checkpoint, so this only matters when a finished run is extended past its last step."""
    return max(floor, step - 1 - max_async_steps)


def check_config(max_async_steps: int, max_inflight_requests: int | None, group_size: int) -> None:
    """Value checks of the async flags (``TrainConfig.__post_init__``)."""
    if max_async_steps < 0:
        raise ValueError(f"--max-async-steps must be >= 0 (0 = synchronous), got {max_async_steps}")
    if max_inflight_requests is not None:
        if max_inflight_requests < 1:
            raise ValueError(
                f"--max-inflight-requests must be >= 1 (or unset = unbounded), got {max_inflight_requests}"
            )
        if group_size > max_inflight_requests:
            raise ValueError(
                f"a group of --group-size {group_size} completions is larger than --max-inflight-requests "
                f"{max_inflight_requests}: it could never be in flight at once (groups are never split); raise "
                "--max-inflight-requests or lower --group-size"
            )


# ------------------------------------------------------------------------------------------------ batches


@dataclass
class Produced:
    """The scored batch of trainer step ``step``, generated from weights ``version``; ``cursor``: the data cursor
    right after its prompts were drawn (what a checkpoint stores when this is the last pending batch); ``seconds``:
    how long ``collect`` (generation + rewards) took where it ran (the producer with K >= 1), i.e. not the trainer's
    wait: ``rollout_time`` and ``tokens_per_s`` in the metrics."""

    step: int
    version: int
    groups: Groups
    cursor: dict | None = None
    seconds: float = 0.0
    carry: list | None = None  # --partial-rollouts: the carried groups right after this batch (``Carry.state``)

    def to_state(self) -> dict:
        """Plain data (lists, dicts, str, int, float, None) that ``torch.load(weights_only=True)`` reads back."""
        d = {
            "step": self.step,
            "version": self.version,
            "cursor": self.cursor,
            "seconds": self.seconds,
            "batch": dataclasses.asdict(self.groups),  # the checkpoint key stays "batch" (old runs resume)
        }
        return d if self.carry is None else {**d, "carry": plain(self.carry)}

    @classmethod
    def from_state(cls, d: dict) -> Produced:
        b = dict(d["batch"])
        b["completions"] = [(Episode if "mask" in c else Completion)(**c) for c in b["completions"]]
        b["scores"] = Scores(**b["scores"])
        p = cls(int(d["step"]), int(d["version"]), Groups(**b), d["cursor"], float(d.get("seconds", 0.0)))
        p.carry = d.get("carry")
        return p


# ------------------------------------------------------------------------------------------------ the pipeline


class RolloutPipeline:
    """Serves the trainer one scored batch per step: ``next(t)``, ``publish(t, policy)`` after the step,
    ``checkpoint_state(t)`` for a checkpoint, ``close()``.

    ``collect(t, version, client) -> Groups`` is the trainer's prompts -> rollouts -> rewards for step ``t``; with K >= 1
    a producer thread calls it for steps ahead (at most K + 1 ahead of the trainer's current step), on the
    ``engine`` set to ``version_for(t)``. A producer failure (e.g. ``WorkerDiedError``) is raised by ``next``."""

    def __init__(
        self,
        max_async_steps: int,
        collect: Callable[[int, int, Any], Groups],
        *,
        engine: Any = None,
        client: Any = None,
        start_step: int = 0,
        last_step: int,
        cursor: dict | None = None,
        pending: list[dict] = (),
        max_inflight_requests: int | None = None,
        pinned: bool = True,
        carry: Any = None,
    ) -> None:
        self.K, self.collect, self.engine, self.client = max_async_steps, collect, engine, client
        self.carry = carry  # --partial-rollouts: the carried groups (align.rollout.partial.Carry), else None
        self.claim_carry: list | None = None
        self.permits = Permits(max_inflight_requests)  # train and eval requests together (K >= 1)
        self.taken = self.published = self.floor = start_step
        self.last_step, self.cursor = last_step, cursor
        self.ready: dict[int, Produced] = {}
        for d in pending:
            p = Produced.from_state(d)
            self.ready[p.step] = p
        self.next_t = max([start_step, *self.ready]) + 1
        self.producing: int | None = None
        self.eval_queue: list[int] = []  # due eval steps, in order; the head runs once the lease is free
        self.cohort_sent: set[int] = set()  # queued eval steps whose complete cohort is dispatched
        self.pinned = pinned  # False: eval epochs take no lease and drain nothing (the tests' negative control)
        self.eval_due: Callable[[int], bool] | None = None
        self.eval_error: BaseException | None = None
        self.eval_records: list[dict] = []
        self.events: list[tuple] = []  # (what, step, version): the order tests check (train / drained / cohort / ...)
        self._eval_fn: Callable[[], tuple] | None = None
        self._eval_thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.idle_s, self.fill_tokens = 0.0, 0  # the producer's wait for a version; --partial-cut publish's tokens
        self._stop = False
        self.should_stop: Callable[[], int | None] = lambda: None  # the run's stop flag: the signal number, if any
        self.claim_cursor: dict | None = None  # the data cursor when the step being produced was claimed
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        if self.K > 0:
            self.engine.should_stop = lambda: self._stop
            if max_inflight_requests is not None:
                self.client = PermitClient(engine.client, self.permits, lambda: self._stop)
            self._thread = threading.Thread(target=self._produce, name="align-rollout-producer", daemon=True)

    def start(self) -> None:
        """Start the producer (``next`` does it on first use; a step-0 eval runs before it)."""
        if self._thread is not None and self._thread.ident is None:
            self._thread.start()

    @property
    def is_async(self) -> bool:
        return self.K > 0

    # -------------------------------------------------------------------------- producer (thread)

    def _produce(self) -> None:
        try:
            while True:
                t = self.next_t
                if t > self.last_step:
                    return
                v = version_for(t, self.K, self.floor)
                if not self._claim(t, v):
                    return
                t0 = time.perf_counter()
                batch = self.collect(t, v, self.engine.client if self.permits.limit is None else self.client)
                seconds = time.perf_counter() - t0
                self._check_versions(t, v, batch.completions)
                with self._cond:
                    cur = None if self.cursor is None else dict(self.cursor)
                    carry = None if self.carry is None else self.carry.snapshot()
                    self.ready[t] = Produced(t, v, batch, cur, seconds, carry)
                    self.producing, self.next_t = None, t + 1
                    self._cond.notify_all()
                if self.carry is not None and self.carry.cut == "publish" and t < self.last_step:
                    self._fill(t + 1)
        except BaseException as e:  # noqa: BLE001 - handed to the trainer thread, which raises it
            with self._cond:
                self.error = e
                self.producing = None
                self._cond.notify_all()

    def _fill(self, t: int) -> None:
        """``--partial-cut publish``: the carried rows decode on the version held until step t may start, a stop or
        an eval is queued; under the engine's lock (the eval lease: no version change mid-fill), or no fill."""
        if not self.engine.lock.acquire(blocking=False):
            return
        try:
            v = version_for(t, self.K, self.floor)
            self.fill_tokens += self.carry.fill(lambda: self._stop or bool(self.eval_queue) or not self._blocked(t, v))
        finally:
            self.engine.lock.release()

    def _check_versions(self, t: int, v: int, completions: list) -> None:
        """Every completion of step ``t`` from version ``v``; with partial rollouts (``self.carry``) every token
        from ``v`` or older (a carried group's tokens are older; the per-token bound is ``--max-token-staleness``)."""
        if self.carry is not None:
            from align.rollout.partial import check_versions

            return check_versions(t, v, completions)
        if isinstance(self.engine, SpoolEngine):  # name the likely cause: another trainer on the spool
            check_weights_version(completions, v, self.engine.client.spool.root)
        stale = sorted({c.weights_version for c in completions} - {v})
        if stale:
            raise RuntimeError(
                f"the rollouts of step {t} must come from weights version {v} (--max-async-steps {self.K}) "
                f"but some carry version(s) {stale}: the engine missed a weight update"
            )

    def _blocked(self, t: int, v: int) -> bool:
        """Step t may not start yet: its version is unpublished, it is too far ahead, an eval of its version (or an
        older one) has not dispatched its cohort yet, or it needs a newer version while an older eval is queued."""
        if self.published < v or t > self.taken + self.K + 1:
            return True
        return self.pinned and (
            any(e <= v for e in self.eval_queue if e not in self.cohort_sent)
            or (v != self.engine.version and any(e < v for e in self.eval_queue))
        )

    def _claim(self, t: int, v: int) -> bool:
        """Wait until step t may start on version v, switch the engine under the policy lock if needed, mark t as
        producing. False when stopping."""
        t0 = time.monotonic()
        while True:
            with self._cond:
                while not self._stop and self._blocked(t, v):
                    self._cond.wait(WAIT_POLL_S)
                if self._stop:
                    return False
                self.claim_cursor = None if self.cursor is None else dict(self.cursor)
                self.claim_carry = None if self.carry is None else self.carry.snapshot()
                if v == self.engine.version:  # same weights: no lock needed (a refill during a pinned eval tail)
                    self.producing = t
                    self.idle_s += time.monotonic() - t0
                    self.events.append(("train", t, v))
                    return True
            with self.engine.lock:  # a version change: waits while an eval lease is held
                with self._cond:
                    if self._blocked(t, v):
                        continue
                    self.producing = t
                    self.idle_s += time.monotonic() - t0
                self.engine.use(v)
                with self._cond:
                    self.events.append(("train", t, v))
                return True

    # -------------------------------------------------------------------------- trainer side

    def _wait_for(self, steps: range, stop_after_s: float = 0.0) -> bool:
        """Until every step in ``steps`` is ready (True). Once a stop is flagged: ``Interrupted`` after
        ``stop_after_s`` seconds, or False when that is > 0 (the caller takes what is ready)."""
        deadline = None
        with self._cond:
            while not all(t in self.ready for t in steps):
                if self.error is not None:
                    raise self.error
                if self._thread is None or (self._thread.ident is not None and not self._thread.is_alive()):
                    raise RuntimeError(f"the rollout producer stopped before producing steps {list(steps)}")
                if (signum := self.should_stop()) and deadline is None:
                    deadline = time.monotonic() + stop_after_s
                if deadline is not None and time.monotonic() >= deadline:
                    if stop_after_s > 0:
                        return False
                    raise Interrupted(signum)
                self._cond.wait(WAIT_POLL_S)
        return True

    def next(self, t: int) -> tuple[Produced, dict]:
        """The batch of step ``t`` and its async metrics (empty with K = 0)."""
        if not self.is_async:
            t0 = time.perf_counter()
            before = None if self.cursor is None else dict(self.cursor)
            try:
                batch = self.collect(t, self.published, self.client)
            except Interrupted:  # a signal cut the rewards: the step is dropped, its prompts redrawn on resume
                if before is not None:
                    self.cursor.update(before)  # what the checkpoint of step t-1 stores
                raise
            if self.engine is not None:  # a backend's engine: every answer from the weights this run published last
                where = getattr(getattr(self.client, "spool", None), "root", type(self.client).__name__)
                check_weights_version(batch.completions, self.published, where)
                getattr(self.engine, "collected", lambda: None)()  # --colocate: the worker sleeps through the update
            return Produced(t, self.published, batch, seconds=time.perf_counter() - t0), {}
        self.start()
        t0 = time.monotonic()
        self._wait_for(range(t, t + 1))
        with self._cond:
            p = self.ready.pop(t)
            self.taken = t
            (idle, fill), self.idle_s, self.fill_tokens = (self.idle_s, self.fill_tokens), 0.0, 0
            inflight = len(self.ready) + (self.producing is not None)
            self._cond.notify_all()
        off = [(t - 1) - c.weights_version for c in p.groups.completions]
        metrics = {
            "async/off_policy_steps_mean": sum(off) / max(1, len(off)),
            "async/off_policy_steps_max": max(off, default=0),
            "async/trainer_wait_s": time.monotonic() - t0,
            "async/generator_idle_s": idle,
            "async/inflight": inflight,
        }
        if self.carry is not None:  # per-token staleness (align.rollout.partial)
            from align.rollout.partial import lag_metrics

            metrics.update(lag_metrics(p.groups.completions, t), **{"rollout/dropped_stale": p.groups.dropped_stale})
            metrics.update({"rollout/fill_tokens": fill} if self.carry.cut == "publish" else {})
        return p, metrics

    def publish(self, step: int, policy: Any) -> float:
        """After optimizer step ``step``: hand its weights to the rollout engine; returns the seconds it took.
        K = 0: the native sampler shares the policy (nothing to do); a spool worker syncs every ``--sync-every``
        steps (``SyncSpool``). K >= 1: the engine gets the version, and an eval due at ``step`` (``pin_eval``) is
        queued in the same breath, so no rollout of that version starts before its eval cohort is dispatched."""
        if not self.is_async:
            if self.engine is None:
                return 0.0
            seconds = self.engine.publish(step, policy)
            self.published = self.engine.version
            return seconds
        seconds = self.engine.publish(step, policy)
        with self._cond:
            self.published = step
            if self.eval_due is not None and self.eval_due(step):
                self._queue_eval(step)
            self._cond.notify_all()
        return seconds

    # -------------------------------------------------------------------------- pinned eval (seed 002)

    def _queue_eval(self, step: int) -> None:  # with self._cond held
        self.eval_queue.append(step)
        if self._eval_thread is None:
            self._eval_thread = threading.Thread(target=self._eval_loop, name="align-eval-lease", daemon=True)
            self._eval_thread.start()
        self._cond.notify_all()

    def pin_eval(self, eval_fn: Callable[[], tuple], is_due: Callable[[int], bool]) -> None:
        """Run eval epochs on this pipeline's engine, each pinned to one weights version (seed 002): ``eval_fn()``
        gives ``(prompts, params, permits, score)`` (a cohort), or ``run(client) -> (metrics, completions)`` (held-out
        episodes, run on the engine's client under the lease); ``publish(step)`` queues an epoch when ``is_due(step)``."""
        self._eval_fn, self.eval_due = eval_fn, is_due

    def request_eval(self, step: int) -> None:
        """Queue an eval epoch of weights version ``step`` (a second one waits for the first to release its lease)."""
        with self._cond:
            self._queue_eval(step)

    def _eval_loop(self) -> None:
        """The supervised side task: one epoch per queued step, in order; a failure ends the loop and reaches the
        trainer through ``take_eval_records``, the lease released on the way out."""
        while True:
            with self._cond:
                while not self._stop and not self.eval_queue:
                    self._cond.wait(WAIT_POLL_S)
                if self._stop:
                    return
                e = self.eval_queue[0]
            try:
                self._eval_epoch(e)
            except BaseException as err:  # noqa: BLE001 - handed to the trainer thread
                with self._cond:
                    self.eval_error = err
                    self.eval_queue.clear()
                    self._cond.notify_all()
                return
            with self._cond:
                self.eval_queue.pop(0)
                self.cohort_sent.discard(e)
                self._cond.notify_all()

    def _eval_epoch(self, e: int) -> None:
        t0 = time.monotonic()
        if self.pinned:
            with self._cond:  # pre-existing train work of older versions finishes first (no lease held meanwhile)
                while not self._stop and not (
                    self.producing is None
                    and (self.next_t > self.last_step or version_for(self.next_t, self.K, self.floor) >= e)
                ):
                    self._cond.wait(WAIT_POLL_S)
                if self._stop:
                    return
            self.engine.lock.acquire()  # the eval lease (the watcher's policy lock); waits for an update in progress
        try:
            if self.pinned:
                with self._cond:
                    self.events.append(("lease", e, self.engine.version))
                    while self.producing is not None and not self._stop:  # the train group being scheduled
                        self._cond.wait(WAIT_POLL_S)
                    self.events.append(("drained", e, self.engine.version))
                if self.engine.version != e:
                    self.engine.use(e)
            job = self._eval_fn()
            if callable(job):  # held-out episodes (an environment task): turns go out one by one as each returns
                with self._cond:
                    self.cohort_sent.add(e)  # no cohort to send first: train at this version shares the engine now
                    self._cond.notify_all()
                metrics, comps = job(PermitClient(self.engine.client, self.permits, lambda: self._stop, eval_=True))
            else:
                prompts, params, permits, score = job
                comps = self._dispatch_cohort(e, prompts, params, permits)
                metrics = score(comps)
            wrong = sum(c.weights_version != e for c in comps)
            rec = {
                "step": e,
                **metrics,
                "eval/step": e,
                "eval/weight_version": e,
                "eval/mixed_version_ratio": wrong / max(1, len(comps)),
                "eval/duration_seconds": time.monotonic() - t0,
                "eval/train_blocked_seconds": 0.0,
            }
            with self._cond:
                self.eval_records.append(rec)
                self.events.append(("released", e, self.engine.version))
        finally:
            if self.pinned:
                self.engine.lock.release()

    def _dispatch_cohort(self, e: int, prompts: list, params: SamplingParams, permits: int | None) -> list:
        """The complete cohort of eval step ``e``, request by request through the shared permits (eval first: while
        the pool is full, the oldest eval request is collected to free permits), then the tail: each finished
        request gives its permits back, which train (refilled at the pinned version) may take."""
        out: list = []
        sent: list[tuple] = []  # (first, handle, completions held)

        def collect_oldest() -> None:
            first, handle, n = sent.pop(0)
            try:
                comps = self.engine.wait(handle)
            finally:
                self.permits.give(n)
            out.extend(dataclasses.replace(c, prompt_index=c.prompt_index + first) for c in comps)

        try:
            for first, chunk, p in split_requests(prompts, params, permits):
                n = len(chunk) * p.n
                while not self.permits.try_take(n):
                    if sent:
                        collect_oldest()
                    else:
                        self.permits.take(n, eval_=True, should_stop=lambda: self._stop)
                        break
                try:
                    sent.append((first, self.engine.submit(chunk, p, None), n))
                except BaseException:
                    self.permits.give(n)
                    raise
            with self._cond:
                self.events.append(("cohort", e, self.engine.version))
                self.cohort_sent.add(e)  # spare capacity back to train, at the pinned version only
                self._cond.notify_all()
            while sent:
                collect_oldest()
        finally:
            for _first, _handle, n in sent:  # a failure: the permits of requests never collected go back
                self.permits.give(n)
        return out

    def take_eval_records(self) -> list[dict]:
        """Finished eval records (each once); raises the eval side task's failure."""
        with self._cond:
            if self.eval_error is not None:
                err, self.eval_error = self.eval_error, None
                raise err
            out, self.eval_records = self.eval_records, []
        return out

    def wait_evals(self, timeout_s: float) -> None:
        """Until every queued eval epoch has released its lease (or failed)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self.eval_queue and self.eval_error is None:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"eval epochs {self.eval_queue} did not finish within {timeout_s:.0f} s")
                self._cond.wait(WAIT_POLL_S)

    def checkpoint_state(self, step: int, cursor: dict) -> dict:
        """What a checkpoint after ``step`` keeps: the data cursor and (K >= 1) the pending batches
        ``step+1 .. step+K`` (finished first), so a resumed run replays exactly what this run trains on."""
        if not self.is_async:
            return {"cursor": dict(cursor)}
        todo = range(step + 1, min(step + self.K, self.last_step) + 1)
        self.start()
        complete = self._wait_for(todo, stop_after_s=STOP_WAIT_S)  # a stop: what is ready within STOP_WAIT_S
        with self._cond:
            pending = [
                self.ready[t] for t in todo[: next((i for i, t in enumerate(todo) if t not in self.ready), len(todo))]
            ]
            missing = step + 1 + len(pending)
            if not complete and not pending and self.producing == missing:  # the resumed run redraws it
                return self._with_carry({"cursor": dict(self.claim_cursor), "pending_batches": []}, self.claim_carry)
        cur = pending[-1].cursor if pending else self._cursor_before(step + 1)
        carry = pending[-1].carry if pending else None if self.carry is None else self.carry.snapshot()
        return self._with_carry({"cursor": dict(cur), "pending_batches": [p.to_state() for p in pending]}, carry)

    def _with_carry(self, state: dict, carry: list | None) -> dict:
        """--partial-rollouts: the carried groups after the last stored batch (plain data) ride in the state."""
        return state if self.carry is None else {**state, "carry": plain(carry or [])}

    def _cursor_before(self, t: int) -> dict:
        # no pending batch (the last steps): the cursor after the last batch drawn, i.e. that of step t-1's batch,
        # which the producer (stopped at last_step) no longer moves
        with self._cond:
            if self.producing is not None or self.next_t != t:
                raise RuntimeError(f"internal: cursor of step {t - 1} asked while the producer is at {self.next_t}")
        return dict(self.cursor)

    def close(self, timeout_s: float = 30.0) -> None:
        if self.should_stop():  # a signal: a producer stuck in a reward's sleep must not hold the exit
            timeout_s = min(timeout_s, STOP_JOIN_S)
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._eval_thread is not None:
            self._eval_thread.join(timeout_s)
        if self._thread is not None and self._thread.ident is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.warning("the rollout producer did not stop within %.0f s (a request still pending)", timeout_s)
        with contextlib.suppress(Exception):
            if self.engine is not None:
                self.engine.close()


def make_pipeline(
    cfg: Any,
    collect: Callable[[int, int, Any], Groups],
    rollout: Any,
    step: int,
    cursor: dict,
    pending: list[dict],
    snapshots: Path,
    carry: Any = None,
) -> RolloutPipeline:
    """The pipeline of a ``TrainConfig`` on an opened rollout backend (``align.rollout.backends``): synchronous for
    ``max_async_steps == 0`` (the backend's weight publication, e.g. a spool worker synced through ``{snapshots}/v{N}``
    every ``--sync-every`` steps), else a producer on the backend's engine."""
    K = cfg.max_async_steps
    if K == 0:
        engine = rollout.engine(cfg, step, snapshots)
        return RolloutPipeline(
            0, collect, engine=engine, client=rollout.client, start_step=step, last_step=cfg.steps, cursor=cursor
        )
    from align import dist

    if dist.active():
        raise ValueError("--max-async-steps > 0 is not supported under torchrun yet; use --max-async-steps 0")
    return RolloutPipeline(
        K,
        collect,
        engine=rollout.engine(cfg, step, snapshots),
        start_step=step,
        last_step=cfg.steps,
        cursor=cursor,
        pending=pending,
        max_inflight_requests=cfg.max_inflight_requests,
        carry=carry,
    )
