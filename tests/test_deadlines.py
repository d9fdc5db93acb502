"""Group deadlines (``--group-timeout-s``, ``align.rollout.deadlines``) for environment steps and, on the spool, for
generation: real CLI runs of the built-in task where one row's group hangs (an environment step that blocks, a vLLM
worker request that is never answered) and the step goes on without it, evicting it (refill or mask), counting it in
``rollout/evicted_groups`` and naming why in completions.jsonl. The hangs are real and released by a helper only after
the run ended (or after a bound, so a failure fails instead of hanging); the negative control is the same run without
a deadline, which waits for the hung group. The rewards' deadline is tests/test_watchdog.py's."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
from helpers_train import POLL_S, cli_args

from align.train import main

WAIT_S = 240.0  # bound on a whole run here (warm start excluded: the fixture's model is saved)
FIXTURES = Path(__file__).parent / "fixtures"

HANG_ENV = """
import os, sys, threading, time
sys.path.insert(0, {fixtures!r})
from turn_envs import Feedback

class HangEnv(Feedback):
    concurrent = {concurrent!r}  # True: each episode's calls on their own thread (the hung one holds up only itself)

    def __init__(self, prompt, answer, hang=False, **_):
        super().__init__(prompt, answer)
        self.hang = hang

    def step(self, completion):
        if self.hang:  # every episode of the hang row's group, at its first step
            open({marker!r}, "a").close()
            if {hard!r}:
                threading.Event().wait()  # nothing but a kill of its process ends it
            while not os.path.exists({release!r}):  # held until the test releases it
                time.sleep(0.05)
        return super().step(completion)
"""


def _rows(tmp_path: Path) -> str:
    from align.tasks import reverse

    rows = reverse.prompts(8, "train")
    rows[0]["hang"] = True
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(data)


def _released_run(tmp_path: Path, args: list[str], release_when_stuck: bool = False) -> int:
    """``main(args)`` with a helper that touches ``release`` once the run ended (or, ``release_when_stuck``, as
    soon as the hang happened: the negative control), in any case after ``WAIT_S``."""
    import time

    marker, release, finished = tmp_path / "stuck", tmp_path / "release", threading.Event()

    def release_later() -> None:
        deadline = time.monotonic() + WAIT_S
        while not finished.is_set() and time.monotonic() < deadline:
            if release_when_stuck and marker.exists():
                break
            finished.wait(POLL_S)
        release.touch()

    threading.Thread(target=release_later, daemon=True).start()
    try:
        return main(args)
    finally:
        finished.set()


def _logs(out: Path) -> tuple[list[dict], list[dict]]:
    read = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    log = out / "completions.jsonl"
    logged = [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []
    return [r for r in read if "loss" in r], [r["evicted_group"] for r in logged if "evicted_group" in r]


def _env_run(tmp_path, model, *extra: str, concurrent: bool = True, hard: bool = False, stuck_release=False):
    spec = tmp_path / "hang_env.py"
    marker, release = tmp_path / "stuck", tmp_path / "release"
    spec.write_text(
        HANG_ENV.format(
            fixtures=str(FIXTURES), concurrent=concurrent, hard=hard, marker=str(marker), release=str(release)
        )
    )
    out = tmp_path / "run"
    args = [*cli_args(out, model), "--train-data", _rows(tmp_path), "--env", f"{spec}:HangEnv", "--max-turns", "2",
            "--steps", "2", "--prompts-per-step", "4", "--eval-interval", "0", "--env-timeout-s", "0",
            *extra]  # fmt: skip
    rc = _released_run(tmp_path, args, stuck_release)
    assert marker.exists()  # the hang happened
    return (rc, *_logs(out))


def test_a_hung_environment_step_evicts_its_group_and_refills_the_prompt(tmp_path, builtin_model):
    """In process (a concurrent class): the hung steps are cut at the deadline, the other groups' episodes ran on."""
    rc, steps, why = _env_run(tmp_path, builtin_model, "--group-timeout-s", "3")
    assert rc == 0 and len(steps) == 2
    assert sorted(r["rollout/evicted_groups"] for r in steps) == [0, 1]
    hit = next(r for r in steps if r["rollout/evicted_groups"])
    assert hit["unscorable"] == 0 and hit["env/errors"] == 0  # the refilled prompt's group trained in full
    assert len(why) == 1 and why[0]["prompt"] == 0 and why[0]["policy"] == "refill"
    assert why[0]["why"].startswith("environment episodes past --group-timeout-s 3 (4 episode(s)): step() of episode")


def test_mask_trains_the_finished_members_and_nothing_of_the_hung_ones(tmp_path, builtin_model):
    rc, steps, why = _env_run(tmp_path, builtin_model, "--group-timeout-s", "3", "--evict-policy", "mask")
    assert rc == 0
    hit = next(r for r in steps if r["rollout/evicted_groups"])
    assert hit["unscorable"] == 4 and hit["env/errors"] == 0  # the hung group's 4 episodes: evicted, not errors
    assert [w["policy"] for w in why] == ["mask"]


def test_negative_control_without_a_deadline_the_step_waits_for_the_environment(tmp_path, builtin_model):
    rc, steps, why = _env_run(tmp_path, builtin_model, stuck_release=True)
    assert rc == 0 and all("rollout/evicted_groups" not in r and r["unscorable"] == 0 for r in steps) and not why


BLOCKS = """
import threading
from align.envs import Step

class Blocks:
    def __init__(self, block=False):
        self.block = block

    def reset(self):
        return "hi"

    def step(self, completion):
        if self.block:
            threading.Event().wait()  # nothing but a kill of its process ends it
        return Step(None, 1.0, True)
"""


def _blocks(tmp_path: Path) -> str:
    (tmp_path / "blocks.py").write_text(BLOCKS)
    return f"{tmp_path / 'blocks.py'}:Blocks"


def test_a_hard_hang_in_an_environment_worker_is_killed_at_the_deadline(tmp_path):
    """``EnvRunner`` with a worker process, a step blocked for good: at the deadline the call is cut (its worker
    killed with its process group and replaced), the episode is evicted, and a fresh episode is served."""
    import time

    from align.envs.runner import EnvEvicted, EnvRunner

    with EnvRunner(_blocks(tmp_path), None, 1, 0.0) as envs:
        envs.call_many([(0, "open", ({"block": True},))])
        hung = envs._pool[0].proc
        t0 = time.monotonic()
        got = envs.call_many([(0, "step", ("x",))], t0 + 2.0)
        assert isinstance(got[0], EnvEvicted) and "its worker was killed and replaced" in str(got[0])
        assert time.monotonic() - t0 < 30.0 and hung.poll() is not None  # killed, not waited for
        envs.open(1, {})
        assert envs.step(1, "x").done  # the replacement worker serves


def test_an_abandoned_call_holding_the_environment_evicts_later_calls_instead_of_waiting(tmp_path):
    """``EnvRunner`` in process, a class that is not concurrent (its calls serialised by one lock): a step blocked
    past the deadline (off the main thread nothing can interrupt ``Event.wait``) is abandoned holding that lock; a later
    call with a deadline gives up at it (``EnvEvicted``) rather than waiting forever, closing episodes never waits on
    it; once the blocked call returns the lock is free again (control)."""
    import time

    from align.envs.runner import EnvEvicted, EnvRunner, load_env_class

    cls = load_env_class(_blocks(tmp_path))
    release = threading.Event()
    real = cls.step

    def step(self, completion):  # blocked until released (the test's own bound), then the class's answer
        if self.block:
            release.wait(WAIT_S)
            self.block = False
        return real(self, completion)

    cls.step = step
    try:
        with EnvRunner(None, cls, 0, 0.0) as envs:
            envs.call_many([(0, "open", ({"block": True},)), (1, "open", ({},))])
            t0 = time.monotonic()
            got = envs.call_many([(0, "step", ("x",))], t0 + 1.0)
            assert isinstance(got[0], EnvEvicted) and time.monotonic() - t0 < 10.0
            t1 = time.monotonic()
            with pytest.raises(EnvEvicted, match="waiting for the environment"):
                envs.step(1, "x", t1 + 1.0)
            assert 0.9 < time.monotonic() - t1 < 10.0
            envs.close_episode(0)  # never waits on the abandoned call's lock
            release.set()
            assert envs.step(1, "x").done  # the abandoned call returned: the lock is free again
    finally:
        release.set()


def test_a_spool_group_deadline_under_torchrun_is_one_clear_error(tmp_path, capsys, monkeypatch):
    """Refused before anything loads (each rank would gather from several threads); control: one process is fine."""
    from align.train import TrainConfig

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as e:
        main(["--out", str(tmp_path / "never"), "--group-timeout-s", "5", "--rollout", "spool"])
    assert e.value.code == 2 and "under torchrun is not supported yet" in capsys.readouterr().err
    assert not (tmp_path / "never").exists()
    TrainConfig(group_timeout_s=5, rollout="native")  # the native sampler: its generation is the watchdog's
    monkeypatch.setenv("WORLD_SIZE", "1")
    TrainConfig(group_timeout_s=5, rollout="spool")


def test_on_a_thread_per_episode_client_a_turn_not_back_is_evicted_and_the_rest_finish():
    """``EpisodeRunner`` with a client it drives one thread per episode (as a spool worker: here the real native
    sampler behind a plain wrapper), the first row's turns held back: at the deadline its episodes are evicted
    ("not back") while the other row's episodes finished; once released, the abandoned threads' answers are dropped
    (the evicted episodes stay as evicted, no turn added). Control: without a deadline every episode finishes."""
    import sys
    import time

    from helpers_learner import PARAMS, rev_model

    from align.chat import TurnRenderer
    from align.envs.config import EnvConfig
    from align.envs.episodes import EpisodeRunner
    from align.envs.runner import EnvRunner
    from align.rollout.client import NativeClient
    from align.tasks import reverse

    sys.path.insert(0, str(FIXTURES))
    from turn_envs import Feedback

    tok = reverse.tokenizer()
    native, lock, release = NativeClient(rev_model()), threading.Lock(), threading.Event()
    rows = [{"prompt": "hhh=", "answer": "hhh"}, {"prompt": "abc=", "answer": "cba"}]

    class ThreadClient:
        weights_version = 0

        def generate(self, prompts, params):
            if prompts[0][: len(held)] == held:
                release.wait(WAIT_S)
            with lock:  # one decode at a time on the one model
                return native.generate(prompts, params)

    def runner() -> tuple[EpisodeRunner, EnvRunner]:
        envs = EnvRunner(None, Feedback, 0, 0.0)
        decode = lambda ids: tok.decode(ids[:-1] if ids and ids[-1] == tok.eos_token_id else ids)
        return EpisodeRunner(envs, TurnRenderer(tok), decode, EnvConfig(max_turns=2), max_tokens=8, context=32), envs

    run, envs = runner()
    held = run.renderer.first("hhh=")
    try:
        with envs:
            t0 = time.monotonic()
            eps = run.run(ThreadClient(), rows, 2, PARAMS, timeout_s=3.0)
            assert time.monotonic() - t0 < 30.0
        late = [e for e in eps if e.prompt_index == 0]
        assert all(e.evicted and "(not back)" in e.evicted and not e.turns for e in late), [e.evicted for e in late]
        assert all(e.error is None and e.turns for e in eps if e.prompt_index == 1)
        release.set()
        deadline = time.monotonic() + WAIT_S  # the abandoned threads get their answers, and drop them
        while any(t.name.startswith("align-episode-") for t in threading.enumerate()) and time.monotonic() < deadline:
            time.sleep(POLL_S)
        assert all(e.evicted and not e.turns and not e.token_ids for e in late)
        run, envs = runner()  # control: no deadline, nothing held
        with envs:
            assert all(e.error is None and e.turns for e in run.run(ThreadClient(), rows, 2, PARAMS))
    finally:
        release.set()
