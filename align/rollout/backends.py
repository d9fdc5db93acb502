"""Rollout backends as a table: ``BACKENDS[name]`` (``--rollout NAME``) is everything a run needs of where its
rollouts are generated, so the run wing and the pipeline name no backend.

An entry owns:

- ``TRAIN_DEFAULTS``: the ``TrainConfig`` fields whose default depends on the backend (dotted: ``{"loss.use_rho_correction":
  True}``), applied like a built-in task's below ``--config`` and flags (``align.run.sources``: layer ``backend``);
- its config section: the fields of ``RolloutConfig`` (flat in ``TrainConfig``, so the flags and every saved
  ``config.json`` keep their names) and its own rules, ``check(cfg)``, run when the config is built;
- ``uses_ray(cfg)``: whether its engines are Ray actors (the eval engines then join them);
- ``open(cfg, target) -> Opened``: spawn or attach, and the first weight sync, for the run described by ``target``.

An opened backend (``Opened``) holds the run's rollout ``client`` and gives the rollout pipeline its engine:
``engine(cfg, step, snapshots)`` is, for ``--max-async-steps`` K = 0, what publishes the weights after a step (None:
the sampler reads the live policy) and, for K >= 1, the producer's engine (``align.rollout.engines``: it publishes
and swaps versions); ``logprob_warning(params)`` and ``close()`` (client, worker, spool lock).

Adding a backend is a file with its entry class and a row here; a test may register a toy one for its run
(``tests/test_backends.py``).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from align.options import flag  # the one definition of a flag's help

log = logging.getLogger(__name__)


@dataclass
class RolloutConfig:
    """The rollout section of ``TrainConfig`` (its fields are flat there: ``--rollout``, ``--spool``, ...)."""

    rollout: str = flag("native", "Rollout backend: 'native' (in-process) or 'spool' (vLLM worker).")
    spool: str | None = flag(None, "Spool dir for --rollout spool (default {out}/spool).")
    spawn_worker: bool = flag(True, "With --rollout spool, start the vLLM worker (else attach to a running one).")
    rollout_gpu: int | None = flag(None, "GPU for the spawned vLLM worker (None = CPU build).")
    rollout_gpu_memory_utilization: float | None = flag(
        None,
        "Fraction of the GPU's memory the spawned vLLM worker may take (vLLM's gpu_memory_utilization; None = "
        "vLLM's 0.9). On the trainer's own GPU (--colocate) leave the rest to the trainer: e.g. 0.3.",
    )
    colocate: bool = flag(
        False,
        "The spawned vLLM worker shares the trainer's GPU (--rollout-gpu N, the same GPU): it sleeps (vLLM sleep "
        "mode: weights offloaded to CPU, KV cache dropped) while the trainer updates and wakes before the next "
        "weight sync. GPU only; synchronous (--max-async-steps 0), one worker.",
    )
    rollout_sleep_level: int = flag(
        1,
        "vLLM sleep level with --colocate: 1 offloads the weights to CPU memory, 2 drops them (each wake is "
        "followed by a weight sync, so needs --sync-every 1 and no LoRA).",
    )
    rollout_logprobs_mode: str = flag(
        "raw",
        "vLLM worker logprobs: 'raw' (before temperature; exact at T=1) or 'processed' (after temperature/top-p/top-k).",
    )
    rollout_in_process: bool = flag(
        False,
        "Run the spawned vLLM engine in the worker's own process (faster start on CPU; the default is vLLM's multiprocess engine).",
    )
    rollout_timeout_s: float = flag(600.0, "Max seconds to wait for a rollout answer.")
    rollout_num_engines: int = flag(
        1, "vLLM engines behind the spool; > 1 runs them as Ray actors (extras/vllm_rollout/fleet.py)."
    )
    rollout_engine_restarts: int = flag(1, "With --rollout-num-engines > 1: restarts of dead engines, fleet total.")
    rollout_ray: bool = flag(
        False,
        "Serve the spool with the Ray fleet even for one engine (implied by --rollout-num-engines > 1 or "
        "--ray-address). With it, --eval-num-gpus engines are Ray actors in the same placement group's appended "
        "bundles behind their own router, instead of separate spool workers.",
    )
    ray_address: str | None = flag(
        None, "Ray cluster for the rollout fleet (multi-node; the run directory must be on a shared filesystem)."
    )
    sync_every: int = flag(1, "Publish weights to the spool worker every N optimizer steps.")
    max_async_steps: int = flag(
        0,
        "Asynchronous rollouts: generate up to K steps ahead of the trainer; step t trains on rollouts of the weights after step max(0, t-1-K). 0 = synchronous.",
    )
    max_inflight_requests: int | None = flag(
        None,
        "Max completions outstanding at the rollout engine per request (whole groups; a group is never split). None = one request per batch.",
    )
    partial_rollouts: bool = flag(
        False,
        "Partial rollouts (needs --max-async-steps >= 1): a step's generate call holds the carried groups plus "
        "fresh prompts (--partial-pool-factor x the groups it needs), stops at a token boundary once enough "
        "groups are complete, and carries the rows still running (cut) into the next call, on newer weights. "
        "See docs/rollout.md#partial-rollouts.",
    )
    partial_prefill: str = flag(
        "recompute",
        "How a cut row resumes: 'recompute' (re-prefill prompt + its ids so far under the new weights: exact) or "
        "'keep' (native sampler only: continue on the KV cache computed under the old weights, no re-prefill; the "
        "approximation peers make). docs/rollout.md#partial-rollouts.",
    )
    partial_cut: str = flag(
        "groups",
        "With --partial-rollouts, when a call's rows still running are cut: 'groups' (once the step's groups are "
        "complete: deterministic, a resumed run matches) or 'publish' (the rows go on decoding on the weights held "
        "until the trainer publishes the version the next step needs: the generator never waits while rows are "
        "carried; when the cut comes depends on timing). docs/rollout.md#partial-rollouts.",
    )
    max_token_staleness: int | None = flag(
        None,
        "With --partial-rollouts: a completion holding a token sampled more than S versions before the step it "
        "trains in is dropped (or masked, --stale-policy). >= --max-async-steps; None = no limit (a token's lag "
        "is K plus the calls its group was carried).",
    )
    partial_pool_factor: int = flag(
        2,
        "With --partial-rollouts: a step's generate call holds this many times the groups the step needs "
        "(carried first, then fresh prompts) and stops once enough are complete. Larger: shorter calls, more rows "
        "and staler tokens (docs/performance.md#partial-rollouts).",
    )
    stale_policy: str = flag(
        "drop",
        "A stale completion (--max-token-staleness): 'drop' (its group is dropped before the call and a fresh "
        "prompt takes its place) or 'mask' (it trains unscorable: no advantage, no loss).",
    )

    def check_rollout(self) -> None:
        """This section's values, the backend a row of ``BACKENDS`` and its own rules (``TrainConfig.__post_init__``
        calls this; the async settings against the group size are ``align.rollout.pipeline.check_config``'s)."""
        for k in ("sync_every", "rollout_num_engines"):
            if getattr(self, k) < 1:
                raise ValueError(f"--{k.replace('_', '-')} must be >= 1, got {getattr(self, k)}")
        if self.rollout not in BACKENDS:
            raise ValueError(f"--rollout must be one of {tuple(BACKENDS)}, got {self.rollout!r}")
        if self.rollout_logprobs_mode not in ("raw", "processed"):
            raise ValueError(
                f"--rollout-logprobs-mode must be one of ('raw', 'processed'), got {self.rollout_logprobs_mode!r}"
            )
        if not (math.isfinite(self.rollout_timeout_s) and self.rollout_timeout_s > 0):
            raise ValueError(f"--rollout-timeout-s {self.rollout_timeout_s!r} is invalid: must be a finite number > 0")
        if self.rollout_gpu is not None and self.rollout_gpu < 0:
            raise ValueError(
                f"--rollout-gpu {self.rollout_gpu!r} is invalid: must be a GPU index >= 0 (or unset for the CPU build)"
            )
        frac = self.rollout_gpu_memory_utilization
        if frac is not None and not (math.isfinite(frac) and 0 < frac <= 1):
            raise ValueError(f"--rollout-gpu-memory-utilization {frac!r} is invalid: must be in (0, 1]")
        if self.rollout_sleep_level not in (1, 2):
            raise ValueError(f"--rollout-sleep-level must be 1 or 2, got {self.rollout_sleep_level!r}")
        BACKENDS[self.rollout].check(self)
        from align.rollout.partial import check_config as check_partial

        row = BACKENDS[self.rollout]
        check_partial(self, getattr(row, "cuts", False), getattr(row, "prefills", ("recompute",)))  # its flags

    @property
    def uses_ray(self) -> bool:
        """The backend's engines are the Ray fleet (``fleet.py``): the eval engines join its placement group."""
        return BACKENDS[self.rollout].uses_ray(self)


@dataclass
class Target:
    """What a backend opens for: the run's policy and files, and the eval engines it may host."""

    policy: Any
    out: Path
    step: int  # the weights version the run starts from (a resumed run: its checkpoint's step)
    model_path: str  # the base model (LoRA: the worker serves it with the adapter)
    max_model_len: int
    dtype: str  # the trainer's compute dtype name (the worker computes alike)
    lora: bool
    eval_spool: Path | None = None  # the eval engines' router spool, when the backend's fleet hosts them
    eval_engines: int = 0
    eval_gpus_per_engine: int = 1


class Opened:
    """An opened backend: its ``client`` (the rollout engine's door), and ``worker`` / ``lock`` when it started one."""

    def __init__(self, client: Any, policy: Any, worker: Any = None, lock: Any = None) -> None:
        self.client, self.policy, self.worker, self.lock = client, policy, worker, lock

    def engine(self, cfg: Any, step: int, snapshots: Path) -> Any:
        """K = 0: None (the sampler reads the live policy); K >= 1: the producer's own copy of the weights."""
        from align.rollout.engines import NativeEngine

        return NativeEngine(self.policy, step) if cfg.max_async_steps else None

    def logprob_warning(self, params: Any) -> str | None:
        return None

    def close(self) -> None:
        """The client, then the worker, then the spool lock (each once)."""
        client, worker, lock, self.client, self.worker, self.lock = (
            self.client,
            self.worker,
            self.lock,
            None,
            None,
            None,
        )
        try:
            if client is not None:
                client.close()
        finally:
            if worker is not None:
                worker.shutdown()
            if lock is not None:
                lock.close()  # the worker is gone: another trainer may take the spool


class NativeBackend:
    """The native sampler in this process, on the policy itself (torchrun: each rank samples its share)."""

    cuts = True  # --partial-rollouts: NativeClient.generate_until (align.rollout.partial)
    prefills = ("recompute", "keep")  # --partial-prefill: keep continues a cut row on the KV cache it had
    carries_episodes = True  # --partial-rollouts on an environment task: episodes carried, cut inside a turn too
    TRAIN_DEFAULTS: ClassVar[dict[str, Any]] = {}  # its logprobs are the trainer's own: no off-policy correction

    def check(self, cfg: RolloutConfig) -> None:
        for name, value in (
            ("--colocate", cfg.colocate),
            ("--rollout-gpu-memory-utilization", cfg.rollout_gpu_memory_utilization),
        ):
            if value:
                raise ValueError(
                    f"{name} is for the vLLM worker (--rollout spool); the native sampler runs on the policy itself"
                )

    def uses_ray(self, cfg: RolloutConfig) -> bool:
        return False

    def open(self, cfg: Any, target: Target) -> Opened:
        from align import dist
        from align.rollout import client as client_mod

        if dist.active():
            return Opened(client_mod.ShardedNativeClient(target.policy), target.policy)
        return Opened(client_mod.make_rollout_client("native", model=target.policy), target.policy)


class SpoolOpened(Opened):
    """A vLLM worker behind the spool: weights published as snapshots ``{snapshots}/v{N}`` the worker loads."""

    def engine(self, cfg: Any, step: int, snapshots: Path) -> Any:
        from align.rollout.engines import SpoolEngine, SyncSpool, save_snapshot

        if cfg.max_async_steps == 0:
            sleep_level = cfg.rollout_sleep_level if cfg.colocate else 0
            return SyncSpool(self.client, snapshots, step, cfg.sync_every, sleep_level)
        return SpoolEngine(self.client, snapshots, step, save_snapshot, cfg.rollout_timeout_s)

    def logprob_warning(self, params: Any) -> str | None:
        from align.rollout.protocol import logprob_basis_warning

        return logprob_basis_warning(self.client.logprob_basis, params)


class SpoolBackend:
    """A vLLM worker (or Ray fleet) in ``.venv-rollout`` behind a spool directory, spawned or attached to."""

    cuts = True  # --partial-rollouts: SpoolClient.generate_until (align.rollout.cut: the worker's cut request)
    prefills = ("recompute",)  # a cut request is resubmitted as prompt + ids so far: no cache survives a sync
    carries_episodes = False  # episodes run one thread each (align.envs.partial carries the native turn waves)
    # vLLM's logprobs (mu) are not the trainer's recompute (pi_old): another engine, kernels, and weights a version
    # behind with --max-async-steps; rho = pi_old / mu corrects for it (TRL turns its IS correction on with vLLM too)
    TRAIN_DEFAULTS: ClassVar[dict[str, Any]] = {"loss.use_rho_correction": True}

    def check(self, cfg: RolloutConfig) -> None:
        """``--colocate``: a spawned GPU worker, one engine, synchronous; refused here, before anything loads.
        ``--partial-rollouts`` works on one worker and on the Ray fleet (each engine cuts its own requests)."""
        if cfg.rollout_gpu_memory_utilization is not None and cfg.rollout_gpu is None and not self.uses_ray(cfg):
            raise ValueError(  # a Ray fleet places its engines on GPUs itself and passes the fraction to each
                "--rollout-gpu-memory-utilization applies to a GPU worker: pass --rollout-gpu N"
            )
        if not cfg.colocate:
            return
        if cfg.rollout_gpu is None:
            raise ValueError(
                "--colocate needs vLLM's sleep mode, which the CPU build of vLLM does not have: pass --rollout-gpu N "
                "(the trainer's GPU) with a CUDA build of vLLM in .venv-rollout, or drop --colocate"
            )
        problems = [
            ("--no-spawn-worker (colocate spawns its worker)", not cfg.spawn_worker),
            ("--max-async-steps > 0 (generation overlaps the update)", cfg.max_async_steps > 0),
            ("a Ray fleet (--rollout-num-engines > 1, --rollout-ray, --ray-address)", self.uses_ray(cfg)),
        ]
        for what, bad in problems:
            if bad:
                raise ValueError(f"--colocate runs one spawned worker beside a synchronous trainer; drop {what}")
        if cfg.rollout_sleep_level == 2 and cfg.sync_every != 1:
            raise ValueError(
                f"--rollout-sleep-level 2 drops the worker's weights, reloaded by the sync after each step: needs "
                f"--sync-every 1 (got {cfg.sync_every}); or use level 1"
            )

    def uses_ray(self, cfg: RolloutConfig) -> bool:
        return cfg.spawn_worker and (cfg.rollout_num_engines > 1 or cfg.rollout_ray or cfg.ray_address is not None)

    def open(self, cfg: Any, target: Target) -> Opened:
        """Lock the spool, write the initial snapshot ``rollout_snapshots/v{step}``, spawn the worker on it (rank 0)
        or attach; an attached worker (or a LoRA one: the adapter) is synced to it."""
        from align import dist, lora
        from align.rollout import client as client_mod
        from align.rollout.engines import save_snapshot

        spool = Path(cfg.spool or target.out / "spool")
        dist.check_shared_dir(spool)  # torchrun: every rank writes requests there
        opened = SpoolOpened(None, target.policy)
        try:
            if dist.is_main():  # before the snapshot and the worker: a second trainer on this spool is refused at once
                opened.lock = client_mod.lock_trainer(spool)
            init_snapshot = target.out / "rollout_snapshots" / f"v{target.step}"
            save_snapshot(target.policy, init_snapshot)
            if cfg.spawn_worker and dist.is_main():
                spec = client_mod.WorkerSpec(
                    gpu=cfg.rollout_gpu,
                    log_path=target.out / "rollout_worker.log",
                    model=target.model_path if target.lora else init_snapshot,
                    weights_version=target.step,
                    max_model_len=target.max_model_len,
                    logprobs_mode=cfg.rollout_logprobs_mode,
                    in_process=cfg.rollout_in_process,
                    dtype=target.dtype,
                    extra_args=[*lora.worker_args(target.policy), *worker_gpu_args(cfg)],
                    engines=cfg.rollout_num_engines,
                    engine_restarts=cfg.rollout_engine_restarts,
                    use_fleet=self.uses_ray(cfg),
                    ray_address=cfg.ray_address,
                    eval_engines=target.eval_engines,
                    eval_gpus_per_engine=target.eval_gpus_per_engine,
                    eval_spool=target.eval_spool,
                    eval_model=target.model_path,  # the step-0 weights, version 0: never deleted by the run
                    eval_weights_version=0,
                )
                opened.worker = client_mod.spawn_worker(spool, **spec.keywords())  # the module's: tests record it
            client = client_mod.make_rollout_client(
                "spool", spool=spool, timeout_s=cfg.rollout_timeout_s, worker=opened.worker
            )
            client.needs_routes = replays_routes(
                cfg
            )  # a worker below minor 4 or without routes: refused before sending
            opened.client = client_mod.ShardedSpoolClient(client) if dist.active() else client
            if not cfg.spawn_worker or target.lora:  # an attached worker holds whatever it loaded last; LoRA: adapter
                opened.client.sync_weights(init_snapshot, target.step)
        except BaseException:
            opened.close()
            raise
        return opened


def worker_gpu_args(cfg: Any) -> list[str]:
    """The spawned worker's GPU-only flags: ``--gpu-memory-utilization F``, ``--enable-sleep-mode`` (--colocate),
    ``--return-routes`` (``--routing-replay rollout``: vLLM's enable_return_routed_experts, protocol minor 4)."""
    frac = cfg.rollout_gpu_memory_utilization
    return [
        *(["--gpu-memory-utilization", str(frac)] if frac is not None else []),
        *(["--enable-sleep-mode"] if cfg.colocate else []),
        *(["--return-routes"] if replays_routes(cfg) else []),
    ]


def replays_routes(cfg: Any) -> bool:
    """``--routing-replay rollout``: the learner needs each completion's MoE routes from the sampler."""
    return getattr(getattr(cfg, "moe", None), "routing_replay", "off") == "rollout"


BACKENDS: dict[str, Any] = {
    "native": NativeBackend(),
    "spool": SpoolBackend(),
}
