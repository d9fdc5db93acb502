"""Rollout clients: one interface over the native sampler and the spool-attached vLLM worker.

    client = make_rollout_client("native", model=model)                 # in-process, shares the live model
    client = make_rollout_client("spool", spool=dir, timeout_s=600)     # vLLM worker in .venv-rollout
    completions = client.generate(prompts, params)                      # list[Completion], (prompt, sample) order
    seconds = client.sync_weights(snapshot_dir, version)                # after publishing a committed snapshot
    client.close()

``client.logprob_basis`` says what ``Completion.logprobs`` holds (``protocol.LOGPROB_BASES``);
``protocol.logprob_basis_warning(client.logprob_basis, params)`` is the trainer's warning text.

``spawn_worker`` launches ``extras/vllm_rollout/rollout_worker.py`` under ``.venv-rollout`` in its
own process group (so teardown reaps vLLM's engine-core children) with the environment of
``protocol.worker_env``. Under torchrun, ``ShardedNativeClient`` / ``ShardedSpoolClient`` split a request between the
ranks (``align.dist``). Import cost: stdlib only; the native and sharded backends import torch lazily.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import subprocess
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from align import heartbeat
from align.atomic import hold_lock
from align.rollout.cut import SpoolCuts  # cut, generate_until: partial rollouts
from align.rollout.protocol import (
    Completion,
    Message,
    SamplingParams,
    check_completions,
    check_hf_dir,
    check_routes_minor,
    generate_request,
    shutdown_request,
    snapshot_marker,
    sync_request,
    worker_env,
)
from align.rollout.spool import AlreadyWaitingError, Spool, heartbeat_problem

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]
WORKER_SCRIPT = REPO_ROOT / "extras" / "vllm_rollout" / "rollout_worker.py"
FLEET_SCRIPT = REPO_ROOT / "extras" / "vllm_rollout" / "fleet.py"  # N engines on Ray behind one spool
DEFAULT_VENV = REPO_ROOT / ".venv-rollout"
SETUP_HINT = "bash scripts/setup_rollout_venv.sh"


class RolloutError(RuntimeError):
    """The worker answered a request with an error (bad request, engine failure)."""


class WorkerDiedError(RuntimeError):
    """The worker died or stopped heart-beating while a request was pending. ``request_id`` stays in the spool: a
    restarted worker serves it, and ``client.wait(request_id)`` (or ``generate(..., request_id=...)``) picks it up."""

    def __init__(self, message: str, request_id: str | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id


# ---------------------------------------------------------------------------------------------
# Native


class NativeClient:
    """The in-process sampler (``align.rollout.native``) on the live training model."""

    logprob_basis = "training"

    def __init__(self, model: object) -> None:
        self.model = model
        self.weights_version = 0

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        from align.rollout.native import generate

        completions = generate(self.model, prompts, params)
        for c in completions:
            c.weights_version = self.weights_version
        return completions

    def generate_until(self, prompts: list, params: SamplingParams, need: int, carried: list, **kw) -> list:
        """``--partial-rollouts``: generate until ``need`` groups are complete (or ``stop()``), the rest cut; a cut row
        of ``carried`` resumes by ``prefill`` (``partial.generate_until``; ``kept``: the cut rows' KV caches for keep)."""
        from align.rollout.partial import generate_until

        kept = self.__dict__.setdefault("kept", {})
        return generate_until(self.model, prompts, params, need, carried, self.weights_version, kept=kept, **kw)

    def sync_weights(self, snapshot_dir: str | os.PathLike | None, version: int) -> float:
        """No copy: the sampler shares the live model. Records ``version`` for the completions' stamp."""
        self.weights_version = int(version)
        return 0.0

    def close(self) -> None:
        pass


# ---------------------------------------------------------------------------------------------
# Spool


class SpoolClient(SpoolCuts):
    """Talks to a rollout worker through a spool directory (``align.rollout.spool``).

    Every call returns within ``timeout_s``: a worker that dies (its process is gone, or
    ``worker`` handle exited) or whose heartbeat is older than ``stale_s`` raises
    ``WorkerDiedError`` with the tail of its log; an error answer raises ``RolloutError``.
    No heartbeat at all is tolerated for the whole ``timeout_s`` (the worker may still be starting).
    """

    part = "sampler"  # what its calls count as for the watchdog (align.heartbeat); the eval fleet's: "eval fleet"

    def __init__(
        self,
        spool: str | os.PathLike,
        timeout_s: float = 600.0,
        stale_s: float = 30.0,
        poll_s: float = 0.02,
        worker: WorkerHandle | None = None,
    ) -> None:
        if timeout_s <= 0 or stale_s <= 0 or poll_s <= 0:
            raise ValueError(f"timeout_s, stale_s, poll_s must be > 0, got {timeout_s}, {stale_s}, {poll_s}")
        self.spool = Spool(spool).ensure()
        self.timeout_s, self.stale_s, self.poll_s = float(timeout_s), float(stale_s), float(poll_s)
        self.worker = worker
        self.weights_version: int | None = None
        self.last_timings: dict = {}
        self._basis: str | None = None
        self.needs_routes = False  # --routing-replay rollout: a worker below minor 4 / without routes is refused

    @property
    def logprob_basis(self) -> str:
        """What the worker's logprobs are ('raw' or 'processed'), from its heartbeat or last answer."""
        if self._basis is None:
            hb = self.spool.read_heartbeat()
            if hb is None or "logprob_basis" not in hb:
                raise RuntimeError(f"no rollout worker has announced itself in {self.spool.root} yet")
            self._basis = hb["logprob_basis"]
        return self._basis

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        request_id: str | None = None,
        first_prompt_index: int = 0,
    ) -> list[Completion]:
        """Sample ``params.n`` completions per prompt; ordered by (prompt_index, sample_index). With ``request_id``
        of an earlier request (e.g. ``WorkerDiedError.request_id``) nothing is resubmitted: the call waits for that
        request's answer. ``first_prompt_index``: see ``protocol.generate_request``. The answer is checked against
        the request (``protocol.check_completions``: one completion per prompt and sample index, token ids in the
        worker's vocabulary, one logprob per token, routes when ``needs_routes``); a bad one raises
        ``ProtocolError`` naming the response file (kept in the spool's rejected/)."""
        msg = generate_request(prompts, params, id=request_id, first_prompt_index=first_prompt_index)
        check_routes_minor(self.spool, self.needs_routes)  # before anything is sent
        self._submit_once(msg)
        checked: list[Completion] = []

        def check(resp: Message, source: str) -> None:
            if resp.kind != "completions":
                return  # wait() raises on the unexpected kind
            hb = self.spool.read_heartbeat() or {}
            vocab = hb.get("vocab_size") if isinstance(hb.get("vocab_size"), int) else None
            checked[:] = check_completions(resp.body, msg.body["prompts"], params, source, vocab, self.needs_routes)

        with heartbeat.working(self.part, request=msg.id, engine=self.spool.root):
            body = self.wait(msg.id, expect="completions", check=check)
        self._basis = body["logprob_basis"]
        self.weights_version = body["weights_version"]
        self.last_timings = body["timings"]
        return checked

    def sync_weights(self, snapshot_dir: str | os.PathLike, version: int) -> float:
        """Tell the worker to load committed snapshot ``snapshot_dir`` as ``version``; returns the sync seconds.

        A PEFT adapter dir (``adapter_config.json``) is served on the worker's base model as a new LoRA
        (worker started with ``--max-lora-rank``)."""
        path = Path(snapshot_dir)
        if not (path / "config.json").is_file() and not (path / "adapter_config.json").is_file():
            raise ValueError(f"snapshot {path} has no config.json / adapter_config.json: not an HF or PEFT directory")
        if snapshot_marker(path) is None:
            raise ValueError(f"snapshot {path} is not committed (no .complete / STABLE marker): publish it first")
        msg = sync_request(path, version)
        self.spool.submit(msg)
        with heartbeat.working(self.part, request=msg.id, engine=self.spool.root, load=version):
            body = self.wait(msg.id, expect="synced")
        self.weights_version = body["version"]
        self.last_timings = {"sync_s": body["seconds"], "sync_method": body["method"]}
        return float(body["seconds"])

    def shutdown_worker(self, timeout_s: float = 60.0) -> None:
        """Ask the worker to exit after the requests queued before this one."""
        msg = shutdown_request()
        self.spool.submit(msg)
        self.wait(msg.id, expect="stopped", timeout_s=timeout_s)

    def close(self) -> None:
        """Detach (the worker keeps running; use its handle's ``shutdown()`` to stop it)."""

    def _submit_once(self, msg: Message) -> None:
        state = self.spool.request_state(msg.id)
        if state is None:
            self.spool.submit(msg)
        elif state == "done":
            raise RolloutError(f"request {msg.id} was already answered and its response consumed")

    def wait(
        self,
        request_id: str,
        expect: str | None = None,
        timeout_s: float | None = None,
        check: Callable[[Message, str], None] | None = None,
    ) -> dict:
        """Block until the answer to ``request_id`` arrives; return its body. Never longer than the timeout.

        One waiter per request id: a second client (or thread) waiting on the same id raises RolloutError at once.
        ``check(msg, source)`` may refuse the answer with ProtocolError (see ``Spool.take_response``)."""
        try:
            with self.spool.waiting(request_id):
                if self.spool.request_state(request_id) == "done":
                    raise RolloutError(f"request {request_id} was already answered and its response consumed")
                return self._wait(request_id, expect, self.timeout_s if timeout_s is None else timeout_s, check)
        except AlreadyWaitingError as e:
            raise RolloutError(str(e)) from None

    def _wait(self, request_id: str, expect: str | None, timeout_s: float, check: Callable | None) -> dict:
        start = last_check = time.monotonic()
        while True:
            msg = self.spool.take_response(request_id, check)
            if msg is not None:
                if msg.kind == "error":
                    b = msg.body
                    raise RolloutError(f"rollout worker rejected request {request_id}: {b['error']}: {b['message']}")
                if expect is not None and msg.kind != expect:
                    raise RolloutError(f"request {request_id}: expected a {expect!r} answer, got {msg.kind!r}")
                return msg.body
            now = time.monotonic()
            if now - last_check >= 0.25:
                last_check = now
                self._check_alive(request_id)
            if now - start > timeout_s:
                raise WorkerDiedError(
                    f"no answer to request {request_id} within timeout_s={timeout_s:.0f} "
                    f"(state: {self.spool.request_state(request_id)}); {self._describe_worker()}",
                    request_id,
                )
            time.sleep(self.poll_s)

    def _check_alive(self, request_id: str) -> None:
        # a bad heartbeat first, then up to 1 s for the handle's exit code, which names a kill ("is gone" does not)
        problem = heartbeat_problem(self.spool.read_heartbeat(), self.stale_s)
        if self.worker is not None and not self.worker.alive(wait_s=1.0 if problem else 0.0):
            problem = f"worker process {self.worker.pid} exited with code {self.worker.returncode}"
        if problem is not None and self.spool.request_state(request_id) != "answered":
            raise WorkerDiedError(
                f"rollout worker failed while request {request_id} was pending: {problem}. The request stays in "
                f"{self.spool.root}; restart the worker and call client.wait({request_id!r}) to resume.\n"
                + self._describe_worker(),
                request_id,
            )

    def _describe_worker(self) -> str:
        if self.worker is not None:
            return f"worker log {self.worker.log_path} (last lines):\n{self.worker.log_tail(30)}"
        hb = self.spool.read_heartbeat()
        if hb and hb.get("log_path"):
            return f"worker log {hb['log_path']} (last lines):\n{_tail(Path(hb['log_path']), 30)}"
        return "no worker log known (the worker has written no heartbeat)"


def lock_trainer(spool: str | os.PathLike) -> IO[str]:
    """Take the trainer's exclusive lock of ``spool`` (``trainer.lock``; held until the file is closed or this process
    dies), creating the spool (0700) first: a second trainer on one spool would interleave requests and weight syncs
    with this one. Held by another: RuntimeError naming its pid. torchrun: rank 0 only (all ranks are one trainer)."""
    path = Spool(spool).ensure().root / "trainer.lock"
    return hold_lock(
        path,
        lambda holder: (
            f"spool {spool} is in use by another trainer ({holder}, lock {path}): two trainers would "
            "interleave their requests and weight syncs. Stop it, or give this run its own --spool"
        ),
    )


_CLIENTS = {"native": NativeClient, "spool": SpoolClient}


def make_rollout_client(kind: str, **kwargs: object) -> NativeClient | SpoolClient:
    """``"native"`` (``model=``) or ``"spool"`` (``spool=``, ``timeout_s=``, ...): same interface."""
    if kind not in _CLIENTS:
        raise ValueError(f"unknown rollout backend {kind!r}; expected one of {sorted(_CLIENTS)}")
    return _CLIENTS[kind](**kwargs)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# Spawning the vLLM worker


def _tail(path: Path, n: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            lines = deque(f.read().decode("utf-8", "replace").splitlines(), maxlen=n)
    except OSError as e:
        return f"<cannot read {path}: {e}>"
    return "\n".join(lines)


class WorkerHandle:
    """A spawned rollout worker: its own process group, so ``shutdown()`` reaps the engine core too."""

    def __init__(self, proc: subprocess.Popen, spool: Spool, log_path: Path, parent_fd: int | None = None) -> None:
        self.proc, self.spool, self.log_path = proc, spool, log_path
        self.pid = proc.pid
        self._parent_fd = parent_fd  # write end of the worker's parent pipe: closing it (or dying) stops the worker

    @property
    def returncode(self) -> int | None:
        return self.proc.poll()

    def alive(self, wait_s: float = 0.0) -> bool:
        with contextlib.suppress(subprocess.TimeoutExpired):  # after waiting up to wait_s for it to exit
            self.proc.wait(timeout=wait_s)
        return self.proc.poll() is None

    def log_tail(self, n: int = 40) -> str:
        return _tail(self.log_path, n)

    def wait_ready(self, timeout_s: float) -> dict:
        """Wait for the worker's 'ready' heartbeat; on death or timeout, kill the group and raise with the log tail."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            hb = self.spool.read_heartbeat()
            if hb is not None and hb.get("pid") == self.pid and hb.get("state") == "ready":
                return hb
            if not self.alive() or (hb is not None and hb.get("pid") == self.pid and hb.get("state") == "failed"):
                self.shutdown(grace_s=0)
                why = (hb or {}).get("error") or f"exit code {self.returncode}"
                raise RuntimeError(f"rollout worker failed to start ({why}); log {self.log_path}:\n{self.log_tail(40)}")
            time.sleep(0.1)
        self.shutdown(grace_s=0)
        raise RuntimeError(
            f"rollout worker not ready within {timeout_s:.0f} s; log {self.log_path}:\n{self.log_tail(40)}"
        )

    def group_alive(self) -> bool:
        """True while any process of the worker's process group exists."""
        try:
            os.killpg(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def shutdown(self, grace_s: float = 30.0) -> None:
        """Stop the worker: a shutdown message (served after queued requests), then SIGTERM, then SIGKILL
        of the whole process group. Returns when no process of the group is left."""
        stop = None
        if self.alive() and grace_s > 0:
            stop = shutdown_request()
            with contextlib.suppress(OSError, ValueError):
                self.spool.submit(stop)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=grace_s)
        for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
            if not self.group_alive():
                break
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, sig)
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline:
                self.proc.poll()  # reap the leader so it does not linger as a zombie
                if not self.group_alive():
                    break
                time.sleep(0.05)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        if stop is not None:  # a worker that died before serving it: the next worker on this spool must not stop
            for folder in ("requests", "claimed"):
                with contextlib.suppress(OSError):
                    self.spool._path(folder, stop.id).unlink()
        if self._parent_fd is not None and not self.alive():
            os.close(self._parent_fd)
            self._parent_fd = None
        if self.group_alive():
            raise RuntimeError(f"rollout worker process group {self.pid} survived SIGKILL")


@dataclasses.dataclass
class WorkerSpec:
    """How ``spawn_worker`` starts a worker (every field but the spool; see its docstring)."""

    gpu: int | None = None
    log_path: str | os.PathLike | None = None
    model: str | os.PathLike | None = None
    weights_version: int = 0
    max_model_len: int = 2048
    dtype: str = "auto"
    logprobs_mode: str = "raw"
    in_process: bool = False
    cache_dir: str | os.PathLike | None = None
    venv: str | os.PathLike | None = None
    extra_args: list[str] | tuple[str, ...] = ()
    env: dict[str, str] | None = None
    wait_ready: bool = True
    ready_timeout_s: float = 900.0
    exit_with_parent: bool = True
    engines: int = 1
    gpus_per_engine: int = 1
    engine_restarts: int = 1
    ray_address: str | None = None
    use_fleet: bool | None = None
    eval_engines: int = 0
    eval_gpus_per_engine: int = 1
    eval_spool: str | os.PathLike | None = None
    eval_model: str | os.PathLike | None = None
    eval_weights_version: int | None = None

    def keywords(self) -> dict[str, Any]:
        """The fields as ``spawn_worker`` keywords (shallow: paths and lists as they are)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


def spawn_worker(spool: str | os.PathLike, spec: WorkerSpec | None = None, **fields: Any) -> WorkerHandle:
    """Launch ``rollout_worker.py`` under ``.venv-rollout`` on ``spec.model`` serving ``spool``; ``fields`` override
    the spec's (``spawn_worker(spool, gpu=3, log_path=..., model=...)``).

    Checks the venv, spool and model directory before starting anything. ``in_process`` runs vLLM's
    engine core in the worker process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``; faster to start on CPU).
    With ``wait_ready`` it returns once the engine is up, or raises with the log tail and no process left.
    With ``exit_with_parent`` (default) the worker exits within seconds when this process does, even by kill -9
    (it watches a pipe this process holds open and its parent pid), so a rerun is not locked out of the spool;
    pass False for a worker that must outlive its launcher (then stop it with ``shutdown_worker``).

    ``engines > 1`` (or a ``ray_address``) starts ``extras/vllm_rollout/fleet.py`` instead: that many vLLM engines
    (``gpus_per_engine`` each, tensor parallel) as Ray actors behind the same spool, a dead engine restarted at most
    ``engine_restarts`` times in total; ``gpu`` then does not apply (Ray places the engines). ``use_fleet=True``
    forces the Ray fleet for one engine too (e.g. to place it on a remote node). ``eval_engines`` more engines
    (``eval_gpus_per_engine`` each, in bundles appended after every other region) serve ``eval_spool`` behind
    their own router; they never see training weight syncs (pin them per eval point with ``sync_weights``). They
    start (after the rollout engines) on ``eval_model`` (default: ``model``), which must therefore outlive the
    start, reporting ``eval_weights_version`` (default: ``weights_version``) until their first load.
    """
    s = dataclasses.replace(spec or WorkerSpec(), **fields)
    if s.engines < 1 or s.gpus_per_engine < 1 or s.engine_restarts < 0:
        raise ValueError(
            f"engines >= 1, gpus_per_engine >= 1, engine_restarts >= 0 needed; got {s.engines}, {s.gpus_per_engine}, "
            f"{s.engine_restarts}"
        )
    venv = Path(s.venv) if s.venv is not None else Path(os.environ.get("ALIGN_ROLLOUT_VENV", DEFAULT_VENV))
    python = venv / "bin" / "python"
    if not python.exists():
        raise RuntimeError(f"rollout venv missing: {python} does not exist. Build it with `{SETUP_HINT}`")
    if s.model is None:
        raise ValueError("spawn_worker needs model=<HF checkpoint directory>")
    model = check_hf_dir(s.model)
    sp = Spool(spool).ensure()
    log_path = Path(s.log_path) if s.log_path is not None else sp.root / "worker.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    cache_dir = s.cache_dir or os.environ.get("ALIGN_ROLLOUT_CACHE") or REPO_ROOT / ".cache" / "rollout"
    if s.eval_engines and s.eval_spool is None:
        raise ValueError(f"eval_engines={s.eval_engines} needs eval_spool=<directory> for the eval router")
    fleet = s.use_fleet if s.use_fleet is not None else s.engines > 1 or s.ray_address is not None or s.eval_engines > 0
    cmd = [str(python), str(FLEET_SCRIPT if fleet else WORKER_SCRIPT), "--spool", str(sp.root.resolve())]
    cmd += ["--model", str(model.resolve())]
    if fleet:
        cmd += ["--rollout-engines", str(s.engines), "--rollout-gpus-per-engine", str(s.gpus_per_engine)]
        cmd += ["--rollout-engine-restarts", str(s.engine_restarts), "--engine-start-timeout-s", str(s.ready_timeout_s)]
        cmd += ["--ray-address", s.ray_address] if s.ray_address else []
        if s.eval_engines:
            cmd += ["--eval-num-gpus", str(s.eval_engines * s.eval_gpus_per_engine)]
            cmd += ["--eval-num-gpus-per-engine", str(s.eval_gpus_per_engine)]
            cmd += ["--eval-spool", str(Spool(s.eval_spool).ensure().root.resolve())]
            cmd += ["--eval-model", str(check_hf_dir(s.eval_model).resolve())] if s.eval_model is not None else []
            ver = s.eval_weights_version
            cmd += ["--eval-weights-version", str(ver)] if ver is not None else []
    cmd += ["--weights-version", str(s.weights_version), "--max-model-len", str(s.max_model_len), "--dtype", s.dtype]
    cmd += ["--logprobs-mode", s.logprobs_mode, "--log-path", str(log_path.resolve()), *s.extra_args]
    wenv = worker_env(s.env, gpu=None if fleet else s.gpu, cache_dir=cache_dir, in_process=s.in_process)
    read_fd, write_fd = os.pipe() if s.exit_with_parent else (None, None)
    if read_fd is not None:
        cmd += ["--parent-pid", str(os.getpid()), "--parent-fd", str(read_fd)]
    try:
        with open(log_path, "ab") as logf:
            logf.write(f"\n[spawn_worker] {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(cmd)}\n".encode())
            logf.flush()
            proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=logf,
                stderr=subprocess.STDOUT,
                env=wenv,
                cwd=str(REPO_ROOT),
                start_new_session=True,
                pass_fds=() if read_fd is None else (read_fd,),
            )
    except BaseException:
        if write_fd is not None:
            os.close(write_fd)
        raise
    finally:
        if read_fd is not None:
            os.close(read_fd)
    handle = WorkerHandle(proc, sp, log_path, parent_fd=write_fd)
    log.info("spawned rollout worker pid %d on %s (log %s)", proc.pid, model, log_path)
    if s.wait_ready:
        handle.wait_ready(s.ready_timeout_s)
    return handle


# ------------------------------------------------------------------------------------------------ torchrun


class ShardedNativeClient:
    """The native sampler under torchrun: each rank generates its share of the prompts with full weights
    (``full_model``), and every rank gets all the completions, in prompt order (see the module docstring)."""

    logprob_basis = "training"

    def __init__(self, model: Any) -> None:
        self.model = model
        self.weights_version = 0

    def generate(self, prompts: list[list[int]], params: Any) -> list:
        from align import dist
        from align.rollout.native import generate

        lo, hi = dist.share(len(prompts))
        full = dist.full_model(self.model)
        mine = generate(full, prompts[lo:hi], params, rows=(lo * params.n, len(prompts) * params.n)) if hi > lo else []
        del full
        out = []
        for start, part in zip((dist.share_of(len(prompts), r)[0] for r in range(dist.world())), dist.gather(mine)):
            for c in part:
                c.prompt_index += start
                c.weights_version = self.weights_version
                out.append(c)
        return out

    def sync_weights(self, snapshot_dir: Any, version: int) -> float:
        self.weights_version = int(version)
        return 0.0

    def close(self) -> None:
        pass


class ShardedSpoolClient:
    """``--rollout spool`` under torchrun: every rank submits its share of the prompts to the shared spool (its own
    request, seeded by global prompt index: ``first_prompt_index``), so the completions are the ones one process
    gets; every rank gets all of them, in prompt order. Rank 0 alone syncs weights; the others wait at a barrier
    until the worker has loaded the snapshot."""

    def __init__(self, client: Any) -> None:
        from align import dist

        self.client, self.spool = client, client.spool
        self.weights_version = client.weights_version
        dist.barrier()  # rank 0 has started (or attached to) the worker

    @property
    def logprob_basis(self) -> str:
        return self.client.logprob_basis

    def generate(self, prompts: list[list[int]], params: Any) -> list:
        from align import dist

        lo, hi = dist.share(len(prompts))
        mine = self.client.generate(prompts[lo:hi], params, first_prompt_index=lo) if hi > lo else []
        out = []
        for start, part in zip((dist.share_of(len(prompts), r)[0] for r in range(dist.world())), dist.gather(mine)):
            for c in part:
                c.prompt_index += start
                out.append(c)
        return out

    def sync_weights(self, snapshot_dir: Any, version: int) -> float:
        from align import dist

        seconds = self.client.sync_weights(snapshot_dir, version) if dist.is_main() else 0.0
        dist.barrier()  # no rank submits a request before the worker serves the new weights
        self.weights_version = self.client.weights_version = int(version)
        return seconds

    def close(self) -> None:
        self.client.close()
