"""The watchdog (``--stall-timeout-s``, ``align.run.watchdog``): each part hung in turn in a real CLI run of the
built-in task (a reward, an environment step, the native sampler), and the run ends within a bounded wait with the
one line naming that part, ``stall.txt`` (thread stacks, calls in flight) and exit status 3. The hangs are real
(a blocked ``threading.Event().wait()`` in the reward, the environment or ``sample_next``), nothing is faked; the
negative control is the same run without the hang, which finishes with status 0 and no stall.txt."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers_train import ROOT, cli_args, run_cli

from align.train import main

STALL_S = 3.0  # the runs' --stall-timeout-s: steps of the built-in task take ~0.1 s, so no healthy gap comes near it
WAIT_S = 240.0  # bound on a whole run here (warm start excluded: the fixture's model is saved)

HANGS = """
import sys, threading
sys.path.insert(0, {fixtures!r})
from turn_envs import Feedback
CALLS = {{"n": 0}}

def hang_after(n):
    CALLS["n"] += 1
    if CALLS["n"] > n and {hang!r}:
        threading.Event().wait()  # blocked for good: no timeout is on (--reward-timeout-s 0, --env-timeout-s 0)

def reward(prompt, completion, answer, **_):
    hang_after(3 * 8 * 4)  # steps 1-3 score, step 4 hangs (--prompts-per-step 8 x --group-size 4)
    return float(completion == answer)

class HangEnv(Feedback):
    def step(self, completion):
        hang_after(3 * 8 * 4)
        return super().step(completion)
"""

SAMPLER = """
import sys, threading
import align.rollout.{module} as native
real, calls = native.sample_next, {{"n": 0}}
def sample_next(*a, **kw):
    calls["n"] += 1
    if calls["n"] > 40:  # past the step-0 eval and a few steps: the decode loop blocks
        threading.Event().wait()
    return real(*a, **kw)
native.sample_next = sample_next
from align.train import main
sys.exit(main(sys.argv[1:]))
"""


def _files(tmp_path, hang: bool = True) -> dict:
    from pathlib import Path

    from align.tasks import reverse

    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps(r) + "\n" for r in reverse.prompts(64, "train")))
    hangs = tmp_path / "hangs.py"
    hangs.write_text(HANGS.format(fixtures=str(Path(__file__).parent / "fixtures"), hang=hang))
    return {"rows": str(rows), "hangs": str(hangs)}


def _args(out, model, *extra: str) -> list[str]:
    return [*cli_args(out, model), "--steps", "8", "--stall-timeout-s", str(STALL_S), "--reward-timeout-s", "0",
            "--env-timeout-s", "0", *extra]  # fmt: skip


def _ended_by_watchdog(proc, out, part: str, stuck: bool = True) -> str:
    """The run's exit status, its one error line (naming ``part``; ``stuck``: the trainer thread was in the call, so
    the process exits at once) and stall.txt."""
    log = proc.communicate(timeout=WAIT_S)[0]  # bounded: the watchdog (or the hard exit after its grace) ends it
    assert proc.returncode == 3, log[-3000:]
    lines = [x for x in log.splitlines() if x.startswith("align.train: error:")]
    assert len(lines) == 1 and lines[0].startswith("align.train: error: stalled: no token"), log[-3000:]
    assert f"the {part} stopped" in lines[0] and ("exiting without a new checkpoint" in lines[0]) == stuck, lines
    stall = (out / "stall.txt").read_text()
    assert stall.startswith("stalled") and "calls in flight" in stall and "thread MainThread" in stall
    return stall


@pytest.mark.parametrize("async_steps", ["0", "1"])
def test_a_hung_reward_ends_the_run_with_the_line_and_stall_txt(tmp_path, builtin_model, async_steps):
    """K = 0: the reward blocks the trainer thread, so the process exits after the grace (the last committed
    checkpoint stays); K = 1: it blocks the producer, the trainer stops at its wait and checkpoints step 3."""
    f = _files(tmp_path)
    out = tmp_path / "run"
    extra = ["--train-data", f["rows"], "--reward", f"{f['hangs']}:reward", "--eval-interval", "0"]
    proc = run_cli(_args(out, builtin_model, *extra, "--max-async-steps", async_steps))
    stall = _ended_by_watchdog(proc, out, "reward", stuck=async_steps == "0")
    assert "reward: for" in stall and "in reward" in stall  # the call in flight; the reward's frame in the stacks
    ckpts = sorted(int(p.name.split("_")[1]) for p in (out / "checkpoints").iterdir() if p.name.startswith("step_"))
    assert ckpts[-1] == (2 if async_steps == "0" else 3), ckpts  # K = 1: the stop at a safe point saved step 3


def test_a_hung_environment_step_ends_the_run(tmp_path, builtin_model):
    f = _files(tmp_path)
    out = tmp_path / "run"
    extra = ["--train-data", f["rows"], "--env", f"{f['hangs']}:HangEnv", "--max-turns", "2", "--eval-interval", "0"]
    stall = _ended_by_watchdog(run_cli(_args(out, builtin_model, *extra)), out, "environment")
    assert "call step" in stall and "in step" in stall


@pytest.mark.parametrize("module", ["native", "sessions"])
def test_a_blocked_native_sampler_ends_the_run(tmp_path, builtin_model, module):
    """``sample_next`` blocked mid-run (patched in the run's own process by a driver script): the trainer thread is
    stuck in the decode loop, so the process exits at once, naming the sampler. ``sessions``: the episodes' decode
    loop (kept KV cache) of an --env run."""
    script = tmp_path / "blocked_sampler.py"
    script.write_text(SAMPLER.format(module=module))
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    extra = []
    if module == "sessions":
        f = _files(tmp_path, hang=False)
        extra = [
            "--train-data",
            f["rows"],
            "--env",
            f"{f['hangs']}:HangEnv",
            "--max-turns",
            "2",
            "--eval-interval",
            "0",
        ]
    cmd = [sys.executable, str(script), *_args(out, builtin_model, *extra)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    stall = _ended_by_watchdog(proc, out, "sampler")
    assert ("engine native session" in stall) == (module == "sessions") and "in sample_next" in stall


def test_negative_control_the_same_run_without_a_hang_finishes(tmp_path, builtin_model, capsys):
    f = _files(tmp_path, hang=False)
    out = tmp_path / "run"
    extra = ["--train-data", f["rows"], "--reward", f"{f['hangs']}:reward", "--eval-interval", "0"]
    assert main(_args(out, builtin_model, *extra, "--max-async-steps", "1")) == 0
    assert not (out / "stall.txt").exists()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--stall-timeout-s", "-1"], "--stall-timeout-s -1.0 is invalid: must be a finite number >= 0"),
        (["--stall-timeout-s", "nan"], "--stall-timeout-s nan is invalid: must be a finite number >= 0"),
        (["--stall-timeout-s", "inf"], "--stall-timeout-s inf is invalid: must be a finite number >= 0"),
        (["--stall-timeout-s", "0.5", "--reward-timeout-s", "0", "--env-timeout-s", "0"], "below the minimum (1.0 s)"),
        (["--stall-timeout-s", "30"], "below --reward-timeout-s (60.0 s)"),
        (["--stall-timeout-s", "70", "--reward-timeout-s", "5", "--env-timeout-s", "80"], "below --env-timeout-s"),
        (["--stall-timeout-s", "100", "--rollout", "spool"], "below --rollout-timeout-s (600.0 s)"),
        (["--stall-timeout-s", "100", "--eval-num-gpus", "1", "--eval-hf-dir", "/tmp/e"], "below --eval-timeout-s"),
    ],
)
def test_bad_stall_timeout_is_one_clear_error_before_anything_loads(tmp_path, capsys, extra, message):
    with pytest.raises(SystemExit) as e:
        main(["--out", str(tmp_path / "never"), *extra])
    assert e.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "never").exists()  # nothing made, nothing loaded


def test_stall_timeout_default_is_on_and_above_every_call_timeout():
    from align.rewards import RewardConfig
    from align.train import TrainConfig

    assert TrainConfig().stall_after_s == 1800.0 and TrainConfig(stall_timeout_s=0).stall_after_s == 0
    assert TrainConfig(rewards=RewardConfig(reward_timeout_s=5000)).stall_after_s == 5000  # the default follows
    with pytest.raises(ValueError, match="below --reward-timeout-s"):  # an explicit value does not
        TrainConfig(rewards=RewardConfig(reward_timeout_s=5000), stall_timeout_s=1800)


# ------------------------------------------------------------------------------------------------ group deadlines

DEADLINE_REWARD = """
import os, threading, time
LOCK, SEEN = threading.Lock(), {{"calls": 0}}

def reward(prompt, completion, answer, hang=False, **_):
    with LOCK:
        SEEN["calls"] += hang
        stuck = hang and SEEN["calls"] == 2  # the hang row's second completion, once: its first one finishes
    if stuck:
        open({marker!r}, "w").close()
        while not os.path.exists({release!r}):  # held until the test releases it
            time.sleep(0.05)
    return float(completion == answer)
"""


def _deadline_run(tmp_path, builtin_model, *extra: str) -> tuple[int, list[dict], list[dict]]:
    """A 2-step run over 8 rows (4 per step, so the hang row is in one of them) with the reward above; a helper
    thread releases the stuck call once the run ended or, failing that, after a bound (the test then fails, not
    hangs). Returns main's status, the step records and the completions log."""
    import threading

    from align.tasks import reverse

    rows = reverse.prompts(8, "train")
    rows[0]["hang"] = True
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    marker, release = tmp_path / "stuck", tmp_path / "release"
    spec = tmp_path / "deadline_reward.py"
    spec.write_text(DEADLINE_REWARD.format(marker=str(marker), release=str(release)))
    out = tmp_path / "run"
    finished = threading.Event()

    def release_later() -> None:
        finished.wait(WAIT_S)
        release.touch()

    threading.Thread(target=release_later, daemon=True).start()
    try:
        rc = main([*cli_args(out, builtin_model), "--train-data", str(data), "--reward", f"{spec}:reward",
                   "--steps", "2", "--prompts-per-step", "4", "--eval-interval", "0", "--reward-timeout-s", "0",
                   *extra])  # fmt: skip
    finally:
        finished.set()
    assert marker.exists()  # the hang happened
    read = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    log = out / "completions.jsonl"  # written only when there is something to log
    logged = [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []
    return rc, [r for r in read if "loss" in r], logged


def test_group_deadline_evicts_the_hung_group_and_refills_its_prompt(tmp_path, builtin_model):
    rc, steps, logged = _deadline_run(tmp_path, builtin_model, "--group-timeout-s", "2")
    assert rc == 0 and len(steps) == 2
    assert sorted(r["rollout/evicted_groups"] for r in steps) == [0, 1]
    hit = next(r for r in steps if r["rollout/evicted_groups"])
    assert hit["unscorable"] == 0  # the refilled prompt's group was scored in full: nothing of the hung one trains
    why = [r["evicted_group"] for r in logged if "evicted_group" in r]
    assert len(why) == 1 and why[0]["prompt"] == 0 and why[0]["policy"] == "refill"
    assert "past --group-timeout-s 2 (1 of 4 completions scored" in why[0]["why"]


def test_group_deadline_mask_trains_the_finished_members(tmp_path, builtin_model):
    rc, steps, logged = _deadline_run(tmp_path, builtin_model, "--group-timeout-s", "2", "--evict-policy", "mask")
    assert rc == 0
    hit = next(r for r in steps if r["rollout/evicted_groups"])
    assert hit["unscorable"] == 3  # the hung group's first completion trains; the other 3 are unscorable
    assert [r["evicted_group"]["policy"] for r in logged if "evicted_group" in r] == ["mask"]


def test_negative_control_without_a_deadline_the_step_waits_for_the_group(tmp_path, builtin_model):
    """No --group-timeout-s: the step waits for the stuck reward until the helper releases it (after the run would
    have ended with a deadline); every completion is scored and nothing is evicted."""
    import threading
    import time

    from helpers_train import POLL_S

    def release_when_stuck() -> None:  # poll for the hang, then let it go
        deadline = time.monotonic() + WAIT_S
        while not (tmp_path / "stuck").exists() and time.monotonic() < deadline:
            time.sleep(POLL_S)
        (tmp_path / "release").touch()

    threading.Thread(target=release_when_stuck, daemon=True).start()
    rc, steps, logged = _deadline_run(tmp_path, builtin_model)
    assert rc == 0 and all("rollout/evicted_groups" not in r and r["unscorable"] == 0 for r in steps)
    assert not [r for r in logged if "evicted_group" in r]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--group-timeout-s", "-1"], "--group-timeout-s -1.0 is invalid: must be a finite number >= 0"),
        (["--group-timeout-s", "nan"], "--group-timeout-s nan is invalid"),
        (["--group-timeout-s", "0.5"], "below the minimum 1.0 s"),
        (["--group-timeout-s", "5", "--reward-workers", "2"], "use --reward-workers 1 with --group-timeout-s"),
        (["--evict-policy", "wait"], "--evict-policy must be one of ('refill', 'mask')"),
    ],
)
def test_bad_group_deadline_is_one_clear_error(tmp_path, capsys, extra, message):
    with pytest.raises(SystemExit) as e:
        main(["--out", str(tmp_path / "never"), *extra])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_the_line_names_the_oldest_call_in_flight_and_forgets_abandoned_ones(tmp_path):
    """``Watchdog.describe`` / ``report`` on live calls of two threads (no run): the oldest call's part is named,
    stall.txt's report lists both with their info and every thread's stack; an abandoned thread's call (an evicted
    group's, ``heartbeat.forget``) no longer counts (negative control: then the next one is named)."""
    import threading

    from align import heartbeat
    from align.run.watchdog import Watchdog

    heartbeat.reset()
    release, entered = threading.Event(), [threading.Event(), threading.Event()]

    def hold(part: str, k: int, **info) -> None:
        with heartbeat.working(part, **info):
            entered[k].set()
            release.wait(WAIT_S)

    threads = [threading.Thread(target=hold, args=("reward", 0), kwargs={"items": 3}, daemon=True)]
    threads.append(threading.Thread(target=hold, args=("sampler", 1), kwargs={"engine": "native"}, daemon=True))
    threads[0].start()
    entered[0].wait(WAIT_S)
    threads[1].start()
    entered[1].wait(WAIT_S)
    try:
        dog = Watchdog(tmp_path, 5.0, {})
        assert "the reward stopped" in dog.describe(6.0) and "items 3" in dog.describe(6.0)
        report = dog.report(dog.describe(6.0))
        assert "calls in flight (2)" in report and "engine native" in report and "in hold" in report
        heartbeat.forget({threads[0].ident})
        assert "the sampler stopped" in dog.describe(6.0)
        heartbeat.forget({threads[1].ident})
        assert "between parts" in dog.describe(6.0)
    finally:
        release.set()
        heartbeat.reset()
