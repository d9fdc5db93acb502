"""Signals always land: SIGTERM during setup exits 143 at once (nothing trained, nothing saved); with a reward stuck
in a sleep (--max-async-steps 1, or the default K = 0 with --reward-workers 1 or 2), SIGTERM checkpoints the last
trained step and exits 143."""

from __future__ import annotations

import json
import signal
import subprocess
import textwrap
from pathlib import Path

import pytest
import torch
from helpers_train import run_cli, train_steps, wait_for, wait_for_steps

EXIT_S = 60.0  # a signalled run exits well within this (the old code: never, or only after the first step)

HANG_PY = textwrap.dedent("""
    import os, time

    def hang_when_flagged(prompt, completion, flag="", **fields):
        if os.path.exists(flag):
            open(flag + ".asleep", "w").close()  # the test signals once a call is in the sleep
            time.sleep(600)  # a sleep: the in-process watchdog cannot cut it off on the producer thread
        return float(completion.startswith("a"))
""")


def _exit_after_sigterm(proc) -> str:
    """SIGTERM, then the run's output once it exits (killed, and an AssertionError, if it outlives ``EXIT_S``)."""
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.communicate(timeout=EXIT_S)[0]
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"still running {EXIT_S} s after SIGTERM:\n{proc.communicate()[0][-3000:]}") from None


def test_sigterm_during_the_warm_start_exits_143_at_once(tmp_path):
    """No --model: the built-in task warm-starts its model; SIGTERM during it exits 143 before any step is trained
    (the old code trained and checkpointed step 1 first). Control: the warm start was under way (its log line)."""
    out = tmp_path / "run"
    proc = run_cli(["--out", str(out), "--steps", "4", "--warm-start-steps", "100000"])
    seen = []
    for line in proc.stdout:  # bounded: the run prints the warm-start line within seconds, or exits
        seen.append(line)
        if "warm start" in line:
            break
    assert any("warm start" in s for s in seen), "".join(seen)[-3000:]  # control: setup was running
    log = _exit_after_sigterm(proc)
    assert proc.returncode == 143, log[-3000:]
    assert train_steps(out) == 0 and not (out / "checkpoints").exists(), log[-3000:]


def _hang_run(tmp_path: Path, builtin_model: str, *extra: str) -> tuple[Path, Path, subprocess.Popen]:
    """A run whose reward sleeps for 600 s once ``flag`` exists: (out, flag, the process)."""
    flag = tmp_path / "hang"
    rows = [{"prompt": w + "=", "answer": w[::-1], "flag": str(flag)} for w in ("ab", "cd", "bca", "dd", "abc", "ha")]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    rewards = tmp_path / "rewards.py"
    rewards.write_text(HANG_PY)
    out = tmp_path / "run"
    args = ["--out", str(out), "--model", builtin_model, "--train-data", str(data), "--reward",
            f"{rewards}:hang_when_flagged", "--steps", "50", "--prompts-per-step", "2", "--group-size", "2",
            "--max-tokens", "4", "--checkpoint-every", "0", "--eval-interval", "0", *extra]  # fmt: skip
    return out, flag, run_cli(args)


@pytest.mark.parametrize("workers", [1, 2])
def test_sigterm_with_a_reward_stuck_in_a_sleep_at_k0(tmp_path, builtin_model, workers):
    """K = 0 (the default): SIGTERM while a reward sleeps ends the scoring at once, checkpoints the last trained step
    and exits 143 (the old code waited the whole --reward-timeout-s, in-process and in the pool alike). The step
    being scored is dropped: the checkpoint's data cursor is the one after the trained steps' prompts, so the resumed
    run redraws it. Control: steps were trained before the reward hung."""
    out, flag, proc = _hang_run(tmp_path, builtin_model, "--reward-workers", str(workers), "--reward-timeout-s", "300")
    wait_for_steps(out, 2, proc)  # control: training ran
    flag.touch()
    wait_for(lambda: Path(f"{flag}.asleep").exists(), proc)  # a reward call is in its sleep now
    log = _exit_after_sigterm(proc)
    assert proc.returncode == 143, log[-3000:]
    steps = sorted(int(p.name.split("_")[1]) for p in (out / "checkpoints").iterdir())
    n = train_steps(out)
    assert steps == [n] and n >= 2, (steps, log[-3000:])
    cursor = torch.load(out / "checkpoints" / f"step_{n}" / "trainer_state.pt", weights_only=True)["cursor"]
    assert cursor["epoch"] * 6 + cursor["index"] == 2 * n, cursor  # 6 rows, 2 prompts per trained step


def test_sigterm_with_a_reward_stuck_on_the_producer(tmp_path, builtin_model):
    """--max-async-steps 1, in-process rewards: once the reward sleeps, SIGTERM still ends the run with 143 and a
    checkpoint of the last trained step (the old code hung: the trainer waited on the producer forever). Control:
    steps were trained before the reward hung."""
    out, flag, proc = _hang_run(tmp_path, builtin_model, "--reward-timeout-s", "1", "--max-async-steps", "1")
    wait_for_steps(out, 2, proc)  # control: training ran
    flag.touch()
    n = train_steps(out)
    log = _exit_after_sigterm(proc)
    assert proc.returncode == 143, log[-3000:]
    steps = sorted(int(p.name.split("_")[1]) for p in (out / "checkpoints").iterdir())
    assert steps and steps[-1] == train_steps(out) >= n, (steps, log[-3000:])
