"""The rollout fleet's ``cut`` (protocol minor 2, ``align/rollout/cut.py``): each engine cuts its own requests.

Driver (``FleetCuts.serve_cut``, a mixin of ``fleet_driver.FleetWorker``): the prompts of the named generate
requests still out are grouped by the engine call that carries them, and every engine holding one is asked to cut
them (``EngineLoop.cut`` in its actor, on a thread of its own). The engine serves the cut between two engine steps
with the single worker's own ``serve_cut`` (``worker_commands.py``: the rows so far taken from vLLM, then aborted)
and answers at once: finished rows as they finished, the rest ``cut`` with their tokens and logprobs so far. A
prompt answered before the cut (an engine call streams each prompt's answer after the step that finished it) is
taken from that call's stream; a prompt not in its engine yet is dropped there (never generated) and answered with
its rows cut before their first token, as the single worker answers a request still queued in its spool (which the
fleet takes the same way, ``take_queued``). Each named request is then answered whole (its completions published
before the ``cut_done``). A prompt rerouted meanwhile (its engine died) is answered cut before its first token too.

Engine side: ``EngineLoop``, the actor's one stepping thread (continuous batching across the driver's calls, each
call's answers streamed back as steps finish them, cuts served between two steps).

Sub-request ids: ``p{call}-{n}``, the driver's call number and the prompt's place in that call: a name tells an engine
whether its call has arrived (a prompt of a call that has not is dropped there when it does).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterator

from worker_commands import UNSTARTED

from align.rollout import protocol as P

log = logging.getLogger("rollout_fleet")


def sub_id(call: int, n: int) -> str:
    return f"p{call}-{n}"


def sub_call(sid: str) -> int:
    return int(sid[1:].split("-")[0])


def sub_index(sid: str) -> int:
    return int(sid.split("-")[1])


ARRIVED_KEEP = 1 << 16  # calls an engine remembers as arrived (a cut names a prompt of a call still streaming)


class EngineLoop:
    """An engine actor's one stepping thread: continuous batching across the driver's calls, as the single worker admits
    requests between two engine steps. A call (``serve``, on a thread of the actor's call group) hands its prompts over
    and streams back its answers, each after the step that finished it; a prompt arriving while others run joins the
    engine at the next step instead of waiting for them. Cuts (``cut``, the actor's cut thread) are served between two
    steps. Only this thread touches the engine, under ``step_lock``, which a weight sync or a close also takes."""

    def __init__(self, worker) -> None:
        self.w = worker  # the actor's rollout_worker.Worker; its ``answers`` go to the calls' streams after each step
        self.cond = threading.Condition()
        self.step_lock = threading.Lock()
        self.pending: list[tuple[P.Message, float]] = []  # prompts of calls that arrived, not in the engine yet
        self.boxes: dict[int, queue.SimpleQueue] = {}  # call -> its stream: answer lists, None at its end (or an error)
        self.left: dict[int, int] = {}  # call -> its prompts not answered yet
        self.arrived: dict[int, None] = {}  # the last ARRIVED_KEEP calls handed over, oldest first (a cut of a call
        # not among them: not started)
        self.dropped: set[str] = set()  # prompts cut before their call arrived: never generated
        self.waiting: list[tuple[list[str], dict, threading.Event]] = []
        self.failed: str | None = None
        threading.Thread(target=self._run, daemon=True, name="engine-loop").start()

    def serve(self, messages: list[str]) -> Iterator[list[str]]:
        """One driver call: its prompts join the engine; yields lists of its answers (JSON) as steps finish them."""
        now = time.time()
        batch = [(P.Message.from_json(m), now) for m in messages]
        box: queue.SimpleQueue = queue.SimpleQueue()
        with self.cond:
            if self.failed:
                raise RuntimeError(self.failed)
            keep = [(m, t) for m, t in batch if m.id not in self.dropped]
            self.dropped -= {m.id for m, _ in batch}
            if not keep:
                return
            call = sub_call(keep[0][0].id)
            self.arrived[call] = None
            if len(self.arrived) > ARRIVED_KEEP and (old := next(iter(self.arrived))) not in self.left:
                del self.arrived[old]  # long over: the driver names only prompts of calls still streaming
            self.boxes[call], self.left[call] = box, len(keep)
            self.pending += keep
            self.cond.notify_all()
        while (item := box.get()) is not None:
            if isinstance(item, Exception):
                raise item
            yield item

    def cut(self, sids: list[str], timeout_s: float) -> dict:
        """Cut prompts ``sids`` (the actor's cut thread): {"answers": the answers of those still running, as JSON,
        "over": those answered already, in their call's stream}; the rest were not started and never will be."""
        box, done = {}, threading.Event()
        with self.cond:
            if self.failed:
                raise RuntimeError(self.failed)
            self.dropped.update(s for s in sids if sub_call(s) not in self.arrived)
            queued = {m.id for m, _ in self.pending} & set(sids)
            self.pending = [(m, t) for m, t in self.pending if m.id not in queued]
            for s in queued:
                self._answered(sub_call(s), 1)
            rest = [s for s in sids if sub_call(s) in self.arrived and s not in queued]
            if not rest:
                return {"answers": [], "over": []}
            self.waiting.append((rest, box, done))
            self.cond.notify_all()
        if not done.wait(timeout_s):
            raise TimeoutError(f"the engine did not reach a step boundary within {timeout_s:.0f} s to cut")
        if "answers" not in box:
            raise RuntimeError(self.failed or "the engine loop ended before the cut")
        return box

    def _run(self) -> None:
        waiting: list[tuple[list[str], dict, threading.Event]] = []
        try:
            while True:
                with self.cond:
                    while not (self.pending or self.waiting or self.w.running):
                        self.cond.wait()
                    batch, self.pending = self.pending, []
                    waiting, self.waiting = self.waiting, []
                with self.step_lock:
                    if batch:
                        self.w.serve_generate(batch)  # adds them to the engine (a bad one is answered at once)
                    for sids, box, done in waiting:
                        box.update(self._cut(sids))
                        done.set()
                    if self.w.running:
                        self.w.step()  # answers what it finished (every request in flight, when the engine fails)
                    self._hand_over()
        except BaseException as e:  # EngineDead: every call fails, the driver restarts the engine
            log.exception("engine loop failed")
            with self.cond:
                self.failed = f"engine loop failed: {e.__class__.__name__}: {e}"
                for box in self.boxes.values():
                    box.put(RuntimeError(self.failed))
                for _, _, done in waiting + self.waiting:
                    done.set()  # each cut waiting raises

    def _hand_over(self) -> None:
        """The answers of the last step to their calls' streams."""
        answers, self.w.answers = self.w.answers, []
        by_call: dict[int, list[str]] = {}
        for m in answers:
            by_call.setdefault(sub_call(m.id), []).append(m.to_json())
        with self.cond:
            for call, ms in by_call.items():
                self.boxes[call].put(ms)
                self._answered(call, len(ms))

    def _answered(self, call: int, k: int) -> None:
        """``k`` more prompts of ``call`` answered (in its stream or by a cut); its stream ends with its last."""
        self.left[call] -= k
        if self.left[call] == 0:
            del self.left[call]
            self.boxes.pop(call).put(None)

    def _cut(self, sids: list[str]) -> dict:
        from align.rollout.cut import cut_request

        self._hand_over()  # the batch just admitted may have answered a bad prompt at once
        running = [s for s in sids if s in self.w.running]
        if running:
            self.w.serve_cut(cut_request(running))  # the single worker's cut: rows so far, then aborted
        taken = [m for m in self.w.answers if m.kind != "cut_done"]
        self.w.answers = []
        with self.cond:
            for m in taken:
                self._answered(sub_call(m.id), 1)
        ids = {m.id for m in taken}
        return {"answers": [m.to_json() for m in taken], "over": [s for s in sids if s not in ids]}


class FleetCuts:
    """``FleetWorker.serve_cut`` (a mixin; see the module docstring)."""

    def serve_cut(self, msg: P.Message) -> None:
        import ray

        from align.rollout.cut import cut_problem

        problem = cut_problem(msg.body)
        if problem is not None:
            return self.answer(P.error_response(msg.id, "bad_request", problem))
        with self.lock:
            jobs = {rid: self.jobs[rid] for rid in msg.body["requests"] if rid in self.jobs}
            asks: dict[int, tuple[object, list[str]]] = {}  # actor -> the prompts it is asked to cut
            calls = {}  # call number -> its ref and Call
            for ref, call in self.inflight.items():
                if call.kind != "generate":
                    continue
                for n, (job, i) in enumerate(call.items):
                    if job.msg.id in jobs and i in job.remaining:
                        calls[call.seq] = (ref, call)
                        asks.setdefault(id(call.actor), (call.actor, []))[1].append(sub_id(call.seq, n))
            self.backlog = [(job, i) for job, i in self.backlog if job.msg.id not in jobs]  # never started
        timeout_s = self.fargs.call_timeout_s
        got = []
        for actor, sids in asks.values():
            try:
                got.append(ray.get(actor.cut.remote(sids, timeout_s), timeout=timeout_s + 30))
            except Exception as err:  # noqa: BLE001 - a dead engine: its prompts are answered cut below
                log.warning("an engine failed to cut %d prompt(s): %s", len(sids), err.__class__.__name__)
        over = [(*calls[sub_call(s)], sub_index(s)) for res in got for s in res["over"]]
        deadline = time.monotonic() + timeout_s
        for ref, call, n in over:  # answered in its call's stream: take it (the fleet loop may have already)
            job, i = call.items[n]
            while ref in self.inflight and i in job.remaining and time.monotonic() < deadline:
                ray.wait([ref], timeout=max(0.0, deadline - time.monotonic()))
                self._on_done(ref)
        with self.lock:
            for ans in (P.Message.from_json(m) for res in got for m in res["answers"]):
                self._collect(calls[sub_call(ans.id)][1], [ans])
            for rid, job in jobs.items():
                if self.jobs.get(rid) is not job:
                    continue  # answered (whole, or an error)
                for i in sorted(job.remaining):  # not started on its engine (or rerouted): cut before a token
                    rows = range(job.params.n)
                    job.parts[i] = [self.completion(UNSTARTED, i, s, job.params).to_dict() for s in rows]
                job.remaining.clear()
                self._answer_job(self.jobs.pop(rid))
        done, untouched = list(jobs), []
        for rid in (r for r in msg.body["requests"] if r not in jobs):
            queued = self.take_queued(rid)  # still in the spool: every row cut before its first token
            if queued is None:
                untouched.append(rid)
                continue
            self.answer_job(queued)
            done.append(rid)
        log.info("cut %d request(s) %s across %d engine(s); %d untouched", len(done), done, len(asks), len(untouched))
        self.answer(P.Message("cut_done", msg.id, {"cut": done, "untouched": untouched}))
        return None
