"""The rollout fleet's engine actor and the driver's records of engines and work (``EngineSlot``, ``Job``, ``Call``).

The actor runs ``rollout_worker.Worker``'s own request handling (``serve_generate`` / ``serve_sync``) on its vLLM
engine; its answers come back to the driver (``fleet_driver.py``) instead of going to the spool. It imports neither
``fleet.py`` nor ``fleet_driver.py`` (they import it). Stdlib only at import: ray is imported inside
``engine_actor_class``.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Iterator

import rollout_worker as rw  # stdlib only at import; puts the repo root on sys.path
from fleet_cut import EngineLoop

from align.rollout import protocol as P

# ---------------------------------------------------------------------------------------------
# The engine actor (runs in a Ray worker process)

CALL_THREADS = 64  # driver calls an engine holds at once (each waits on its stream); more wait in Ray's queue


def engine_actor_class():
    """The Ray actor class (built here so that importing this module never imports ray)."""
    import ray

    @ray.remote(concurrency_groups={"health": 1, "cut": 1, "calls": CALL_THREADS})
    class EngineActor:
        """One vLLM engine: ``rollout_worker.Worker`` serving message lists handed over by the driver."""

        def __init__(self, worker_argv: list[str], model_dir: str, version: int) -> None:
            import tempfile

            class EngineWorker(rw.Worker):
                def heartbeat(self) -> None:  # the driver writes the fleet's one heartbeat
                    pass

                def answer(self, msg: P.Message) -> None:
                    self.answers.append(msg)

            self.scratch = tempfile.mkdtemp(
                prefix="align-engine-"
            )  # Worker wants a spool; the driver owns the real one
            argv = [*worker_argv, "--spool", self.scratch, "--model", model_dir, "--weights-version", str(version)]
            self.w = EngineWorker(rw.parse_args(argv))
            self.w.answers = []
            self.w.llm = self.w.build_engine(self.w.model_dir)
            self.w.state = "ready"
            self.loop = EngineLoop(self.w)  # steps the engine on its own thread (fleet_cut.py)

        def info(self) -> dict:
            return {"pid": os.getpid(), "node": ray.util.get_node_ip_address(), "node_id": ray.get_runtime_context().get_node_id(),
                    "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
                    "cpu_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"), "version": self.w.version}  # fmt: skip

        def sync(self, message: str) -> list[str]:
            with self.loop.step_lock:  # between two engine steps (the driver syncs only with no request in flight)
                self.w.serve_sync(P.Message.from_json(message))
                out, self.w.answers = self.w.answers, []  # the sync's answer, not a call's
            return [m.to_json() for m in out]

        @ray.method(concurrency_group="calls")
        def generate(self, messages: list[str]) -> Iterator[list[str]]:
            """A call's prompts join the engine; a generator (the driver calls it with ``num_returns="streaming"``):
            each prompt's answer goes out after the step that finished it, so the driver answers a request (and the
            trainer's ``--partial-rollouts`` counts its group complete) while the call's other prompts still run."""
            yield from self.loop.serve(messages)

        @ray.method(concurrency_group="cut")
        def cut(self, sub_ids: list[str], timeout_s: float) -> dict:
            return self.loop.cut(sub_ids, timeout_s)  # fleet_cut.py

        def version(self) -> int:
            return self.w.version

        @ray.method(concurrency_group="health")
        def ping(self) -> int:
            return os.getpid()

        def close(self) -> None:
            import shutil

            with self.loop.step_lock:
                self.w.drop_engine()
            shutil.rmtree(self.scratch, ignore_errors=True)

    return EngineActor


# ---------------------------------------------------------------------------------------------
# The driver's records


@dataclasses.dataclass
class EngineSlot:
    index: int
    bundles: list[int]
    actor: object = None
    state: str = "starting"  # starting | ready | restarting | dead
    version: int | None = None
    outstanding: int = 0  # tokens of work routed and not yet answered
    served: int = 0  # prompts answered
    restarts: int = 0
    started_at: float = 0.0
    pinging: bool = False
    info: dict = dataclasses.field(default_factory=dict)
    error: str | None = None

    def report(self) -> dict:
        keep = ("index", "bundles", "state", "version", "outstanding", "served", "restarts", "error")
        return {**{k: getattr(self, k) for k in keep}, **self.info}


@dataclasses.dataclass
class Job:
    """One client generate request, split by prompt across engines."""

    msg: P.Message
    params: P.SamplingParams
    claimed_at: float
    remaining: set[int]
    parts: dict = dataclasses.field(default_factory=dict)  # prompt index -> list of completion dicts
    engines: dict = dataclasses.field(default_factory=dict)  # engine index -> prompts served
    dispatched_at: float = dataclasses.field(default_factory=time.time)

    def work(self, i: int) -> int:
        return self.params.n * (len(self.msg.body["prompts"][i]) + self.params.max_tokens)

    def sub_message(self, i: int, sub_id: str) -> str:
        """Prompt ``i`` with its n samples as a one-prompt request for an engine (``sub_id``: its id in the call)."""
        first = self.msg.body.get("first_prompt_index", 0)  # a torchrun rank's share: seeds by global prompt index
        seed = None if self.params.seed is None else rw.sample_seed(self.params.seed, first + i, 0)
        params = dataclasses.replace(self.params, seed=seed)  # a per-prompt seed: same samples on any engine
        return P.generate_request([self.msg.body["prompts"][i]], params, id=sub_id).to_json()


@dataclasses.dataclass
class Call:
    kind: str  # generate | start | ping
    engine: EngineSlot
    actor: object = None
    items: list[tuple[Job, int]] = dataclasses.field(default_factory=list)  # (request, prompt index), in call order
    seq: int = 0  # a generate call's number (fleet_cut.sub_id)
    taken: set = dataclasses.field(default_factory=set)  # the places in ``items`` answered so far

    def work(self) -> int:
        """The work of its prompts not answered yet."""
        return sum(job.work(i) for n, (job, i) in enumerate(self.items) if n not in self.taken)
