"""The rollout fleet's driver: one spool router (``FleetWorker``) over N vLLM engine actors, and the eval router.

``fleet.py`` (the command line) builds a ``FleetWorker`` and runs it; ``fleet_engine.py`` holds the engine actor and
the records of engines and work. Imported by module name with this folder on ``sys.path`` (the driver's own, set by
``fleet.py``; the actors', set by ``_actor_env``). Stdlib only at import: ray is imported inside the methods.

Design:
- The driver (this process) owns the Ray placement group (``placement.plan``: trainer region first, rollout
  next or overlapping the trainer when colocated; one GPU per bundle) and one ``EngineActor`` per engine
  (tensor parallel = GPUs per engine; ``fleet_engine.py``). Each actor runs ``rollout_worker.Worker``'s own request handling
  (``serve_generate`` / ``serve_sync``) on its engine; only the answers come back to the driver instead of the spool,
  a generate call's as a stream (each prompt's answer after the engine step that finished it).
- Routing: each prompt of a generate request, with its n samples (prefix caching pays), goes to the healthy
  engine with the least outstanding work (n x (prompt + max_tokens) tokens). A prompt's sampling seed is derived
  from (request seed, prompt index), so a seeded request gives the same samples whichever engine serves it.
- Cuts (protocol minor 2, ``--partial-rollouts``): each engine actor cuts its own prompts of the named requests
  between two engine steps with the single worker's ``serve_cut`` (``fleet_cut.py``); a cut queued behind a weight
  sync is served while the sync waits for the engines to drain.
- Weight sync: the driver lets in-flight requests finish, reloads the snapshot on every engine, reads each
  engine's version back, and answers only when all agree. Completions carry the producing engine's version.
- Faults: a dead engine (failed call or health ping) is reported in the heartbeat, its prompts go to healthy
  engines, and it is restarted on the current snapshot, at most ``--rollout-engine-restarts`` times per fleet
  (in total). With every engine dead and no restart left the driver fails (heartbeat ``failed``, exit 1), so
  the trainer's client raises ``WorkerDiedError`` within its timeout.
- Eval fleet: with ``--eval-spool`` the ``--eval-num-gpus`` engines run in the bundles appended after every
  other region, behind their own router on that spool, and never see training weight syncs: each eval point
  pins them through that spool (``align.eval.fleet.EvalFleet``: reload, version read-back, probe). The eval
  router runs in ``EvalRunner``, a Ray actor this driver owns (on its node, so the eval spool needs no other
  filesystem), so an eval point's snapshot load or long generate never occupies the rollout router: rollout
  requests and training weight syncs go on meanwhile. A dead eval engine is reported in the eval heartbeat and
  restarted at the next eval point, on that point's snapshot (each point restarts every dead eval engine once);
  requests it leaves with no live eval engine are answered with an error (the point is skipped), never a hang.
- Multi-node: ``--ray-address`` joins an existing cluster; the spool must then be on a filesystem that the
  trainer and the driver share (the engine actors never touch the spool). One-GPU engines are spread over the
  nodes (``placement.pg_strategy``); a dead node's bundles are re-reserved by Ray on a node with a free GPU and
  its engines restarted there (a restart cancelled by the dying node is retried). Without it a local Ray instance is
  started; on a machine without GPUs it declares logical GPUs so placement is exercised and runs vLLM's CPU build.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import threading
import time
import traceback
from pathlib import Path

import rollout_worker as rw  # stdlib only at import; puts the repo root on sys.path
from fleet_cut import FleetCuts, sub_id, sub_index
from fleet_engine import Call, EngineSlot, Job, engine_actor_class
from placement import Plan, pg_strategy, plan_from_args
from worker_commands import snapshot_problem

from align.rollout import protocol as P

log = logging.getLogger("rollout_fleet")

HERE = Path(__file__).resolve().parent
LOCAL_OBJECT_STORE_BYTES = 256 * 1024**2  # requests and answers are small; Ray's default takes 30% of RAM
# Environment variables the engine actors inherit from the driver (Ray workers do not see the driver's env).
_ENV_PREFIXES = ("VLLM_", "TORCHINDUCTOR_", "TRITON_", "HF_", "OMP_", "PYTHONUNBUFFERED")
# Ray's core worker calls nice(RayConfig worker_niceness) as it starts, 15 by default (ray_config_def.h; read from this
# variable in the worker's environment, as Ray's job manager sets it for its supervisor): under load the engines
# starved beside the trainer (tests/test_fleet_nodes.py 600-1025 s loaded vs 92 s quiet). 0 = the driver's niceness.
NICENESS_VAR = "RAY_worker_niceness"


# the protocol minor the fleet serves (a minor includes every one below it): score (1) and cut (2, fleet_cut.py); not
# sleep mode (3) nor MoE routes (4), so a client needing those refuses the fleet before sending anything
FLEET_MINOR = 2


class FleetSpool(P.Spool):
    """The spool, with the fleet's engine report added to every heartbeat."""

    def __init__(self, root: str | os.PathLike, report) -> None:
        super().__init__(root)
        self.report = report

    def write_heartbeat(self, state: str, **info: object) -> None:
        super().write_heartbeat(state, **info, **self.report(), minor=FLEET_MINOR)


class FleetWorker(FleetCuts, rw.Worker):
    """``rollout_worker.Worker``'s main loop (claiming, recovery, heartbeat, shutdown) over a fleet of engines."""

    def __init__(
        self,
        args: argparse.Namespace,
        fargs: argparse.Namespace,
        engine_argv: list[str],
        region: str = "rollout",
        pg: object = None,
        cpu_build: bool = False,
    ) -> None:
        super().__init__(args)
        self.fargs, self.engine_argv, self.region = fargs, engine_argv, region
        self.plan = plan_from_args(fargs)
        self.lock = threading.RLock()
        bundles = self.plan.rollout_engines if region == "rollout" else self.plan.eval_engines
        self.engines = [EngineSlot(k, b) for k, b in enumerate(bundles)]
        self.spool = FleetSpool(self.spool.root, self.report)
        self.jobs: dict[str, Job] = {}
        self.inflight: dict[object, Call] = {}
        self.backlog: list[tuple[Job, int]] = []
        self.calls = 0  # generate calls made to engines (their number names their prompts: fleet_cut.sub_id)
        self.deaths: list[dict] = []
        self.restarts_left = fargs.rollout_engine_restarts  # rollout only: eval engines restart per eval point
        self.eval_argv: list[str] | None = None  # the eval router's worker flags (--eval-spool): run by EvalRunner
        self.eval_runner = None  # the EvalRunner actor (rollout router only)
        self.stopping = False
        self.target = (self.model_dir, self.version)  # the snapshot a (re)started engine loads
        self.fatal: str | None = None
        self.pg, self.actor_cls = pg, None  # pg given: the eval router, in the rollout router's placement group
        self.ray_up = False
        self.cpu_build = cpu_build  # local Ray on a machine without GPUs (set when Ray starts)
        self._halt = threading.Event()
        self._loop = threading.Thread(target=self._fleet_loop, daemon=True, name="fleet")

    # -- heartbeat -------------------------------------------------------------------------------
    def report(self) -> dict:
        with self.lock:
            engines = [e.report() for e in self.engines]
            out = {"region": self.region, "engines": engines, "engine_deaths": list(self.deaths),
                   "engines_ready": sum(e["state"] == "ready" for e in engines)}  # fmt: skip
            if self.region == "rollout":
                out["engine_restarts_left"] = self.restarts_left
            return out

    # -- Ray --------------------------------------------------------------------------------------
    def build_engine(self, model_dir: Path):
        """Start (or join) Ray, reserve the placement group, start every engine; raise if any fails."""
        import ray
        from ray.util.placement_group import placement_group

        f = self.fargs
        if self.region == "eval":  # in the EvalRunner actor: Ray is up, the placement group is the driver's
            self.actor_cls = engine_actor_class()
            return self._start_all()
        os.environ.setdefault(NICENESS_VAR, "0")  # a local cluster's workers inherit it; an attached one: _actor_env
        if f.ray_address:
            ray.init(address=f.ray_address, log_to_driver=True)
        else:
            num_gpus = f.ray_num_gpus if f.ray_num_gpus is not None else _local_gpus(self.plan)
            self.cpu_build = num_gpus is not None and f.ray_num_gpus is None
            ray.init(address="local", num_gpus=num_gpus, include_dashboard=False, log_to_driver=True,
                     object_store_memory=LOCAL_OBJECT_STORE_BYTES)  # fmt: skip
        self.ray_up = True
        n = self.plan.num_bundles if self.eval_argv else self.plan.num_bundles - len(self.plan.eval)
        self.pg = placement_group([{"GPU": 1.0}] * n, strategy=pg_strategy(self.plan))
        ready, _ = ray.wait([self.pg.ready()], timeout=f.engine_start_timeout_s)
        if not ready:
            raise RuntimeError(
                f"the placement group of {n} GPU bundles was not ready within {f.engine_start_timeout_s:.0f} s; "
                f"cluster resources: {ray.cluster_resources()}, available: {ray.available_resources()}"
            )
        self.actor_cls = engine_actor_class()
        self._start_all()
        if self.eval_argv is not None:
            self._start_eval_runner()
        return self

    def _start_all(self):
        """Start every engine of this router and wait for all; raise if one fails."""
        import ray

        f = self.fargs
        with self.lock:
            calls = [self._start_engine(e) for e in self.engines]
        refs = list(calls)
        for ref in refs:
            e = self.inflight.pop(ref).engine
            try:
                info = ray.get(ref, timeout=f.engine_start_timeout_s)
            except Exception as err:
                raise RuntimeError(f"engine {e.index} (bundles {e.bundles}) failed to start: {err}") from err
            self._engine_up(e, info)
        log.info("%s fleet of %d engines up: %s", self.region, len(self.engines), [e.report() for e in self.engines])
        self._loop.start()
        return self

    def _start_eval_runner(self) -> None:
        """The eval router in its own actor, on this driver's node (the eval spool is local to the driver)."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        self.eval_runner = (
            eval_runner_class()
            .options(num_cpus=0, scheduling_strategy=here, runtime_env={"env_vars": _actor_env()})
            .remote(self.eval_argv, vars(self.fargs), self.engine_argv, self.pg, self.cpu_build)
        )
        log.info("eval router started in its runner actor (pid %s)", ray.get(self.eval_runner.pid.remote()))

    def _start_engine(self, e: EngineSlot, retry: bool = False):
        """Start engine ``e``'s actor in its bundle; ``retry`` keeps the clock of the start it repeats."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        env = _actor_env()
        tp = len(e.bundles)
        if self.cpu_build and "VLLM_CPU_OMP_THREADS_BIND" not in env:
            # vLLM CPU binds every engine's OpenMP threads to the same cores by default: spread them instead
            cores = sorted(os.sched_getaffinity(0))
            env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(cores[b % len(cores)]) for b in e.bundles)
        if tp > 1:  # vLLM's Ray executor places its TP workers on these bundles of the captured group
            env["VLLM_RAY_BUNDLE_INDICES"] = ",".join(map(str, e.bundles))
        strategy = PlacementGroupSchedulingStrategy(
            self.pg, placement_group_bundle_index=e.bundles[0], placement_group_capture_child_tasks=True
        )
        path, version = self.target
        argv = [*self.engine_argv, "--tensor-parallel-size", str(tp)]
        e.actor = self.actor_cls.options(
            num_cpus=0, num_gpus=1 if tp == 1 else 0, scheduling_strategy=strategy, runtime_env={"env_vars": env}
        ).remote(argv, str(path), version)
        e.started_at = e.started_at if retry else time.monotonic()
        ref = e.actor.info.remote()
        self.inflight[ref] = Call("start", e, e.actor)
        return ref

    def _engine_up(self, e: EngineSlot, info: dict) -> None:
        e.state, e.version, e.error, e.outstanding, e.pinging = "ready", info.pop("version"), None, 0, False
        e.info = info
        log.info("engine %d ready: %s", e.index, e.report())

    def drop_engine(self) -> None:
        if self.eval_runner is not None:
            import ray

            with contextlib.suppress(Exception):
                ray.get(self.eval_runner.stop.remote(), timeout=90)
            with contextlib.suppress(Exception):
                ray.kill(self.eval_runner, no_restart=True)
            self.eval_runner = None
        self._halt.set()
        if self._loop.is_alive():
            self._loop.join(timeout=10)
        if self.actor_cls is None and not self.ray_up:
            return
        import ray

        for e in self.engines:
            if e.actor is not None and e.state == "ready":
                with contextlib.suppress(Exception):
                    ray.get(e.actor.close.remote(), timeout=30)
            if e.actor is not None:
                with contextlib.suppress(Exception):
                    ray.kill(e.actor, no_restart=True)
        self.actor_cls = None
        if self.ray_up:
            with contextlib.suppress(Exception):
                ray.shutdown()
        self.ray_up = False

    # -- routing --------------------------------------------------------------------------------
    def serve_generate(self, batch: list[tuple[P.Message, float]]) -> None:
        """Route the prompts of the claimed requests to engines and return at once; the fleet loop answers.

        One call per engine carries all its prompts of the batch, so the engine serves them as one vLLM batch.
        """
        items: list[tuple[Job, int]] = []
        for msg, claimed_at, params in self.checked(batch):
            job = Job(msg, params, claimed_at, set(range(len(msg.body["prompts"]))))
            items += [(job, i) for i in sorted(job.remaining)]
        with self.lock:
            for job, _ in items:
                self.jobs[job.msg.id] = job
            self._route(items)

    def _route(self, items: list[tuple[Job, int]]) -> None:
        items = [(job, i) for job, i in items if self.jobs.get(job.msg.id) is job and i in job.remaining]  # unanswered
        if not items:
            return
        healthy = [e for e in self.engines if e.state == "ready"]
        if not healthy:
            if any(e.state in ("starting", "restarting") for e in self.engines):
                self.backlog += items
            elif self.region == "eval":  # the eval point fails (skipped); the next one restarts the engines
                for job in {id(job): job for job, _ in items}.values():
                    if self.jobs.pop(job.msg.id, None) is not None:
                        why = "every eval engine is dead; they are restarted at the next eval point's weight load"
                        self.answer(P.error_response(job.msg.id, "engine_dead", why))
            else:
                self._fail("every engine is dead and no restart is left")
            return
        chosen: dict[int, list[tuple[Job, int]]] = {}
        for job, i in items:
            e = min(healthy, key=lambda x: (x.outstanding, x.index))
            e.outstanding += job.work(i)
            chosen.setdefault(e.index, []).append((job, i))
        for k, its in chosen.items():
            e, self.calls = self.engines[k], self.calls + 1
            messages = [job.sub_message(i, sub_id(self.calls, n)) for n, (job, i) in enumerate(its)]
            ref = e.actor.generate.options(num_returns="streaming").remote(messages)  # answers as prompts finish
            self.inflight[ref] = Call("generate", e, e.actor, its, self.calls)

    def next_batch(self):
        if self.stopping:
            raise _Stopped
        if self.fatal:
            raise RuntimeError(f"rollout fleet failed: {self.fatal}")
        return super().next_batch()

    # -- the fleet loop: answers, deaths, restarts, health pings ----------------------------------
    def _fleet_loop(self) -> None:
        import ray

        last_ping = 0.0
        while not self._halt.is_set():
            try:
                with self.lock:
                    refs = list(self.inflight)
                    if time.monotonic() - last_ping >= self.args.heartbeat_s:
                        last_ping = time.monotonic()
                        self._ping_all()
                    self._check_start_timeouts()
                if not refs:
                    time.sleep(self.args.poll_s)
                    continue
                done, rest = ray.wait(refs, num_returns=1, timeout=self.args.poll_s)  # returns at the first answer
                if done and rest:
                    done += ray.wait(rest, num_returns=len(rest), timeout=0)[0]
                for ref in done:
                    self._on_done(ref)
            except Exception as e:  # noqa: BLE001 - a bug here must fail the fleet visibly, not hang the trainer
                log.error("fleet loop failed:\n%s", traceback.format_exc())
                self.fatal = self.fatal or f"fleet loop failed: {e.__class__.__name__}: {e}"
                return

    def _ping_all(self) -> None:
        for e in self.engines:
            if e.state == "ready" and not e.pinging:
                e.pinging = True
                self.inflight[e.actor.ping.remote()] = Call("ping", e, e.actor)

    def _check_start_timeouts(self) -> None:
        for e in self.engines:
            late = time.monotonic() - e.started_at > self.fargs.engine_start_timeout_s
            if e.state == "restarting" and late:
                self._engine_died(e, f"not ready within {self.fargs.engine_start_timeout_s:.0f} s of its restart")

    def _on_done(self, ref) -> None:
        import ray

        with self.lock:
            call = self.inflight.get(ref)
            if call is None or not ray.wait([ref], timeout=0)[0]:  # taken meanwhile (a cut takes streamed answers)
                return
            e = call.engine
            try:
                if call.kind == "generate":  # a stream: the answers of the prompts one engine step finished
                    return self._collect(call, [P.Message.from_json(m) for m in ray.get(next(ref))])
                del self.inflight[ref]
                result = ray.get(ref)
            except StopIteration:  # the call is over
                del self.inflight[ref]
                e.outstanding = max(0, e.outstanding - call.work())
                return
            except Exception as err:  # noqa: BLE001 - the actor died (or its engine broke): route around it
                self.inflight.pop(ref, None)
                if call.kind == "start" and call.actor is e.actor and e.state == "restarting" and _unscheduled(err):
                    # its bundle was still on a node that died meanwhile: Ray re-places the bundle, start again
                    log.warning("engine %d's restart was cancelled before it ran (its node died?); retrying", e.index)
                    self._start_engine(e, retry=True)
                    return
                if call.actor is e.actor and e.state in ("ready", "restarting"):
                    self._engine_died(e, f"{err.__class__.__name__}: {str(err).strip().splitlines()[-1][:300]}")
                if call.kind == "generate":
                    if call.actor is e.actor:
                        e.outstanding = max(0, e.outstanding - call.work())
                    self._route(call.items)
                return
            if call.kind == "ping":
                e.pinging = False
            elif call.kind == "start" and call.actor is e.actor:
                self._engine_up(e, result)
                backlog, self.backlog = self.backlog, []
                self._route(backlog)

    def _engine_died(self, e: EngineSlot, why: str) -> None:
        import ray

        log.error("engine %d (pid %s, bundles %s) died: %s", e.index, e.info.get("pid"), e.bundles, why)
        self.deaths.append({"index": e.index, "pid": e.info.get("pid"), "time": time.time(), "error": why})
        with contextlib.suppress(Exception):
            ray.kill(e.actor, no_restart=True)
        e.error, e.outstanding, e.pinging = why, 0, False
        if self.region == "eval":
            e.state = "dead"
            log.info("eval engine %d is restarted at the next eval point's weight load", e.index)
        elif self.restarts_left > 0:
            self.restarts_left -= 1
            self._restart(e)
            log.info("restarting engine %d on %s (%d restart(s) left)", e.index, self.target[0], self.restarts_left)
        else:
            e.state = "dead"
            if not any(x.state in ("ready", "starting", "restarting") for x in self.engines):
                self._fail(f"all {len(self.engines)} engines are dead and no restart is left (last: {why})")

    def _restart(self, e: EngineSlot) -> None:
        e.restarts += 1
        e.state = "restarting"
        self._start_engine(e)

    def _fail(self, why: str) -> None:
        if self.fatal is None:
            log.error("rollout fleet failed: %s; the trainer's client reports it as a dead worker", why)
            self.fatal = why

    def _collect(self, call: Call, answers: list[P.Message]) -> None:
        k, work = call.engine.index, call.work()
        for ans in answers:
            job, i = call.items[sub_index(ans.id)]
            call.taken.add(sub_index(ans.id))
            if job.msg.id not in self.jobs:  # already answered (an error in another part)
                continue
            if ans.kind == "error":
                self.jobs.pop(job.msg.id)
                b = ans.body
                self.answer(P.error_response(job.msg.id, b["error"], f"engine {k}: {b['message']}"))
                continue
            job.parts[i] = [{**c, "prompt_index": i} for c in ans.body["completions"]]
            job.remaining.discard(i)
            job.engines[k] = job.engines.get(k, 0) + 1
            call.engine.served += 1
            if not job.remaining:
                self._answer_job(self.jobs.pop(job.msg.id))
        call.engine.outstanding = max(0, call.engine.outstanding - (work - call.work()))

    def _answer_job(self, job: Job) -> None:
        comps = [c for i in sorted(job.parts) for c in job.parts[i]]
        gen_s = time.time() - job.dispatched_at
        tokens = sum(len(c["token_ids"]) for c in comps)
        timings = {
            "queue_s": max(0.0, job.claimed_at - job.msg.created), "generate_s": gen_s, "batch_requests": 1,
            "batch_completion_tokens": tokens, "completion_tokens": tokens, "tokens_per_s": tokens / max(gen_s, 1e-9),
            "engines": {str(k): v for k, v in sorted(job.engines.items())},
        }  # fmt: skip
        body = {"completions": comps, "weights_version": min(c["weights_version"] for c in comps)}
        self.answer(P.Message("completions", job.msg.id, {**body, "logprob_basis": self.basis, "timings": timings}))

    # -- weight sync ----------------------------------------------------------------------------
    def serve_sync(self, msg: P.Message) -> None:
        """Load the snapshot on every engine, read each version back, answer when all agree."""
        import ray

        path, version = Path(msg.body["path"]), msg.body["version"]
        problem = snapshot_problem(path)
        if problem is not None:
            return self.answer(P.error_response(msg.id, "bad_snapshot", problem))
        self.set_state("busy")
        t0 = time.perf_counter()
        deadline = time.monotonic() + self.fargs.call_timeout_s
        self._wait_idle(deadline)  # requests submitted before the sync are served by the old weights
        with self.lock:
            self.target = (path, version)  # an engine restarted from now on loads the new snapshot
            if self.region == "eval":  # eval point: every dead eval engine comes back on this snapshot
                for e in self.engines:
                    if e.state == "dead":
                        log.info("eval point: restarting dead eval engine %d on %s", e.index, path)
                        self._restart(e)
        methods = []
        for e in list(self.engines):
            if e.state != "ready":
                continue
            try:
                answers = ray.get(e.actor.sync.remote(msg.to_json()), timeout=_left(deadline))
                answer = P.Message.from_json(answers[-1])
                if answer.kind == "error":
                    return self.answer(P.error_response(msg.id, answer.body["error"], answer.body["message"]))
                read_back = ray.get(e.actor.version.remote(), timeout=_left(deadline))
            except Exception as err:  # noqa: BLE001 - a dead engine restarts on the new snapshot
                with self.lock:
                    self._engine_died(e, f"failed during weight sync: {err.__class__.__name__}")
                continue
            e.version = read_back
            methods.append(answer.body["method"])
        self._wait_idle(deadline)  # engines restarted meanwhile come up on the new snapshot
        with self.lock:
            live = [e for e in self.engines if e.state == "ready"]
            stale = [(e.index, e.version) for e in live if e.version != version]
        if stale or not live:
            problem = f"weight sync to version {version} incomplete: stale engines {stale}, {len(live)} live"
            if self.region != "eval":
                raise RuntimeError(problem)
            self.set_state("ready")  # the eval point is skipped (pin_violation); the router goes on serving
            return self.answer(P.error_response(msg.id, "sync_incomplete", problem))
        seconds = time.perf_counter() - t0
        self.model_dir, self.version = path, version
        self.vocab_size = int(json.loads((path / "config.json").read_text()).get("vocab_size", 0))
        log.info("weights version %d from %s on %d engines in %.2f s", version, path, len(live), seconds)
        method = "+".join(sorted(set(methods))) or "restart"
        self.set_state("ready")  # the heartbeat shows every engine's read-back version before the answer does
        self.answer(P.Message("synced", msg.id, {"version": version, "seconds": seconds, "method": method}))

    def _wait_idle(self, deadline: float) -> None:
        """Until no request is in flight and no engine is (re)starting; raises on fleet failure or timeout."""
        while True:
            if self.fatal:
                raise RuntimeError(f"rollout fleet failed: {self.fatal}")
            with self.lock:
                if not self.jobs and not any(e.state in ("starting", "restarting") for e in self.engines):
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(f"fleet not idle within --call-timeout-s {self.fargs.call_timeout_s}")
            self.cut_ahead()  # a cut queued behind this sync is served now (the single worker's way)
            time.sleep(self.args.poll_s)


class _Stopped(Exception):
    """The driver is shutting down: the eval router's loop ends cleanly."""


def serve_eval_router(w: FleetWorker) -> None:
    """The eval router's serving loop (in the EvalRunner actor) until the driver stops it."""
    error = None
    try:
        w.run()
    except _Stopped:
        pass
    except BaseException as e:  # noqa: BLE001 - the eval router fails alone; its heartbeat says why
        error = f"{e.__class__.__name__}: {e}"
        log.error("eval router failed:\n%s", traceback.format_exc())
    finally:
        w.close(error)


def eval_runner_class():
    """The ``EvalRunner`` Ray actor class (built here so that importing this module never imports ray)."""
    import ray

    @ray.remote(max_concurrency=4)
    class EvalRunner:
        """The eval router: a ``FleetWorker`` (region ``eval``) serving the eval spool with the eval engines of the
        driver's placement group, on a thread of this actor; the driver only starts and stops it."""

        def __init__(self, argv: list[str], fargs: dict, engine_argv: list[str], pg, cpu_build: bool) -> None:
            import logging
            import threading

            import fleet_driver  # this module by its name: Ray ships this class by value, the actor imports the rest

            logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
            ns = argparse.Namespace(**fargs)
            self.w = fleet_driver.FleetWorker(
                rw.parse_args(argv), ns, engine_argv, region="eval", pg=pg, cpu_build=cpu_build
            )
            self.thread = threading.Thread(target=fleet_driver.serve_eval_router, args=(self.w,), daemon=True)
            self.thread.start()

        def pid(self) -> int:
            return os.getpid()

        def stop(self) -> None:
            self.w.stopping = True
            self.thread.join(timeout=60)

    return EvalRunner


def _actor_env() -> dict[str, str]:
    """The environment of an actor this driver starts: its own VLLM_/HF_/... variables and the import path."""
    env = {k: v for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES)}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(HERE.parents[1])])
    env[NICENESS_VAR] = os.environ.get(NICENESS_VAR, "0")  # Ray renices its workers to 15 by default
    return env


def _unscheduled(err: Exception) -> bool:
    """An actor cancelled before it ran (a system failure such as its node's death, not an error in its code)."""
    import ray

    return isinstance(err, ray.exceptions.ActorDiedError) and not err.actor_init_failed and "never ran" in str(err)


def _left(deadline: float) -> float:
    return max(1.0, deadline - time.monotonic())


def _local_gpus(p: Plan) -> int | None:
    """None (Ray detects) when this machine has CUDA GPUs, else logical GPUs for the plan (the CPU build)."""
    import torch

    return None if torch.cuda.is_available() else p.num_bundles
