"""The spool's share of issue 39's deadlines and watchdog, with the real vLLM worker (CPU build, .venv-rollout):

- a group whose generation request is not answered within ``--group-timeout-s`` is evicted and refilled, and the
  worker's late answer is taken and dropped (the run trains on without it);
- a worker stopped for good (SIGSTOP: its process, heartbeat thread included, frozen) ends the run with ``stall.txt``
  naming the worker and exit status 3, within a bounded wait.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest
from helpers_models import require_rollout_venv
from helpers_train import POLL_S, run_cli, spool_cfg, wait_for_steps

from align.tasks import reverse
from align.train import train

pytestmark = [pytest.mark.rollout, pytest.mark.slow]

WAIT_S = 600.0  # bound on a run here: the worker starts vLLM on shared cores
DEADLINE_S = 30.0  # a warm engine's step took ~1.6 s here with other jobs running (the first answer: 60 s)


def test_an_unanswered_group_request_is_evicted_and_its_late_answer_dropped(tmp_path, reverse_model, monkeypatch):
    """The hang row's request is held back in the client (submitted only once the eviction is logged: the worker
    never sees it before the deadline, a request the trainer cannot tell from a stuck one) and then answered by the
    worker: that answer goes to the abandoned thread, which drops it; the refilled prompt's group trained in full."""
    require_rollout_venv()
    from align.rollout.client import SpoolClient

    tok = reverse.tokenizer()
    rows = reverse.prompts(8, "train")
    hang_ids = tok.encode(rows[0]["prompt"])
    out = tmp_path / "run"
    release, late_answer, held, calls = threading.Event(), threading.Event(), [], []
    real = SpoolClient.generate

    def generate(self, prompts, params, **kw):
        calls.append(1)
        # the hang row's first request after step 1's four (the engine warmed up), once
        if prompts == [hang_ids] and len(calls) > 4 and not held:
            held.append(1)
            release.wait(WAIT_S)
            got = real(self, prompts, params, **kw)
            late_answer.set()
            return got
        return real(self, prompts, params, **kw)

    def release_after_eviction() -> None:  # poll the run's log for the evicted step (bounded), then let it go
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline and not release.is_set():
            path = out / "metrics.jsonl"
            recs = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
            if any(r.get("rollout/evicted_groups") for r in recs):
                break
            time.sleep(POLL_S)
        release.set()

    monkeypatch.setattr(SpoolClient, "generate", generate)
    threading.Thread(target=release_after_eviction, daemon=True).start()
    try:
        cfg = spool_cfg(out, steps=4, group_timeout_s=DEADLINE_S)
        cfg.eval.eval_interval = 100  # the step-0 eval warms the engine up (its first answer took 60 s here)
        summary = train(
            cfg,
            model=str(reverse_model),
            tokenizer=tok,
            prompts=rows,
            eval_prompts=reverse.prompts(4, "eval"),
            reward=lambda prompt, completion, **_: completion.count("a") / 6,
        )
    finally:
        release.set()
    assert summary["steps"] == 4 and held
    steps = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in steps if "loss" in r]
    evicted = [r["rollout/evicted_groups"] for r in steps]
    assert sum(evicted) >= 1, evicted
    assert all(r["unscorable"] == 0 for r in steps)  # each evicted prompt refilled: every group trained in full
    logged = [json.loads(x) for x in (out / "completions.jsonl").read_text().splitlines()]
    why = [r["evicted_group"] for r in logged if "evicted_group" in r]
    assert len(why) == sum(evicted) and [w["prompt"] for w in why].count(0) == 1, why  # the held one, once
    # under load another group may pass the deadline too: every eviction is generation's, none silent
    assert all(w["why"].startswith(f"generation past --group-timeout-s {DEADLINE_S:g}") for w in why), why
    assert late_answer.wait(60.0)  # the worker answered the held request after all: the abandoned thread took it


def test_a_stopped_worker_ends_the_run_with_stall_txt_naming_it(tmp_path, builtin_model):
    """SIGSTOP of the vLLM worker after step 1 of a CLI run (``--rollout spool``): its heartbeat goes stale, the
    client raises, and the run writes stall.txt (the worker's heartbeat, the calls in flight, every stack), prints one
    line naming the rollout worker and exits 3. Control: before the stop the run was training (steps logged)."""
    require_rollout_venv()
    from align.rollout.spool import Spool

    out = tmp_path / "run"
    args = ["--out", str(out), "--model", builtin_model, "--steps", "500", "--prompts-per-step", "4", "--group-size",
            "4", "--max-tokens", "6", "--eval-interval", "0", "--rollout", "spool", "--rollout-in-process",
            "--rollout-timeout-s", "120", "--stall-timeout-s", "120"]  # fmt: skip
    proc = run_cli(args)
    pid = None
    try:
        wait_for_steps(out, 1, proc, timeout=WAIT_S)
        pid = Spool(out / "spool").read_heartbeat()["pid"]
        os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        log = proc.communicate(timeout=WAIT_S)[0]
        took = time.monotonic() - t0
    finally:
        if pid is not None:  # the stopped worker cannot act on its parent's exit: end it here
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 3, log[-3000:]
    lines = [x for x in log.splitlines() if x.startswith("align.train: error:")]
    assert len(lines) == 1 and lines[0].startswith("align.train: error: stalled: the rollout worker stopped"), lines
    assert f"worker (pid {pid} on" in lines[0] and "stopped heart-beating" in lines[0], lines  # not a timeout
    assert took < 120.0, took  # the heartbeat's 30 s, then the run's close (the stopped worker's shutdown grace)
    stall = (out / "stall.txt").read_text()
    assert "rollout worker heartbeat" in stall and f"'pid': {pid}" in stall and "thread MainThread" in stall
