"""Rollout engines and request splitting: what the rollout pipeline (``align.rollout.pipeline``) samples with.

- ``split_requests``: the one chunker. A request carries whole groups (the n samples of a prompt), at most
  ``--max-inflight-requests // n`` prompts, so a group never spans two requests, engines or versions; request ``i``
  is seeded ``seed + i * CHUNK_SEED_STRIDE``.
- ``Permits`` / ``PermitClient``: the shared in-flight pool (train and eval requests together with K >= 1).
- ``NativeEngine``: the native sampler on the generation thread's own copy of the weights (K >= 1).
- ``SpoolEngine``: a vLLM worker (or fleet) behind the spool, loading committed ``v{N}`` snapshots through a
  ``WeightWatcher`` (K >= 1).
- ``SyncSpool``: K = 0 with a spool worker: every ``--sync-every`` steps a snapshot, ``sync_weights``, and the
  snapshots before it removed.
- ``save_snapshot``: the policy as a committed HF snapshot (torchrun: gathered to rank 0, which writes it).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from align.rollout.client import NativeClient
from align.rollout.protocol import SamplingParams
from align.rollout.watcher import WeightWatcher, remove_snapshots_before

log = logging.getLogger(__name__)

CHUNK_SEED_STRIDE = 7_919  # seed offset of request i when --max-inflight-requests splits a batch
WAIT_POLL_S = 0.1  # how often a blocked wait re-checks the other side's health


def split_requests(prompts: list[list[int]], params: SamplingParams, permits: int | None) -> list[tuple]:
    """``prompts`` as requests of whole groups, at most ``permits`` completions each (None: one request):
    ``(first, prompts, params)``, request ``i`` seeded ``params.seed + i * CHUNK_SEED_STRIDE``. The one chunker: train batches, eval cohorts and spool submissions all split here, so a
    prompt gets the same seed whichever path sends it."""
    per = len(prompts) if permits is None else max(1, permits // params.n)
    out = []
    for i, first in enumerate(range(0, len(prompts), per)):
        p = dataclasses.replace(params, seed=None if params.seed is None else params.seed + i * CHUNK_SEED_STRIDE)
        out.append((first, prompts[first : first + per], p))
    return out


def generate_groups(client: Any, prompts: list[list[int]], params: SamplingParams, permits: int | None) -> list:
    """``client.generate`` request by request (``split_requests``); completions come back in (prompt, sample) order
    with ``prompt_index`` indexing ``prompts``."""
    requests = split_requests(prompts, params, permits)
    if len(requests) == 1:
        return client.generate(prompts, params)
    out = []
    for first, chunk, p in requests:
        out += [dataclasses.replace(c, prompt_index=c.prompt_index + first) for c in client.generate(chunk, p)]
    return out


def check_weights_version(completions: list, expected: int, spool: object) -> None:
    """Every completion must come from weights version ``expected`` (the last one this run published)."""
    stale = sorted({c.weights_version for c in completions} - {expected})
    if stale:
        raise RuntimeError(
            f"the rollout worker on {spool} answered with weights version(s) {stale}, this run published version "
            f"{expected}: its rollouts come from other weights (a second trainer on the same spool, or a worker "
            "that missed a sync). Give each run its own worker / --spool"
        )


class Permits:
    """The shared in-flight pool (``--max-inflight-requests``, counted in completions; ``None`` = unbounded).

    ``take(n, eval_=True)`` has priority: train takers wait while an eval taker is waiting. ``max_used`` is the
    high-water mark (for the metrics and the tests)."""

    def __init__(self, limit: int | None) -> None:
        self.limit, self.used, self.max_used = limit, 0, 0
        self._eval_waiting = 0
        self._cond = threading.Condition()

    def _fits(self, n: int) -> bool:
        return self.limit is None or self.used + n <= self.limit

    def try_take(self, n: int) -> bool:
        with self._cond:
            if not self._fits(n):
                return False
            self._take(n)
            return True

    def take(self, n: int, eval_: bool = False, should_stop: Callable[[], bool] = lambda: False) -> None:
        if self.limit is not None and n > self.limit:
            raise ValueError(f"a request of {n} completions is larger than --max-inflight-requests {self.limit}")
        with self._cond:
            self._eval_waiting += eval_
            try:
                while not self._fits(n) or (not eval_ and self._eval_waiting):
                    if should_stop():
                        raise RuntimeError("stopped while waiting for in-flight permits")
                    self._cond.wait(WAIT_POLL_S)
                self._take(n)
            finally:
                self._eval_waiting -= eval_
                self._cond.notify_all()

    def _take(self, n: int) -> None:  # with self._cond held
        self.used += n
        self.max_used = max(self.max_used, self.used)

    def give(self, n: int) -> None:
        with self._cond:
            self.used -= n
            self._cond.notify_all()


class PermitClient:
    """A rollout client whose ``generate`` takes its completions' permits from the shared pool for the request's
    lifetime (the producer's train requests; ``eval_``: a pinned eval epoch's episode turns, with priority); everything
    else is the wrapped client's."""

    def __init__(
        self, client: Any, permits: Permits, should_stop: Callable[[], bool] = lambda: False, eval_: bool = False
    ) -> None:
        self.client, self.permits, self.should_stop, self.eval_ = client, permits, should_stop, eval_

    def generate(self, prompts: list[list[int]], params: SamplingParams, **kw: Any) -> list:
        n = len(prompts) * params.n
        self.permits.take(n, eval_=self.eval_, should_stop=self.should_stop)
        try:
            return self.client.generate(prompts, params, **kw)
        finally:
            self.permits.give(n)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)


class GenerationClient(NativeClient):
    """The native sampler on the generation thread (``NativeEngine``): each call with ``threads`` torch intra-op
    threads (None: the run's); the engine gives the trainer's thread the rest (why: ``NativeEngine``)."""

    def __init__(self, model: Any, threads: int | None) -> None:
        super().__init__(model)
        self.threads = threads

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list:
        from align.rollout.native import intra_op_threads

        with intra_op_threads(self.threads):
            return super().generate(prompts, params)

    def generate_until(self, *args: Any, **kw: Any) -> list:
        from align.rollout.native import intra_op_threads

        with intra_op_threads(self.threads):
            return super().generate_until(*args, **kw)


def generation_threads(model: Any) -> int | None:
    """The generation thread's torch threads beside the trainer's: half the run's on a CPU (at least 1), as is
    elsewhere (CUDA: the trainer's and the sampler's work is on the device)."""
    import torch

    if model.lm_head.weight.device.type != "cpu":
        return None
    return max(1, torch.get_num_threads() // 2)


class NativeEngine:
    """The native sampler on its own copy of the policy (the generation thread never reads the live weights), run
    with ``generation_threads`` torch threads per call (``GenerationClient``). On a CPU the thread that opens it
    (the trainer's) and any thread started while it is open take the rest of the run's threads until ``close``:
    with the run's n beside the sampler's n / 2, n cores held 1.5 n OpenMP threads, and each side's parallel ops
    waited for cores the other held (``docs/performance.md``, partial rollouts)."""

    reports_version = True

    def __init__(self, policy: Any, version: int) -> None:
        import torch

        self.model = copy.deepcopy(policy).requires_grad_(False).eval()
        threads = generation_threads(self.model)
        self.client = GenerationClient(self.model, threads)
        self._run_threads = torch.get_num_threads() if threads is not None else None
        if self._run_threads is not None:  # also the process-wide count a new thread (an eval point) starts from
            torch.set_num_threads(max(1, self._run_threads - threads))
        self.client.weights_version = self.version = int(version)
        self._states: dict[int, dict] = {}
        self._lock = threading.Lock()
        self.lock = threading.RLock()  # the policy lock (the eval lease): held to change versions

    def publish(self, version: int, policy: Any) -> float:
        t0 = time.perf_counter()
        state = {k: v.detach().clone() for k, v in policy.state_dict().items()}
        with self._lock:
            self._states[version] = state
        return time.perf_counter() - t0

    def use(self, version: int) -> None:
        if version == self.version:
            return
        with self._lock:
            state = self._states.get(version)
            for v in [v for v in self._states if v <= version]:
                del self._states[v]  # versions only grow: older copies are never needed again
        if state is None:
            raise RuntimeError(f"weights version {version} was never published to the generation thread")
        self.model.load_state_dict(state)
        self.client.weights_version = self.version = version

    def submit(self, prompts: list[list[int]], params: SamplingParams, permits: int | None) -> Any:
        """Eval cohort on the generation copy: generated at once (the native engine has no request queue)."""
        return generate_groups(self.client, prompts, params, permits)

    def wait(self, handle: Any) -> list:
        return handle

    def close(self) -> None:
        import torch

        self._states.clear()
        if self._run_threads is not None:  # the trainer's thread back to the run's count
            torch.set_num_threads(self._run_threads)
            self._run_threads = None


class SpoolEngine:
    """A spool worker (one engine or a fleet): snapshots ``{root}/v{N}`` loaded through a ``WeightWatcher``."""

    def __init__(
        self, client: Any, root: Path, version: int, save: Callable[[Any, Path], Any], timeout_s: float
    ) -> None:
        if not getattr(client, "reports_version", True):
            raise ValueError(
                "--max-async-steps > 0 needs a rollout backend that stamps weights_version on every answer"
            )
        self.client, self.root, self.save, self.timeout_s = client, Path(root), save, timeout_s
        self.sync_s = 0.0
        self.watcher = WeightWatcher(self.root, self._load)
        # the worker may hold other weights (requests a killed predecessor run left in the spool): load ours, once
        self.sync_s = client.sync_weights(self.root / f"v{version}", version)
        self.watcher.version = int(version)
        self.should_stop: Callable[[], bool] = lambda: False

    @property
    def lock(self) -> threading.RLock:
        return self.watcher.lock

    @property
    def version(self) -> int | None:
        return self.watcher.version

    def _load(self, path: Path, version: int) -> None:
        self.sync_s += self.client.sync_weights(path, version)

    def publish(self, version: int, policy: Any) -> float:
        t0 = time.perf_counter()
        self.save(policy, self.root / f"v{version}")
        return time.perf_counter() - t0

    def use(self, version: int) -> None:
        got = self.watcher.update(version, self.timeout_s, self.should_stop)
        if got != version:
            raise RuntimeError(f"rollouts need weights version {version} but its snapshot is gone (got v{got})")
        self.watcher.collect_garbage()

    def submit(self, prompts: list[list[int]], params: SamplingParams, permits: int | None) -> Any:
        """Queue an eval cohort on the worker (whole groups per request) without waiting; ``wait`` collects it."""
        from align.rollout.protocol import generate_request

        handles = []
        for first, chunk, p in split_requests(prompts, params, permits):
            msg = generate_request(chunk, p)
            self.client.spool.submit(msg)
            handles.append((first, chunk, p, msg.id))
        return handles

    def wait(self, handles: Any) -> list:
        out = []
        for first, prompts, p, rid in handles:
            comps = self.client.generate(prompts, p, request_id=rid)
            out += [dataclasses.replace(c, prompt_index=c.prompt_index + first) for c in comps]
        return out

    def close(self) -> None:
        pass


def save_snapshot(policy: Any, path: Path) -> None:
    """``policy`` as a committed snapshot at ``path`` (LoRA: the adapter only, served on the base model). torchrun:
    gathered to rank 0's CPU and written by it; every rank waits for it."""
    from align import dist, lora

    full = dist.full_model(policy, to_main_cpu=True)
    if dist.is_main():
        lora.save_policy(full, path)
    dist.barrier()


class SyncSpool:
    """K = 0 with a spool worker: after every ``every``-th step a snapshot ``{root}/v{step}``, ``sync_weights`` to
    it, and the older snapshots removed (rank 0). ``version``: the weights the worker serves.

    ``sleep_level`` > 0 (``--colocate``: the worker on the trainer's GPU): once a step's rollouts are in
    (``collected``) the worker sleeps at that level (``align.rollout.sleep_mode``), freeing its GPU memory for the
    update; ``publish`` wakes it before the snapshot is synced. A worker without sleep mode is said once, then the
    run goes on without sleeping."""

    def __init__(self, client: Any, root: Path, version: int, every: int, sleep_level: int = 0) -> None:
        self.client, self.root, self.version, self.every = client, Path(root), int(version), every
        self.sleep_level, self.asleep = sleep_level, False

    def collected(self) -> None:
        from align import dist
        from align.rollout import sleep_mode

        if not self.sleep_level or self.asleep or not dist.is_main():
            return
        try:
            body = sleep_mode.sleep(getattr(self.client, "client", self.client), self.sleep_level)  # torchrun: rank 0's
        except sleep_mode.SleepModeUnsupported as e:
            print(f"[align] --colocate: the rollout worker cannot sleep ({e}); going on without sleeping", flush=True)
            self.sleep_level = 0
            return
        self.asleep = True
        log.info("rollout worker asleep (level %d): %.2f GiB freed", body["level"], body.get("freed_bytes", 0) / 2**30)

    def wake(self) -> float:
        """Wake the worker if ``collected`` put it to sleep; the seconds it took."""
        from align.rollout import sleep_mode

        if not self.asleep:
            return 0.0
        t0 = time.perf_counter()
        sleep_mode.wake_up(getattr(self.client, "client", self.client))
        self.asleep = False
        return time.perf_counter() - t0

    def publish(self, version: int, policy: Any) -> float:
        woke = self.wake()
        if version % self.every:
            return woke
        from align import dist

        save_snapshot(policy, self.root / f"v{version}")
        seconds = self.client.sync_weights(self.root / f"v{version}", version)
        self.version = version
        if dist.is_main():
            remove_snapshots_before(self.root, version)
        return woke + seconds

    def close(self) -> None:
        pass
