"""Asynchronous rollouts (align.pipeline, --max-async-steps K): the staleness rule, version stamps, in-flight
permits, checkpoint/resume after kill -9, producer failures, the weight watcher, bad input. Native backend on CPU;
the real vLLM worker runs in tests/test_pipeline_spool.py."""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch
from helpers_train import PROMPTS, TIMING_KEYS, TOK, a_reward, cfg_for, jsonl_rows, records, run_cli, wait_for

from align.rewards import Scores
from align.rollout import engines, pipeline
from align.rollout.client import NativeClient, WorkerDiedError
from align.rollout.groups import Groups
from align.rollout.protocol import Completion, SamplingParams
from align.rollout.watcher import WeightWatcher
from align.tasks import reverse
from align.train import TrainConfig, main, train

PRODUCER_FAILURE_TIMEOUT_S = 10.0  # a producer exception reaches the trainer well within this


def run(out, model, **kw) -> list[dict]:
    cfg = cfg_for(out, **{"steps": 5, "checkpoint_every": 0, **kw})
    cfg.log.log_completions_every = 1
    train(cfg, model=model, tokenizer=TOK, prompts=PROMPTS, reward=a_reward)
    return records(out)


def strip(recs: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS and not k.startswith("async/")} for r in recs]


# ------------------------------------------------------------------------------------------------ the rule


def test_version_rule():
    assert [pipeline.version_for(t, 0) for t in range(1, 6)] == [0, 1, 2, 3, 4]
    assert [pipeline.version_for(t, 2) for t in range(1, 6)] == [0, 0, 0, 1, 2]
    assert pipeline.version_for(5, 2, floor=4) == 4  # a resumed run never goes below its checkpoint's weights


@pytest.mark.parametrize("K", [1, 2])
def test_rollouts_of_step_t_come_from_version_t_minus_1_minus_k(tmp_path, char_model, K):
    recs = run(tmp_path / "a", char_model, max_async_steps=K)
    for r in recs:
        t = r["step"]
        assert r["async/off_policy_steps_max"] == min(t - 1, K) == r["async/off_policy_steps_mean"]
        assert r["async/inflight"] <= K + 1  # the wait / idle timings: test_async_wait_and_idle_times_are_*
    sync = run(tmp_path / "sync", char_model)
    assert not any(k.startswith("async/") for r in sync for k in r)  # K = 0 logs exactly what it logged before
    # step 1 (version 0 either way) is the same batch; from step 2 the rollouts come from older weights, so they differ
    assert strip(recs)[0] == strip(sync)[0]
    assert strip(recs)[1] != strip(sync)[1]


def test_async_runs_are_deterministic(tmp_path, char_model):
    a = run(tmp_path / "a", char_model, max_async_steps=1, steps=4)
    b = run(tmp_path / "b", char_model, max_async_steps=1, steps=4)
    assert strip(a) == strip(b)
    c = run(tmp_path / "c", char_model, max_async_steps=2, steps=4)  # negative control: K changes the log
    assert strip(a) != strip(c)


# ------------------------------------------------------------------------------------------------ permits


class Recording(NativeClient):
    def __init__(self, model):
        super().__init__(model)
        self.requests: list[int] = []

    def generate(self, prompts, params):
        self.requests.append(len(prompts) * params.n)
        return super().generate(prompts, params)


def test_permits_split_a_batch_into_whole_groups(char_model):
    from align.model import load_pretrained

    client = Recording(load_pretrained(char_model))
    prompts = [TOK.encode(p["prompt"]) for p in PROMPTS[:5]]
    params = SamplingParams(n=3, max_tokens=3, seed=1)
    comps = engines.generate_groups(client, prompts, params, permits=7)  # 2 groups of 3 per request
    assert client.requests == [6, 6, 3]
    assert [(c.prompt_index, c.sample_index) for c in comps] == [(p, s) for p in range(5) for s in range(3)]
    client.requests.clear()
    whole = engines.generate_groups(client, prompts, params, permits=None)
    assert client.requests == [15] and len(whole) == 15


def test_the_generation_thread_samples_on_half_the_threads(char_model, monkeypatch):
    """K >= 1 on a CPU, a run of 3 threads: the engine's calls run with 1 (half, at least 1), put back after each
    call, the tokens unchanged; while the engine is open the trainer's thread (the one that opened it) and a thread
    started then hold the other 2, not all 3 (1.5x the cores before); its close puts the run's 3 back. Control: a
    plain NativeClient before the engine calls with the run's 3."""
    from align.model import load_pretrained
    from align.rollout import native

    seen, fresh, real = [], [], native.generate

    def counts(*a, **k):  # this thread's count, and the one a thread started now begins with
        seen.append(torch.get_num_threads())
        t = threading.Thread(target=lambda: fresh.append(torch.get_num_threads()))
        t.start(), t.join()
        return real(*a, **k)

    monkeypatch.setattr(native, "generate", counts)
    prompts, params = [TOK.encode(p["prompt"]) for p in PROMPTS[:2]], SamplingParams(n=2, max_tokens=4, seed=1)
    old = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        model = load_pretrained(char_model)
        want = NativeClient(model).generate(prompts, params)
        engine = engines.NativeEngine(model, 0)
        trainer = torch.get_num_threads()
        got = {}
        th = threading.Thread(
            target=lambda: got.update(c=engine.client.generate(prompts, params), n=torch.get_num_threads())
        )
        th.start()
        th.join(60)
        engine.close()
        assert (seen, fresh, trainer, got["n"]) == ([3, 1], [3, 2], 2, 2)
        assert torch.get_num_threads() == 3
        assert [c.token_ids for c in got["c"]] == [c.token_ids for c in want]
    finally:
        torch.set_num_threads(old)


# ------------------------------------------------------------------------------------------------ plumbing


def test_pending_batches_survive_a_weights_only_round_trip(tmp_path):
    c = Completion(1, 0, [3, 4], [-0.5, -1.25], "length", [-0.4, -1.0], weights_version=3)
    b = Groups([7, 2], [c], ["xy"], Scores([float("nan")], {"r": [0.5]}, ["tb"], 1, 1), 1, 3, 1, 2)
    p = pipeline.Produced(5, 3, b, {"epoch": 1, "index": 4})
    torch.save({"pending_batches": [p.to_state()]}, tmp_path / "s.pt")
    back = pipeline.Produced.from_state(torch.load(tmp_path / "s.pt", weights_only=True)["pending_batches"][0])
    assert back.groups.completions == [c] and back.cursor == p.cursor and back.version == 3
    assert back.groups.idx == b.idx and back.groups.scores.terms == b.scores.terms


class NullEngine:
    reports_version = True
    client = None

    def __init__(self):
        self.version, self.lock = 0, threading.RLock()

    def use(self, version):
        self.version = version

    def publish(self, version, policy):
        return 0.0

    def close(self):
        pass


def test_a_producer_failure_reaches_the_trainer(tmp_path):
    def collect(t, version, client):
        if t == 2:
            raise WorkerDiedError("rollout worker failed while request r2 was pending", "r2")
        return Groups([0], [Completion(0, 0, [1], [0.0], "stop", weights_version=version)], ["x"], Scores([1.0], {}))

    pipe = pipeline.RolloutPipeline(1, collect, engine=NullEngine(), last_step=5, cursor={})
    try:
        pipe.next(1)
        pipe.publish(1, None)
        t0 = time.monotonic()
        with pytest.raises(WorkerDiedError, match="r2"):
            pipe.next(2)
        assert time.monotonic() - t0 < PRODUCER_FAILURE_TIMEOUT_S
    finally:
        pipe.close()


def test_a_wrong_version_stamp_is_refused():
    def collect(t, version, client):  # an engine that missed its update: stamps the previous version
        return Groups(
            [0], [Completion(0, 0, [1], [0.0], "stop", weights_version=version - 1)], ["x"], Scores([1.0], {})
        )

    pipe = pipeline.RolloutPipeline(1, collect, engine=NullEngine(), start_step=3, last_step=5, cursor={})
    try:
        with pytest.raises(RuntimeError, match="must come from weights version 3"):
            pipe.next(4)
    finally:
        pipe.close()


def commit(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    (path / "STABLE").write_text("")
    return path


def test_watcher_waits_without_the_lock_and_retargets_a_deleted_snapshot(tmp_path):
    loaded = []
    w = WeightWatcher(tmp_path, lambda p, v: loaded.append((p.name, v)))
    got = []
    th = threading.Thread(target=lambda: got.append(w.update(3, timeout_s=30)))
    th.start()
    time.sleep(0.3)
    assert w.lock.acquire(blocking=False)  # the watcher waits for publication without holding the policy lock
    commit(tmp_path / "v3")
    time.sleep(0.3)
    assert loaded == []  # ... and loads only once it has the lock
    commit(tmp_path / "v4")
    import shutil

    shutil.rmtree(tmp_path / "v3")  # the trainer moved on and deleted v3 while the watcher waited behind the lock
    w.lock.release()
    th.join(10)
    assert got == [4] and loaded == [("v4", 4)] and w.version == 4  # one version for the path, the load, the stamp


def test_watcher_never_deletes_a_pinned_snapshot(tmp_path):
    w = WeightWatcher(tmp_path, lambda p, v: None)
    for v in (1, 2, 3):
        commit(tmp_path / f"v{v}")
    w.pin(1)
    assert w.update(3, timeout_s=5) == 3
    w.collect_garbage()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v1", "v3"]
    w.unpin(1)
    w.collect_garbage()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v3"]


# ------------------------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"max_async_steps": -1}, "--max-async-steps must be >= 0"),
        ({"max_inflight_requests": 0}, "--max-inflight-requests must be >= 1"),
        ({"max_inflight_requests": 3, "group_size": 4}, "larger than --max-inflight-requests"),
        ({"max_async_steps": 1, "sync_every": 2}, "--sync-every 2 does not apply"),
    ],
)
def test_bad_async_settings_fail_before_training(kw, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig(**kw)


def test_a_backend_without_version_stamps_is_refused(tmp_path):
    class NoStamps:
        reports_version = False

    with pytest.raises(ValueError, match="stamps weights_version"):
        engines.SpoolEngine(NoStamps(), tmp_path, 0, lambda m, p: None, 10)


# ------------------------------------------------------------------------------------------------ kill -9 / SIGTERM


def cli_args(out: Path, model: str, *extra: str) -> list[str]:
    args = ["--out", str(out), "--model", model, "--steps", "7", "--prompts-per-step", "4", "--group-size", "4"]
    args += ["--max-tokens", "6", "--checkpoint-every", "2", "--eval-interval", "0", "--max-async-steps", "2"]
    return args + ["--log-completions-every", "1", "--keep-checkpoints", "10", *extra]


def cli(out: Path, model: str, *extra: str) -> subprocess.Popen:
    """The run in a process of its own: the runs that are killed or signalled (the others run ``main`` here)."""
    return run_cli(cli_args(out, model, *extra))


def logged(out: Path) -> tuple[list[dict], list[dict]]:
    def load(name):
        p = out / name
        rows = jsonl_rows(p) if p.exists() else []  # polled while the run writes: up to the last finished line
        return [{k: v for k, v in r.items() if k not in TIMING_KEYS and k not in TIMED_ASYNC} for r in rows]

    return load("metrics.jsonl"), load("completions.jsonl")


TIMED_ASYNC = {"async/trainer_wait_s", "async/generator_idle_s", "async/inflight"}  # timings, not records


@pytest.fixture(scope="module")
def builtin_model(tmp_path_factory) -> str:
    return str(reverse.warm_start(tmp_path_factory.mktemp("ws") / "m", steps=20, batch=16, log=None))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, builtin_model) -> Path:
    out = tmp_path_factory.mktemp("full")
    assert main(cli_args(out, builtin_model)) == 0
    return out


def wait_steps(out: Path, n: int, proc: subprocess.Popen) -> None:
    wait_for(lambda: len(logged(out)[0]) >= n, proc, poll_s=0.02)


@pytest.mark.slow
def test_kill_9_then_rerun_logs_exactly_the_uninterrupted_run(tmp_path, builtin_model, uninterrupted):
    out = tmp_path / "killed"
    proc = cli(out, builtin_model)
    wait_steps(out, 3, proc)  # checkpoint 2 holds the pending batches of steps 3 and 4 (from versions 0 and 1)
    proc.kill()
    proc.wait()
    rerun = cli(out, builtin_model)
    text = rerun.communicate(timeout=600)[0]
    assert rerun.returncode == 0, text[-3000:]
    assert "resuming from" in text
    assert logged(out) == logged(uninterrupted)
    assert len(logged(out)[0]) == 7 and logged(out)[0][-1]["async/off_policy_steps_max"] == 2
    # negative control: the same run resumed WITHOUT its pending batches (regenerated from the checkpoint's weights,
    # i.e. what a checkpoint of only the cursor would give) logs something else, so the equality above is not vacuous
    from align.run import checkpoint as ckpt

    lost = tmp_path / "lost"
    import shutil

    shutil.copytree(out, lost)
    for p in (lost / "checkpoints").iterdir():
        if p.name != "step_2":
            shutil.rmtree(p)
    state = torch.load(lost / "checkpoints" / "step_2" / "trainer_state.pt", weights_only=True)
    state["cursor"] = pipeline.Produced.from_state(state.pop("pending_batches")[0]).cursor  # before step 3's prompts
    state["cursor"]["index"] -= 4
    torch.save(state, lost / "checkpoints" / "step_2" / "trainer_state.pt")
    assert ckpt.latest(lost / "checkpoints")[0] == 2
    assert main(cli_args(lost, builtin_model)) == 0
    assert logged(lost)[0][:2] == logged(uninterrupted)[0][:2]
    assert logged(lost)[0][2:] != logged(uninterrupted)[0][2:]


@pytest.mark.slow
def test_sigterm_checkpoints_and_exits_then_resumes_exactly(tmp_path, builtin_model, uninterrupted):
    out = tmp_path / "sig"
    proc = cli(out, builtin_model, "--checkpoint-every", "0")
    wait_steps(out, 3, proc)
    proc.send_signal(signal.SIGTERM)
    text = proc.communicate(timeout=300)[0]
    assert proc.returncode == 143, text[-3000:]
    assert main(cli_args(out, builtin_model, "--checkpoint-every", "0")) == 0  # the rerun
    assert logged(out) == logged(uninterrupted)


def test_a_shutdown_the_dead_worker_never_served_is_withdrawn(tmp_path):
    """Regression: a worker killed mid-pipeline left the trainer's shutdown message in the spool, and the rerun's
    new worker served it and stopped ('worker ... is stopped' on the rerun). The process here stands in for a worker
    that never reads its spool (no vLLM needed to show the message handling)."""
    from align.rollout.client import WorkerHandle
    from align.rollout.spool import Spool

    spool = Spool(tmp_path / "spool").ensure()
    proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
    WorkerHandle(proc, spool, tmp_path / "log").shutdown(grace_s=0.2)
    assert spool.pending() == []
    assert not list((spool.root / "claimed").iterdir())


# ------------------------------------------------------------------------------------------------ generation time

GEN_S = 0.3  # the fake generation time of one batch on the producer
SENTINEL_S = 123.0  # a generation time no wall clock of this test could measure


def test_generation_time_is_measured_on_the_producer():
    """With K >= 1 a batch's ``seconds`` is how long the producer spent generating + scoring it, not how long the
    trainer waited for it (the trainer arrives late here, so its wait is ~0)."""

    def collect(t, version, client):
        time.sleep(GEN_S)
        return Groups([0], [Completion(0, 0, [1], [0.0], "stop", weights_version=version)], ["x"], Scores([1.0], {}))

    pipe = pipeline.RolloutPipeline(1, collect, engine=NullEngine(), last_step=2, cursor={})
    try:
        pipe.start()
        time.sleep(3 * GEN_S)  # the trainer is busy elsewhere: step 1 is ready when it asks
        p, stats = pipe.next(1)
    finally:
        pipe.close()
    assert p.seconds >= GEN_S
    assert stats["async/trainer_wait_s"] < GEN_S / 2  # negative control: the wait is not the generation time
    assert pipeline.Produced.from_state(p.to_state()).seconds == p.seconds  # a pending batch keeps it on resume


IDLE_S = 0.3  # how long the trainer keeps the producer blocked on the staleness bound


def wait_until(pred, what: str, timeout: float = PRODUCER_FAILURE_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(0.01)


def test_async_wait_and_idle_times_are_the_trainer_s_and_the_producer_s():
    """``async/trainer_wait_s`` is how long ``next`` waited for its batch; ``async/generator_idle_s`` how long the
    producer sat blocked since the previous ``next`` (here on the staleness bound: step 3 needs version 1). Each
    step below makes one of them large and the other ~0, so neither can stand in for the other."""

    def collect(t, version, client):
        time.sleep(GEN_S)
        return Groups([0], [Completion(0, 0, [1], [0.0], "stop", weights_version=version)], ["x"], Scores([1.0], {}))

    pipe = pipeline.RolloutPipeline(1, collect, engine=NullEngine(), last_step=3, cursor={})
    try:
        _, first = pipe.next(1)  # starts the producer: the trainer waits for the whole generation of step 1
        wait_until(lambda: 2 in pipe.ready, "step 2 (version 0) produced")  # step 3 is blocked from here on
        time.sleep(IDLE_S)
        pipe.publish(1, None)
        wait_until(lambda: ("train", 3, 1) in pipe.events, "step 3 started on version 1")  # its idle is counted
        _, second = pipe.next(2)  # ready since before the sleep
    finally:
        pipe.close()
    assert first["async/trainer_wait_s"] >= GEN_S / 2 and first["async/generator_idle_s"] < GEN_S / 2, first
    assert second["async/trainer_wait_s"] < GEN_S / 2 and second["async/generator_idle_s"] >= IDLE_S / 2, second


def test_rollout_time_and_tokens_per_s_come_from_the_producer(tmp_path, char_model, monkeypatch):
    """metrics.jsonl's rollout_time is the batch's producer-side ``seconds`` (K >= 1) and tokens_per_s divides by it:
    each batch is stamped with a sentinel no trainer-side clock could produce."""
    real_next = pipeline.RolloutPipeline.next

    def stamped_next(self, t):
        p, stats = real_next(self, t)
        p.seconds = SENTINEL_S
        return p, stats

    monkeypatch.setattr(pipeline.RolloutPipeline, "next", stamped_next)
    recs = [r for r in run(tmp_path / "a", char_model, max_async_steps=1, steps=3) if "rollout_time" in r]
    assert len(recs) == 3
    for r in recs:
        tokens = r["completion_len_mean"] * 4 * 4  # prompts_per_step * group_size completions
        assert r["rollout_time"] == SENTINEL_S
        assert r["tokens_per_s"] == pytest.approx(tokens / SENTINEL_S)
