"""The real vLLM rollout worker (CPU build of vLLM in .venv-rollout), driven through the spool.

One worker on vLLM's default multiprocess engine (the production path) serves the first tests; the
kill test SIGKILLs it mid-request, checks the client's error and that teardown reaps the engine core,
then restarts an in-process worker in ``--logprobs-mode processed`` on the same spool, which resumes
the unanswered request and serves the remaining tests. References: transformers (greedy ids,
teacher-forced ``log_softmax``) and align's own model/native sampler on the same checkpoint.
Without .venv-rollout these tests skip, or fail under ALIGN_REQUIRE_ROLLOUT=1 (scripts/test.sh).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
from helpers_locks import assert_flock_released, flock_free
from helpers_models import require_rollout_venv as _require_rollout_venv

from align.rollout import protocol as P
from align.rollout.client import RolloutError, WorkerDiedError, make_rollout_client, spawn_worker
from align.rollout.protocol import SamplingParams
from align.rollout.spool import Spool

pytestmark = pytest.mark.rollout

LOGPROB_TOL = 1e-4  # fp32 vLLM CPU vs fp32 reference forward (measured ~1e-5 on the tiny model)
MAX_MODEL_LEN = 256
READY_TIMEOUT_S = 300.0  # engine start on 2 shared cores; a cold inductor cache adds ~20 s to the first generate
CALL_TIMEOUT_S = 180.0
PROMPTS = [[5, 17, 99, 123], [7, 8], [300, 2, 44, 45, 46, 47]]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from helpers_models import load_hf, make_tiny_qwen2

    root = tmp_path_factory.mktemp("models")
    m1, m2 = make_tiny_qwen2(root / "v1", seed=0), make_tiny_qwen2(root / "v2", seed=1)
    uncommitted = make_tiny_qwen2(root / "partial", seed=2, commit=False)
    return {"v1": m1, "v2": m2, "partial": uncommitted, "hf1": load_hf(m1), "hf2": load_hf(m2)}


class Fleet:
    """The module's worker(s) on one spool; teardown kills every process group it started."""

    def __init__(self, root: Path) -> None:
        self.root, self.spool = root, root / "spool"
        self.handles = []
        self.spawned: tuple | None = None  # (model, options) of the last spawn

    def spawn(self, model: Path, **kw):
        self.spawned = (model, kw)
        kw = {"max_model_len": MAX_MODEL_LEN, "dtype": "float32", "ready_timeout_s": READY_TIMEOUT_S, **kw}
        h = spawn_worker(self.spool, model=model, log_path=self.root / "worker.log", **kw)
        self.handles.append(h)
        self.handle = h
        self.client = make_rollout_client("spool", spool=self.spool, timeout_s=CALL_TIMEOUT_S, worker=h)
        return h

    def ensure(self, model: Path, **kw) -> Fleet:
        """This fleet with a live worker spawned as ``spawn(model, **kw)``: the running one when it is, else a new one
        after every earlier one is reaped, so a test never inherits what a failed test left (a killed worker, the
        other logprob basis)."""
        if not (self.handles and self.handle.alive() and self.spawned == (model, kw)):
            for h in self.handles:
                h.shutdown(grace_s=0)
            self.spawn(model, **kw)
        return self

    def close(self) -> None:
        for h in self.handles:
            h.shutdown(grace_s=5)


RAW = {"weights_version": 1}  # multiprocess engine, raw logprobs: the production default
PROCESSED = {"weights_version": 3, "in_process": True, "logprobs_mode": "processed"}  # what the kill test restarts


@pytest.fixture(scope="module")
def workers(models, tmp_path_factory):
    _require_rollout_venv()
    f = Fleet(tmp_path_factory.mktemp("rollout"))
    try:
        yield f
    finally:
        f.close()
        assert not any(h.group_alive() for h in f.handles), "a rollout worker process survived teardown"


@pytest.fixture
def fleet(workers, models):
    """The module's multiprocess worker (raw logprobs), started again if an earlier test left it dead."""
    return workers.ensure(models["v1"], **RAW)


@pytest.fixture
def processed(workers, models):
    """The in-process worker in --logprobs-mode processed that the kill test restarts on the spool (started here if
    that test failed before it did)."""
    return workers.ensure(models["v1"], **PROCESSED)


def _max_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b))


def refused_before_the_engine(tmp_path, models, flag: str, why: str) -> None:
    """A worker started with ``flag`` on this CPU build fails naming the flag and ``why``, before its engine loads."""
    log = tmp_path / f"refused{flag}.log"
    with pytest.raises(RuntimeError, match=f"{flag}: {why}"):
        spawn_worker(
            tmp_path / "spool",
            model=models["v1"],
            log_path=log,
            in_process=True,
            extra_args=[flag],
            max_model_len=MAX_MODEL_LEN,
            ready_timeout_s=READY_TIMEOUT_S,
        )
    assert "engine up" not in log.read_text()  # refused before the engine loaded


def test_generate_matches_transformers(fleet, models):
    from helpers_models import greedy_ids, teacher_forced_logprobs

    greedy = fleet.client.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=12))
    assert [c.token_ids for c in greedy] == [greedy_ids(models["hf1"], p, 12) for p in PROMPTS]
    params = SamplingParams(n=2, temperature=1.0, max_tokens=16, seed=7)
    out = fleet.client.generate(PROMPTS, params)
    assert [(c.prompt_index, c.sample_index) for c in out] == [(i, j) for i in range(3) for j in range(2)]
    assert all(c.weights_version == 1 and c.finish_reason == "length" and len(c.token_ids) == 16 for c in out)
    diffs, control = [], []
    for c in out:
        diffs.append(
            _max_diff(c.logprobs, teacher_forced_logprobs(models["hf1"], PROMPTS[c.prompt_index], c.token_ids))
        )
        control.append(
            _max_diff(c.logprobs, teacher_forced_logprobs(models["hf2"], PROMPTS[c.prompt_index], c.token_ids))
        )
        assert c.sampled_logprobs == c.logprobs  # T = 1, no truncation: the sampled distribution is the full one
    print(f"\nvLLM vs transformers teacher-forced logprobs, T=1: max |diff| = {max(diffs):.2e}")
    assert max(diffs) < LOGPROB_TOL
    assert min(control) > 100 * LOGPROB_TOL  # negative control: other weights are far off
    assert fleet.client.logprob_basis == "raw"
    assert fleet.client.last_timings["completion_tokens"] == 6 * 16


def test_logprobs_agree_with_native_sampler(fleet, models):
    """On the same weights at T = 1 the worker's logprobs are the native model's teacher-forced ones: rho ~ 1."""
    torch = pytest.importorskip("torch")
    from align.model import load_pretrained

    model = load_pretrained(models["v1"])
    out = fleet.client.generate(PROMPTS, SamplingParams(n=2, max_tokens=16, seed=11))
    worst = 0.0
    for c in out:
        ids = torch.tensor([PROMPTS[c.prompt_index] + c.token_ids])
        with torch.no_grad():
            logits = model(ids)[0, len(PROMPTS[c.prompt_index]) - 1 : -1]  # (T, V)
        native = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(c.token_ids)[:, None]).squeeze(-1)
        worst = max(worst, float((native - torch.tensor(c.logprobs)).abs().max()))
    print(
        f"\nvLLM vs align native teacher-forced logprobs, T=1: max |diff| = {worst:.2e} (rho within {worst:.1e} of 1)"
    )
    assert worst < LOGPROB_TOL


def test_seeded_sampling_is_reproducible(fleet):
    params = SamplingParams(n=3, max_tokens=10, seed=123)
    a = fleet.client.generate(PROMPTS[:2], params)
    b = fleet.client.generate(PROMPTS[:2], params)
    c = fleet.client.generate(PROMPTS[:2], SamplingParams(n=3, max_tokens=10, seed=124))
    assert [x.token_ids for x in a] == [x.token_ids for x in b]
    assert [x.token_ids for x in a] != [x.token_ids for x in c]
    assert len({tuple(x.token_ids) for x in a[:3]}) == 3  # the samples of one prompt differ


def test_stop_token_ends_the_completion(fleet, models):
    from helpers_models import greedy_ids

    ref = greedy_ids(models["hf1"], PROMPTS[0], 12)
    stop = ref[3]
    (c,) = fleet.client.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop]))
    assert c.finish_reason == "stop" and c.token_ids == ref[: ref.index(stop) + 1]


def test_weight_sync_changes_outputs(fleet, models):
    from helpers_models import greedy_ids

    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    before = fleet.client.generate(PROMPTS, greedy)
    seconds = fleet.client.sync_weights(models["v2"], 2)
    print(f"\nweight sync to v2: {seconds:.3f} s {fleet.client.last_timings}")
    assert seconds > 0 and fleet.client.last_timings["sync_method"] == "reload"
    after = fleet.client.generate(PROMPTS, greedy)
    assert fleet.client.weights_version == 2 and all(c.weights_version == 2 for c in after)
    assert [c.token_ids for c in after] == [greedy_ids(models["hf2"], p, 12) for p in PROMPTS]
    assert [c.token_ids for c in after] != [c.token_ids for c in before]
    assert fleet.client.sync_weights(models["v1"], 3) > 0  # and back
    assert [c.token_ids for c in fleet.client.generate(PROMPTS, greedy)] == [c.token_ids for c in before]


def test_bad_requests_are_clear_errors_and_the_worker_survives(fleet, models):
    client = fleet.client
    with pytest.raises(RolloutError, match=r"prompt 0 has 4 tokens \+ max_tokens 300 = 304 > max_model_len 256"):
        client.generate(PROMPTS[:1], SamplingParams(max_tokens=300))
    with pytest.raises(RolloutError, match=r"outside the vocabulary \[0, 512\): \[999\]"):
        client.generate([[1, 999]], SamplingParams())
    sp = Spool(fleet.spool)
    for path, why in ((models["partial"], "not committed"), (fleet.root / "nowhere", "does not exist")):
        msg = P.sync_request(path, 9)  # past the client's own checks, straight to the worker
        sp.submit(msg)
        with pytest.raises(RolloutError, match=f"bad_snapshot: .*{why}"):
            client.wait(msg.id)
    bad = sp.root / "requests" / "rzzz-garbage.json"
    P.atomic_write_text(bad, '{"protocol": "align-spool", "version": 1, "kind": "gener')
    with pytest.raises(RolloutError, match=r"malformed_request: .*rzzz-garbage.json: malformed or truncated"):
        client.wait("rzzz-garbage")
    assert (sp.root / "rejected" / "rzzz-garbage.json").exists()
    forged = sp.root / "requests" / "rzzz-forged-stop.json"  # a shutdown without the spool secret's MAC
    P.atomic_write_text(forged, P.shutdown_request("rzzz-forged-stop").to_json())
    deadline = time.monotonic() + CALL_TIMEOUT_S
    while not (sp.root / "rejected" / forged.name).exists():
        assert time.monotonic() < deadline, "the worker never set the forged shutdown aside"
        time.sleep(0.05)
    assert sp.request_state("rzzz-forged-stop") is None  # never answered
    assert client.generate(PROMPTS[:1], SamplingParams(max_tokens=4))[0].weights_version == client.weights_version
    while sp.read_heartbeat().get("untrusted_rejected") != 1:  # counted in the next heartbeat (every second)
        assert time.monotonic() < deadline, f"heartbeat {sp.read_heartbeat()} never counted the forged shutdown"
        time.sleep(0.05)


def test_second_worker_on_the_same_spool_is_refused(fleet, models):
    with pytest.raises(RuntimeError, match=r"(?s)failed to start.*already serves"):
        spawn_worker(fleet.spool, model=models["v1"], log_path=fleet.root / "second.log", ready_timeout_s=60)
    assert Spool(fleet.spool).read_heartbeat()["pid"] == fleet.handle.pid  # the live worker's heartbeat intact


def test_a_request_written_mid_flight_joins_the_running_engine(fleet):
    """Continuous batching: a short request written while a long one generates is admitted between engine steps and
    answered while the long one is still in flight (a barrier worker would answer it only after the long one). The
    engine core (the worker's child) is stopped while the worker takes the long request, and the short one is written
    before it resumes: the worker finds it after the long one's first step, however late this process looks (a loaded
    machine once missed every window of a race between the two)."""
    sp = Spool(fleet.spool)
    stalled = [pid for pid in _group_members(fleet.handle.pid) if pid != fleet.handle.pid]
    assert stalled, "the multiprocess engine has no engine core process"
    long = P.generate_request([[i + 3, i + 4, i + 5] for i in range(16)], SamplingParams(max_tokens=240, seed=1))
    short_params = SamplingParams(max_tokens=2, seed=2)
    short = P.generate_request([[7, 8]], short_params)
    try:
        for pid in stalled:
            os.kill(pid, signal.SIGSTOP)
        sp.submit(long)
        assert _past_pending(sp, long.id, "the long request") == "claimed"  # handed over; the stall holds it
        sp.submit(short)
    finally:
        for pid in stalled:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    out = fleet.client.generate([[7, 8]], short_params, request_id=short.id)
    st = fleet.client.last_timings
    body = fleet.client.wait(long.id, expect="completions")
    assert len(out[0].token_ids) == 2
    assert st["batch_requests"] == 2  # it shared the engine with the long one
    assert [len(c["token_ids"]) for c in body["completions"]] == [240] * 16 and body["timings"]["batch_requests"] == 2
    # when each was done, by the worker's own figures (how late this process looks cannot change them)
    short_done = short.created + st["queue_s"] + st["generate_s"]
    long_done = long.created + body["timings"]["queue_s"] + body["timings"]["generate_s"]
    assert short_done < long_done, "the short request was answered only after the long one"


def _past_pending(sp: Spool, msg_id: str, what: str) -> str:
    """The request's state once the worker has it: 'claimed' or later (a fast worker may claim and answer a short
    request between two looks of a loaded machine)."""
    deadline = time.monotonic() + CALL_TIMEOUT_S
    while (state := sp.request_state(msg_id)) in ("pending", None):
        assert time.monotonic() < deadline, f"the worker never claimed {what}"
        time.sleep(0.005)
    return state


def test_kill_mid_request_then_restart_resumes(fleet, models):
    params = SamplingParams(n=2, max_tokens=128, seed=5)
    prompts = [[i + 3, i + 4, i + 5] for i in range(4)]
    expected = fleet.client.generate(prompts, params)
    client, handle, sp = fleet.client, fleet.handle, Spool(fleet.spool)
    msg = P.generate_request(prompts, params)
    # The engine core (the worker's child) stopped first: the worker claims the request and hands it over, but it
    # cannot be answered before the kill, however long this process waits between two looks.
    stalled = [pid for pid in _group_members(handle.pid) if pid != handle.pid]
    assert stalled, "the multiprocess engine has no engine core process"
    try:
        for pid in stalled:
            os.kill(pid, signal.SIGSTOP)
        sp.submit(msg)
        assert _past_pending(sp, msg.id, "the request") == "claimed"  # not answered: the stall holds
        os.kill(handle.pid, signal.SIGKILL)  # the worker process only: its engine core child is orphaned
    finally:
        for pid in stalled:  # the orphans take the teardown's SIGTERM at once
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    t0 = time.monotonic()
    with pytest.raises(WorkerDiedError, match=r"(?s)exited with code -9.*client.wait.*worker log") as err:
        client.wait(msg.id)
    assert time.monotonic() - t0 < 5.0 and err.value.request_id == msg.id
    handle.shutdown(grace_s=0)
    assert not handle.group_alive(), "the engine core outlived the worker's teardown"
    assert sp.request_state(msg.id) == "claimed"
    # restart on the same spool (in-process engine, processed logprobs): the claimed request is served again
    fleet.spawn(models["v1"], **PROCESSED)
    resumed = fleet.client.generate(prompts, params, request_id=msg.id)
    assert [c.token_ids for c in resumed] == [c.token_ids for c in expected]
    flat = [[lp for c in cs for lp in c.logprobs] for cs in (resumed, expected)]
    assert _max_diff(*flat) < LOGPROB_TOL
    assert fleet.client.logprob_basis == "processed"


def test_processed_logprobs_are_the_temperature_scaled_basis(processed, models):
    from helpers_models import teacher_forced_logprobs

    fleet = processed
    assert fleet.client.logprob_basis == "processed"
    out = fleet.client.generate(PROMPTS, SamplingParams(n=2, temperature=0.7, max_tokens=16, seed=3))
    ref = [teacher_forced_logprobs(models["hf1"], PROMPTS[c.prompt_index], c.token_ids, 0.7) for c in out]
    raw = [teacher_forced_logprobs(models["hf1"], PROMPTS[c.prompt_index], c.token_ids, 1.0) for c in out]
    worst = max(_max_diff(c.logprobs, r) for c, r in zip(out, ref))
    print(f"\nprocessed logprobs vs log_softmax(logits/0.7): max |diff| = {worst:.2e}")
    assert worst < LOGPROB_TOL
    assert min(_max_diff(c.logprobs, r) for c, r in zip(out, raw)) > 100 * LOGPROB_TOL  # control: not the raw basis
    assert P.logprob_basis_warning("processed", SamplingParams(temperature=0.7)) is None
    assert P.logprob_basis_warning("raw", SamplingParams(temperature=0.7)) is not None
    (t,) = fleet.client.generate(PROMPTS[:1], SamplingParams(temperature=0.7, top_p=0.5, max_tokens=16, seed=3))
    full = teacher_forced_logprobs(models["hf1"], PROMPTS[0], t.token_ids, 0.7)
    assert t.sampled_logprobs == t.logprobs  # processed: the truncated, renormalised distribution sampled from
    assert all(s >= f - LOGPROB_TOL for s, f in zip(t.logprobs, full)) and any(
        s > f + 1e-3 for s, f in zip(t.logprobs, full)
    )


def test_sleep_is_unsupported_on_the_cpu_build_and_the_worker_serves_on(processed, models, tmp_path, capsys):
    """vLLM's CPU build has no sleep mode: the real worker answers sleep / wake_up with ``unsupported`` (a clear
    SleepModeUnsupported, not a crash) and keeps serving; the trainer's colocated engine (SyncSpool) says so once and
    goes on without sleeping. A worker asked to start with --enable-sleep-mode on CPU is refused before its engine
    loads (the GPU path: tests/test_colocate.py, marked gpu)."""
    from align.rollout import sleep_mode
    from align.rollout.engines import SyncSpool

    with pytest.raises(sleep_mode.SleepModeUnsupported, match="no sleep mode on cpu .*CPU build"):
        sleep_mode.sleep(processed.client, 1)
    with pytest.raises(sleep_mode.SleepModeUnsupported, match="no sleep mode"):
        sleep_mode.wake_up(processed.client)
    (out,) = processed.client.generate([PROMPTS[0]], SamplingParams(max_tokens=4, seed=0))
    assert out.token_ids  # the worker serves on
    engine = SyncSpool(processed.client, tmp_path / "snaps", processed.client.weights_version, 1, sleep_level=1)
    capsys.readouterr()
    engine.collected()
    engine.collected()
    assert capsys.readouterr().out.count("the rollout worker cannot sleep") == 1
    assert engine.sleep_level == 0 and engine.wake() == 0.0  # never asleep: nothing to wake
    refused_before_the_engine(tmp_path, models, "--enable-sleep-mode", "vLLM has no sleep mode on cpu")


def test_invalid_model_fails_cleanly(models, tmp_path):
    """A checkpoint that passes the file checks but vLLM cannot load: the start fails with the log, no process left."""
    bad = tmp_path / "bad_model"
    shutil.copytree(models["v1"], bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "architectures": ["NoSuchModelForCausalLM"]}))
    with pytest.raises(RuntimeError, match=r"(?s)rollout worker failed to start.*log"):
        spawn_worker(tmp_path / "spool", model=bad, in_process=True, ready_timeout_s=READY_TIMEOUT_S)
    hb = Spool(tmp_path / "spool").read_heartbeat()
    assert hb["state"] == "failed" and "engine failed to start" in hb["error"]


def test_shutdown_leaves_no_process(processed):
    fleet = processed
    handle = fleet.handle
    assert handle.alive()
    handle.shutdown()
    assert handle.returncode == 0 and not handle.group_alive()
    assert Spool(fleet.spool).read_heartbeat()["state"] == "stopped"


PARENT_EXIT_S = 10.0  # the watch sees the pipe's EOF at once, then SIGKILLs the worker's group (measured ~1 s)
_LAUNCHER = """
import sys, time
from align.rollout.client import spawn_worker
spawn_worker(sys.argv[1], model=sys.argv[2], log_path=sys.argv[3], in_process=True, max_model_len={mml},
             dtype="float32", weights_version=4, ready_timeout_s={ready})
print("ready", flush=True)
time.sleep(3600)
"""


def _group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of process group ``pgid``."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                out.append(int(d.name))
    return out


@pytest.mark.slow
def test_worker_exits_when_its_launcher_is_killed_and_a_rerun_gets_the_spool(models, tmp_path):
    """kill -9 of the process that called spawn_worker (a trainer): the worker notices (pipe EOF / parent pid),
    exits within PARENT_EXIT_S releasing worker.lock, so a rerun gets the spool: the lock a new worker takes first
    (rollout_worker.lock_spool) is free. That a new worker then serves on a spool whose worker died is
    test_kill_mid_request_then_restart_resumes (one vLLM start fewer here)."""
    import subprocess
    import sys

    _require_rollout_venv()
    spool, log = tmp_path / "spool", tmp_path / "worker.log"
    code = _LAUNCHER.format(mml=MAX_MODEL_LEN, ready=READY_TIMEOUT_S)
    launcher = subprocess.Popen(
        [sys.executable, "-c", code, str(spool), str(models["v1"]), str(log)], stdout=subprocess.PIPE, text=True
    )
    worker_pid = None
    try:
        assert launcher.stdout.readline().strip() == "ready", f"launcher failed; log:\n{log.read_text()[-3000:]}"
        worker_pid = Spool(spool).read_heartbeat()["pid"]
        assert P.pid_alive(worker_pid) and _group_members(worker_pid)
        assert not flock_free(Spool(spool).lock_path)  # control: the live worker holds worker.lock
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait()
        t0 = time.monotonic()
        while _group_members(worker_pid):
            assert time.monotonic() - t0 < PARENT_EXIT_S, (
                f"worker outlived its launcher; log:\n{log.read_text()[-3000:]}"
            )
            time.sleep(0.1)
        print(f"\nworker group gone {time.monotonic() - t0:.1f} s after kill -9 of its launcher")
        hb = Spool(spool).read_heartbeat()
        assert hb["state"] == "failed" and "launching process" in hb["error"], hb
        assert_flock_released(Spool(spool).lock_path)  # the rerun gets the spool (worker.lock)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        if worker_pid is not None:
            for pid in _group_members(worker_pid):
                os.kill(pid, signal.SIGKILL)


def test_return_routes_is_refused_on_the_cpu_build(models, tmp_path):
    """--return-routes (protocol minor 4, --routing-replay rollout over the spool): vLLM captures routed experts in
    its GPU model runner only, so the CPU build's worker refuses it before its engine loads, naming why."""
    refused_before_the_engine(
        tmp_path, models, "--return-routes", "this vLLM build cannot return routed experts without a GPU"
    )
