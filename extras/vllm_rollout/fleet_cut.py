"""The rollout fleet's ``cut`` (protocol minor 2, ``align/rollout/cut.py``): each engine cuts its own requests.

Driver (``FleetCuts.serve_cut``, a mixin of ``fleet_driver.FleetWorker``): the prompts of the named generate
requests still out are grouped by the engine call that carries them, and every engine holding one is asked to cut
them (``EngineCuts.cut`` in its actor, on a thread of its own). The engine serves the cut between two engine steps
with the single worker's own ``serve_cut`` (``worker_commands.py``: the rows so far taken from vLLM, then aborted)
and answers at once: finished rows as they finished, the rest ``cut`` with their tokens and logprobs so far. A
prompt answered before the cut (an engine call streams each prompt's answer after the step that finished it) is
taken from that call's stream; a prompt whose call has not started on its engine is dropped there (never generated)
and answered with its rows cut before their first token, as the single worker answers a request still queued in its
spool (which the fleet takes the same way, ``take_queued``). Each named request is then answered whole (its
completions published before the ``cut_done``). A prompt rerouted meanwhile (its engine died) is answered cut before
its first token too.

Sub-request ids: ``p{call}-{n}``, the driver's call number and the prompt's place in that call: an engine serves its
calls in order, so a name tells it whether its call is running, over, or not started yet.
"""

from __future__ import annotations

import logging
import threading
import time

from worker_commands import UNSTARTED

from align.rollout import protocol as P

log = logging.getLogger("rollout_fleet")


def sub_id(call: int, n: int) -> str:
    return f"p{call}-{n}"


def sub_call(sid: str) -> int:
    return int(sid[1:].split("-")[0])


def sub_index(sid: str) -> int:
    return int(sid.split("-")[1])


class EngineCuts:
    """An engine actor's side: the cuts waiting for the call that steps the engine (``between_steps``)."""

    def __init__(self, worker) -> None:
        self.w = worker  # the actor's rollout_worker.Worker; its ``answers`` are the running call's
        self.lock = threading.Lock()
        self.waiting: list[tuple[list[str], dict, threading.Event]] = []
        self.call: int | None = None  # the call stepping the engine now
        self.last = -1  # the last call over
        self.dropped: set[str] = set()  # prompts cut before their call started: never generated

    def admit(self, batch: list[tuple[P.Message, float]]) -> list[tuple[P.Message, float]]:
        """A call starts: its prompts, less those cut before it started."""
        with self.lock:
            keep = [(m, t) for m, t in batch if m.id not in self.dropped]
            self.dropped -= {m.id for m, _ in batch}
            self.call = sub_call(batch[0][0].id) if batch else self.last
        return keep

    def between_steps(self) -> bool:
        """Serve the cuts waiting; False once the call is over (nothing left running)."""
        with self.lock:
            for sids, box, done in self.waiting:
                box.update(self._cut(sids))
                done.set()
            self.waiting = []
            if self.w.running:
                return True
            self.last, self.call = max(self.last, self.call), None
            return False

    def cut(self, sids: list[str], timeout_s: float) -> dict:
        """Cut prompts ``sids`` (the actor's cut thread): {"answers": the answers of those still running, as JSON,
        "over": those answered already, in their call's stream}; the rest were not started and never will be."""
        box, done = {}, threading.Event()
        with self.lock:
            if self.call is None:  # no call running: each one is over or not started
                self.dropped.update(s for s in sids if sub_call(s) > self.last)
                return {"answers": [], "over": [s for s in sids if sub_call(s) <= self.last]}
            self.waiting.append((sids, box, done))
        if not done.wait(timeout_s):
            raise TimeoutError(f"the engine did not reach a step boundary within {timeout_s:.0f} s to cut")
        return box

    def _cut(self, sids: list[str]) -> dict:
        from align.rollout.cut import cut_request

        running = [s for s in sids if s in self.w.running]
        first = len(self.w.answers)  # 0: the call's earlier answers went out after the step that made them
        if running:
            self.w.serve_cut(cut_request(running))  # the single worker's cut: rows so far, then aborted
        taken = [m for m in self.w.answers[first:] if m.kind != "cut_done"]
        del self.w.answers[first:]
        rest = [s for s in sids if s not in {m.id for m in taken}]
        self.dropped.update(s for s in rest if sub_call(s) > self.call)
        return {"answers": [m.to_json() for m in taken], "over": [s for s in rest if sub_call(s) <= self.call]}


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
