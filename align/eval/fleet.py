"""The eval fleet: dedicated rollout workers that load eval snapshots and never join training weight sync.

``--eval-num-gpus N`` (``/ --eval-num-gpus-per-engine``) engines, each a spool rollout worker (the vLLM worker of
``extras/vllm_rollout``; the CPU build of vLLM on a machine without GPUs) on its own spool dir. The training
loop's weight sync never reaches them: they only ever load exported snapshots, here, one eval point at a time.

``pin(checkpoint_dir, version)`` (as miles' ``EvalFleet``, radixark/miles ``miles/ray/rollout/eval_fleet.py``):

1. health: every worker process is alive, else ``EvalSkip("unhealthy")``;
2. load and verify, 2 attempts: every engine loads the snapshot (``sync_weights(dir, version)``), then every
   engine's weights version is read back from the engine itself (a one-token probe stamped with the version
   that produced it). One stale engine fails the attempt; after 2 failed attempts ``EvalSkip("pin_violation")``;
3. health probe: a one-token greedy generate on every engine, else ``EvalSkip("unhealthy")``;
4. return the ``FleetState`` (built once), whose ``generate`` spreads prompts over the pinned engines.

Workers start lazily on the first pin, with that snapshot as their model, on the dispatcher's runner thread: a
slow start or snapshot load never occupies the training loop. Uses only stdlib + ``align.rollout.client``.

With the Ray rollout fleet (``align.train --rollout-num-engines N > 1`` / ``--rollout-ray``) the eval engines are
Ray actors of that fleet instead, behind its eval router on one spool: ``EvalFleet.on_ray_router`` pins them the
same way (the router restarts dead engines, loads and reads every engine's version back; see
``extras/vllm_rollout/fleet.py``).
"""

from __future__ import annotations

import atexit
import itertools
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from align.eval.checkpoint_eval import EvalSkip, adapter_base_model
from align.eval.config import EvalConfig
from align.rollout.protocol import Completion, SamplingParams

logger = logging.getLogger(__name__)

PIN_ATTEMPTS = 2
PROBE = SamplingParams(n=1, temperature=0.0, max_tokens=1)
PROBE_PROMPT = [1, 2, 3]
MAX_MODEL_LEN = 4096
FLEET_PART = "eval fleet"  # the watchdog's name for the fleet's calls (align.heartbeat; EvalRunner.part)


def parallel_map(fn: Callable[[Any], Any], items: Sequence[Any], max_workers: int | None = None) -> list[Any]:
    """``[fn(x) for x in items]`` on up to ``max_workers`` (default: one per item) daemon threads; re-raises the
    first error in item order.

    Not a ``ThreadPoolExecutor``: its threads are joined at interpreter exit *before* atexit handlers run, so one
    hung engine call would hold up exit (and the atexit ``EvalFleet.close`` that would unblock it). A daemon thread
    left waiting on a hung engine never blocks exit."""
    if len(items) <= 1:
        return [fn(x) for x in items]
    results: list[Any] = [None] * len(items)
    errors: list[BaseException | None] = [None] * len(items)
    todo = iter(range(len(items)))
    todo_lock = threading.Lock()

    def work() -> None:
        while True:
            with todo_lock:
                i = next(todo, None)
            if i is None:
                return
            try:
                results[i] = fn(items[i])
            except BaseException as e:  # noqa: BLE001 - handed back to the caller below
                errors[i] = e

    n = min(len(items), max_workers or len(items))
    threads = [threading.Thread(target=work, daemon=True, name=f"align-eval-fanout-{i}") for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for e in errors:
        if e is not None:
            raise e
    return results


@dataclass
class FleetEngine:
    """One eval engine: a spool client and, when the fleet spawned it, the worker handle."""

    client: Any  # generate(prompts, params) -> list[Completion]; sync_weights(dir, version) -> float; close()
    handle: Any = None  # alive() -> bool; shutdown(); log_tail(n) -> str
    name: str = "engine"


class FleetState:
    """The pinned fleet's generate: prompts are spread round-robin over the engines and reassembled in order."""

    def __init__(self, engines: list[FleetEngine]) -> None:
        self.engines = engines
        self._calls = itertools.count()  # rotates the first engine: one-prompt calls (episode turns) spread too

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        e = len(self.engines)
        first = next(self._calls) % e
        shards = [(i, prompts[i::e]) for i in range(e) if prompts[i::e]]
        results = parallel_map(lambda s: self.engines[(first + s[0]) % e].client.generate(s[1], params), shards)
        out: list[Completion] = []
        for (i, _), completions in zip(shards, results):
            for c in completions:
                c.prompt_index = i + e * c.prompt_index  # local index within the shard -> global
                out.append(c)
        out.sort(key=lambda c: (c.prompt_index, c.sample_index))
        return out


class EvalFleet:
    """Dedicated eval engines. ``engines`` given: use them; else ``spawn(model_dir, version) -> engines`` on the first
    pin (engines that start on that snapshot already serve it: the pin then only verifies their version)."""

    def __init__(
        self,
        engines: list[FleetEngine] | None = None,
        *,
        spawn: Callable[[str, int], list[FleetEngine]] | None = None,
        attempts: int = PIN_ATTEMPTS,
        probe_retry_s: float = 5.0,
    ) -> None:
        if not engines and spawn is None:
            raise ValueError("EvalFleet needs engines or a spawn function")
        self.engines = list(engines or [])
        self._spawn = spawn
        self.attempts = attempts
        self.probe_retry_s = probe_retry_s
        self._state: FleetState | None = None
        self._closed = False
        self._lock = threading.Lock()  # one pin at a time
        self._close_lock = threading.Lock()  # separate: close() at exit must not wait for a hung pin
        self._cleanup: list[Callable[[], None]] = []
        self.root: str | None = None  # spools + logs of spawned workers (one dir per fleet, reused on a re-spawn)

    @classmethod
    def from_config(cls, cfg: EvalConfig, reserved_gpus: Iterable[Any] = ()) -> EvalFleet:
        """A fleet of ``cfg.num_engines`` spool vLLM workers, spawned on the first pin (see ``spawn_workers``).

        The GPU plan is made here, at startup: GPUs that are not visible, or that overlap ``reserved_gpus`` (e.g.
        ``--rollout-gpu``), are a ``ValueError`` now instead of an ``unhealthy`` skip at every eval point."""
        gpus = gpu_plan(cfg, visible_gpus(), reserved_gpus)
        fleet = cls(spawn=lambda model, version: [])  # placeholder, replaced below so the closure can see the fleet
        fleet._spawn = lambda model, version: spawn_workers(cfg, model, fleet, gpus=gpus, version=version)
        atexit.register(fleet.close)  # never orphan worker processes, even without drain()
        return fleet

    @classmethod
    def on_ray_router(cls, cfg: EvalConfig, eval_spool: str | os.PathLike, worker: Any = None) -> EvalFleet:
        """The eval engines of a Ray rollout fleet (``spawn_worker(..., eval_engines=M, eval_spool=eval_spool)``):
        one ``FleetEngine`` on the fleet's eval router, which spreads requests over its M engines. The first pin
        waits for the router (its engines start after the rollout engines, on the fleet's ``eval_model`` as
        ``eval_weights_version``: ``align.train`` starts them on the base model as version 0, the step-0 baseline,
        which that pin then only verifies; a first pin of any other version loads its snapshot). ``worker``: the fleet's handle (a dead driver fails a pin at
        once); the fleet is not this object's to stop (``close`` leaves it running)."""

        def connect(model_dir: str, version: int) -> list[FleetEngine]:
            from align.rollout.client import make_rollout_client

            client = make_rollout_client("spool", spool=eval_spool, timeout_s=cfg.eval_timeout_s, worker=worker)
            client.part = FLEET_PART
            wait_router_ready(client.spool, cfg.eval_timeout_s, worker)
            return [FleetEngine(RouterClient(client), name="ray-eval-router")]

        return cls(spawn=connect)

    def pin(self, checkpoint_dir: str, version: int) -> FleetState:
        """Load ``checkpoint_dir`` as ``version`` on every engine and verify it; see the module docstring."""
        with self._lock:
            if self._closed:
                raise RuntimeError("EvalFleet.pin after close()")
            started_on_it = False
            if not self.engines:
                try:
                    self.engines = self._spawn(checkpoint_dir, version)
                except Exception as e:
                    logger.error("Eval fleet unhealthy: could not start its workers: %s", e)
                    raise EvalSkip("unhealthy", str(e)) from e
                started_on_it = True
            self._check_alive()
            self._load_and_verify(checkpoint_dir, version, loaded=started_on_it)
            self._probe()
            if self._state is None:
                self._state = FleetState(self.engines)
            return self._state

    def _check_alive(self) -> None:
        """Every engine's process runs and heart-beats, else ``EvalSkip("unhealthy")`` naming the stopped ones (a
        SIGSTOPped or hung worker: its heartbeat goes stale) at once, not a wait on each of its calls."""
        dead = [(e, why) for e in self.engines if (why := _stopped(e))]
        if dead:
            tails = "; ".join(f"{e.name} ({why}): {_tail(e)}" for e, why in dead)
            logger.error("Eval fleet unhealthy: %d dead or stopped engine(s): %s", len(dead), tails)
            raise EvalSkip("unhealthy", ", ".join(f"{e.name}: {why}" for e, why in dead))

    def _load_and_verify(self, checkpoint_dir: str, version: int, loaded: bool = False) -> None:
        """``loaded``: the engines just started on ``checkpoint_dir`` as ``version``; the first attempt only verifies
        (a caller-owned dir such as the base model at step 0 has no commit marker, which a load would require)."""
        versions: list[Any] = []
        for attempt in range(1, self.attempts + 1):
            try:
                if not (loaded and attempt == 1):
                    self._each(lambda e: e.client.sync_weights(checkpoint_dir, version))
                versions = self._each(read_version)
            except Exception as e:  # noqa: BLE001 - a failed load is a failed attempt (then pin_violation)
                logger.warning("Weight pin to %s failed (attempt %d/%d): %s", checkpoint_dir, attempt, self.attempts, e)
                self._check_alive()  # an engine that died or stopped is unhealthy, not a pin violation
                continue
            if all(v == version for v in versions):
                return
            logger.warning(
                "Weight pin to %s failed (attempt %d/%d): versions %s", checkpoint_dir, attempt, self.attempts, versions
            )
        logger.error("Failed to pin weight_version=%s to %s (got %s)", version, checkpoint_dir, versions)
        raise EvalSkip("pin_violation", f"engines report {versions}, expected {version}")

    def _probe(self) -> None:
        deadline = time.monotonic() + self.probe_retry_s
        while True:
            try:
                self._each(lambda e: e.client.generate([PROBE_PROMPT], PROBE))
                return
            except Exception as e:
                if time.monotonic() >= deadline:
                    logger.error("Eval fleet unhealthy: health probe failed: %s", e)
                    raise EvalSkip("unhealthy", f"health probe failed: {e}") from e
                time.sleep(0.5)

    def _each(self, fn: Callable[[FleetEngine], Any]) -> list[Any]:
        return parallel_map(fn, self.engines)

    def close(self) -> None:
        """Shut down every engine this fleet owns (a pin in progress then fails). Idempotent."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
            for e in self.engines:
                for step in (getattr(e.client, "close", None), getattr(e.handle, "shutdown", None)):
                    if step is None:
                        continue
                    try:
                        step()
                    except Exception as err:  # noqa: BLE001 - keep shutting down the others; say what failed
                        logger.warning("closing eval engine %s: %s", e.name, err)
            for fn in self._cleanup:
                fn()


class RouterClient:
    """A Ray fleet's eval router as one eval engine's client. ``weights_version()`` is the version of every eval
    engine as the router read it back from the engine itself after the last load (its heartbeat, which it writes
    before answering the load); one that is not ready or not on the same version makes it a list of all of them,
    which equals no pinned version (``pin_violation``)."""

    def __init__(self, client: Any) -> None:
        self.client = client

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        return self.client.generate(prompts, params)

    def sync_weights(self, snapshot_dir: str, version: int) -> float:
        return self.client.sync_weights(snapshot_dir, version)

    def weights_version(self) -> Any:
        engines = (self.client.spool.read_heartbeat() or {}).get("engines") or []
        versions = [e.get("version") if e.get("state") == "ready" else e.get("state") for e in engines]
        return versions[0] if versions and all(v == versions[0] for v in versions) else versions

    def close(self) -> None:
        self.client.close()


def wait_router_ready(spool: Any, timeout_s: float, worker: Any = None) -> dict:
    """Wait until the eval router on ``spool`` reports ``ready``; ``RuntimeError`` (with why) when it failed, its
    fleet exited, or ``timeout_s`` passed."""
    deadline = time.monotonic() + timeout_s
    while True:
        hb = spool.read_heartbeat() or {}
        if hb.get("state") in ("ready", "busy"):
            return hb
        if hb.get("state") == "failed":
            raise RuntimeError(f"the eval router on {spool.root} failed: {hb.get('error')}")
        if worker is not None and not worker.alive():
            raise RuntimeError(f"the rollout fleet exited before its eval router was ready:\n{worker.log_tail(20)}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the eval router on {spool.root} was not ready within {timeout_s:.0f} s (last: {hb})")
        time.sleep(0.5)


def read_version(engine: FleetEngine) -> Any:
    """The engine's weights version, read back from the engine: its own accessor if the client has one, else the
    version stamped on a one-token probe completion."""
    getter = getattr(engine.client, "weights_version", None)
    if callable(getter):
        return getter()
    (c,) = engine.client.generate([PROBE_PROMPT], PROBE)[:1]
    return c.weights_version


def _stopped(e: FleetEngine) -> str | None:
    """Why engine ``e`` cannot answer (its process exited, or its spool heartbeat is stale), or None."""
    if e.handle is not None and not e.handle.alive():
        return "its process exited"
    spool, stale_s = getattr(e.client, "spool", None), getattr(e.client, "stale_s", None)
    if spool is None or stale_s is None:
        return None
    from align.rollout.spool import heartbeat_problem

    return heartbeat_problem(spool.read_heartbeat(), stale_s)


def _tail(e: FleetEngine) -> str:
    try:
        return e.handle.log_tail(5)
    except Exception as err:  # noqa: BLE001 - the tail is only diagnostics
        return f"<no log: {err}>"


def spawn_workers(
    cfg: EvalConfig, model_dir: str, fleet: EvalFleet, *, gpus: list[str] | None, version: int = 0
) -> list[FleetEngine]:
    """Start ``cfg.num_engines`` spool vLLM workers, each on its own spool, serving ``model_dir`` as ``version``.

    ``gpus``: the per-engine ``CUDA_VISIBLE_DEVICES`` from ``gpu_plan``; None: the CPU build of vLLM, with the engine
    in the worker process (starts in seconds instead of ~30 s). All engines start in parallel. Spools and logs go to
    one ``fleet-*`` dir under ``--eval-hf-dir`` per fleet (a re-spawn reuses it); the spools go at close, the logs
    stay for post-mortems until the next run's startup removes them.
    """
    from align.rollout.client import make_rollout_client, spawn_worker

    if fleet.root is None:
        os.makedirs(cfg.eval_hf_dir, exist_ok=True)
        fleet.root = tempfile.mkdtemp(prefix="fleet-", dir=cfg.eval_hf_dir)  # never a step_N name
        for i in range(cfg.num_engines):
            spool_dir = os.path.join(fleet.root, f"engine_{i}")
            fleet._cleanup.append(lambda d=spool_dir: shutil.rmtree(d, ignore_errors=True))
    root = fleet.root
    model_dir, extra = _serving_base(model_dir)
    max_model_len, dtype = _model_info(model_dir)
    if cfg.eval_num_gpus_per_engine > 1:
        extra += ["--tensor-parallel-size", str(cfg.eval_num_gpus_per_engine)]
    engines: list[FleetEngine] = []
    try:
        for i in range(cfg.num_engines):
            spool = os.path.join(root, f"engine_{i}")
            handle = spawn_worker(
                spool,
                gpu=gpus[i] if gpus else None,
                log_path=os.path.join(root, f"engine_{i}.log"),
                model=model_dir,
                weights_version=version,
                max_model_len=max_model_len,
                dtype=dtype,
                in_process=gpus is None,
                extra_args=extra,
                wait_ready=False,
            )
            client = make_rollout_client("spool", spool=spool, timeout_s=cfg.eval_timeout_s, worker=handle)
            client.part = FLEET_PART  # its calls are the eval fleet's in stall.txt, not the sampler's
            engines.append(FleetEngine(client=client, handle=handle, name=f"eval_engine_{i}"))
        for e in engines:
            e.handle.wait_ready(cfg.eval_timeout_s)
    except BaseException:
        for e in engines:
            e.handle.shutdown(grace_s=0)
        raise
    logger.info("eval fleet up: %d engine(s), logs under %s", len(engines), root)
    return engines


def _serving_base(model_dir: str) -> tuple[str, list[str]]:
    """The model the engines start on and their extra flags: a LoRA adapter snapshot (PEFT dir) is served on its
    base model with ``--max-lora-rank`` (each pin then loads the adapter as a new LoRARequest); else itself."""
    base = adapter_base_model(model_dir)
    if base is None:
        return model_dir, []
    with open(os.path.join(model_dir, "adapter_config.json")) as f:
        rank = int(json.load(f)["r"])
    return base, ["--max-lora-rank", str(rank)]


def _model_info(model_dir: str) -> tuple[int, str]:
    """The engines' context (the model's own, capped: eval prompts + completions are short) and dtype: the
    snapshot's own, so the eval measures the exported weights (vLLM's "auto" would downcast float32)."""
    with open(os.path.join(model_dir, "config.json")) as f:
        hf = json.load(f)
    n = hf.get("max_position_embeddings") or MAX_MODEL_LEN
    dtype = hf.get("torch_dtype") or hf.get("dtype") or "auto"
    return min(int(n), MAX_MODEL_LEN), dtype if dtype in ("float32", "bfloat16", "float16") else "auto"


def visible_gpus() -> list[str]:
    """The GPUs this process may use, as absolute ``CUDA_VISIBLE_DEVICES`` ids, in CUDA index order."""
    import torch  # runtime only, never at import

    count = torch.cuda.device_count()
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is None:
        return [str(i) for i in range(count)]
    return [g.strip() for g in env.split(",") if g.strip()][:count]


def gpu_plan(cfg: EvalConfig, visible: Sequence[str], reserved: Iterable[Any] = ()) -> list[str] | None:
    """Per-engine ``CUDA_VISIBLE_DEVICES`` values (``"4"``, or ``"4,5"`` for tensor parallel), or None: no GPU is
    visible, the engines run the CPU build of vLLM. Pure: ``visible`` is ``visible_gpus()``.

    ``--eval-first-gpu`` counts in the visible list (like ``cuda:N``; default: its last ``--eval-num-gpus``);
    the values written are the ids at those positions, so ``CUDA_VISIBLE_DEVICES=4,5`` with first GPU 1 gives
    ``"5"``, not GPU 1. Raises ``ValueError`` when the plan needs GPUs that are not visible or overlaps
    ``reserved`` (absolute ids the run already uses, e.g. ``--rollout-gpu``)."""
    visible = [str(g) for g in visible]
    if not visible or cfg.eval_num_gpus <= 0:
        return None
    n, per = cfg.eval_num_gpus, cfg.eval_num_gpus_per_engine
    first = cfg.eval_first_gpu if cfg.eval_first_gpu is not None else len(visible) - n
    if first < 0 or first + n > len(visible):
        raise ValueError(
            f"the eval fleet needs {n} GPU(s) from visible index {max(first, 0)} on, but only {len(visible)} are "
            f"visible ({','.join(visible)}); lower --eval-num-gpus or --eval-first-gpu, or make more GPUs visible"
        )
    mine = visible[first : first + n]
    taken = sorted({str(g) for g in reserved if g is not None} & set(mine))
    if taken:
        raise ValueError(
            f"the eval fleet's GPUs {','.join(mine)} overlap GPU(s) {','.join(taken)} this run already uses "
            "(--rollout-gpu); set --eval-first-gpu to a free range or move the rollout worker"
        )
    return [",".join(mine[i * per : (i + 1) * per]) for i in range(cfg.num_engines)]
