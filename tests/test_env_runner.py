"""align.envs.runner: episodes in process and in worker processes give the same results; errors, timeouts (a
bare ``except:`` included), crashes and wrong return types are EnvErrors and a replaced worker's other episodes
say so; call_many runs workers in parallel; episodes are sticky; spec errors; a killed worker's children and a
killed trainer's workers do not survive. The environments are in tests/fixtures/envs.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
from helpers_locks import alive

from align.data import InputError
from align.envs import EnvError, Step
from align.envs.runner import EnvRunner, EnvTimeout, load_env_class

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = str(ROOT / "tests" / "fixtures" / "envs.py")
SPEC = FIXTURE + ":Scripted"
CUT_OFF_S = 10.0  # a 30-60 s sleep past a 0.5 s timeout ends well within this, even on a loaded machine
GONE_S = 10.0  # killed processes are reaped well within this


def _wait_gone(pid: int) -> bool:
    deadline = time.monotonic() + GONE_S
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not alive(pid)


def _script(runner: EnvRunner, rows: list[dict]) -> list:
    """A fixed sequence of calls, one by one and through call_many; errors become (type name, key line)."""
    out = []

    def keep(fn, *args):
        try:
            out.append(fn(*args))
        except EnvError as e:
            out.append(
                (
                    type(e).__name__,
                    [ln for ln in str(e).splitlines() if ln.startswith("ZeroDivisionError") or "must" in ln],
                )
            )

    for e, row in enumerate(rows):
        keep(runner.open, e, row)
    for e in range(len(rows)):
        keep(runner.reset, e)
    keep(runner.step, 0, "a")
    keep(runner.step, 0, "raise")  # the episode stays open after an error
    keep(runner.step, 0, "wrong")
    for r in runner.call_many([(e, "step", (f"c{e}",)) for e in range(len(rows))] + [(1, "step", ("raise",))]):
        out.append(r if not isinstance(r, EnvError) else ("EnvError", "ZeroDivisionError: boom" in str(r)))
    keep(runner.step, 2, "x" * 100_000)  # more than a pipe's buffer, both ways
    runner.close_episode(0)
    keep(runner.open, 0, {"name": "again"})
    keep(runner.step, 0, "fresh")
    return out


def test_in_process_and_workers_give_the_same_results():
    """Control: another row changes the results, so the equality can fail."""
    rows = [{"name": "a"}, {"name": "b", "turns": 2}, {"name": "c"}]
    with EnvRunner(SPEC, None, 0, 30.0) as r:
        local = _script(r, rows)
    with EnvRunner(SPEC, None, 2, 30.0) as r:
        remote = _script(r, rows)
    assert remote == local
    assert local[3] == [{"role": "user", "content": "hello a"}]
    assert local[6] == Step("a turn 1: a", 1.0, False, {"tool_calls": 1})
    assert local[7] == ("EnvError", ["ZeroDivisionError: boom"])
    assert local[8][0] == "EnvError" and "step() (row {'name': 'a'}) must return align.envs.Step" in local[8][1][0]
    assert local[9] == Step("a turn 2: c0", 2.0, False, {"tool_calls": 1})  # the counter went on after the errors
    assert local[10] == Step("b turn 1: c1", 1.0, False, {"tool_calls": 1}) and local[12] == ("EnvError", True)
    assert local[-1] == Step("again turn 1: fresh", 1.0, False, {"tool_calls": 1})  # a reopened episode is new
    assert local[13].observation == "c turn 2: " + "x" * 100_000
    with EnvRunner(SPEC, None, 0, 30.0) as r:
        assert _script(r, [{"name": "a"}, {"name": "B"}, {"name": "c"}]) != local


@pytest.mark.parametrize("workers", [0, 1])
def test_the_traceback_and_a_bad_reset_name_the_row(workers):
    with EnvRunner(SPEC, None, workers, 30.0) as r:
        r.open(0, {"name": "a"})
        with pytest.raises(EnvError, match=r"(?s)step\(\) raised \(row \{'name': 'a'\}\).*Traceback.*envs\.py.*"
                                           r"ZeroDivisionError: boom"):  # fmt: skip
            r.step(0, "raise")
        r.open(1, {"bad_reset": True})
        with pytest.raises(EnvError, match=r"reset\(\) \(row \{'bad_reset': True\}\) must be a str"):
            r.reset(1)
        with pytest.raises(EnvError, match="unexpected keyword argument 'nope'"):
            r.open(2, {"nope": 1})
        with pytest.raises(ValueError, match="episode 2 is not open"):  # a failed open leaves nothing behind
            r.step(2, "x")


@pytest.mark.parametrize("workers", [0, 1])
def test_a_step_past_the_timeout(workers):
    """The 30 s sleep is cut off; in process the other episode goes on, with a worker it is lost with the killed
    worker, and a new episode works on the replacement."""
    with EnvRunner(SPEC, None, workers, 0.5) as r:
        r.open(0, {"name": "a"})
        r.open(1, {"name": "b"})
        r.step(1, "x")
        t0 = time.monotonic()
        with pytest.raises(EnvTimeout, match=r"timed out after --env-timeout-s 0\.5 s"):
            r.step(0, "sleep:30")
        assert time.monotonic() - t0 < CUT_OFF_S
        if workers:
            with pytest.raises(
                EnvError, match="episode 1: the worker was replaced .*step\\(\\) of episode 0 timed out"
            ):
                r.step(1, "y")
        else:
            assert r.step(1, "y").observation == "b turn 2: y"
        r.open(2, {"name": "new"})
        assert r.step(2, "z") == Step("new turn 1: z", 1.0, False, {"tool_calls": 1})


@pytest.mark.parametrize("mode", ["main thread", "other thread", "worker"])
def test_a_bare_except_cannot_swallow_the_timeout(mode):
    """The step busy-loops inside ``try: ... except: pass`` and then returns a Step: still a timeout.
    Control: the same episode's normal step before it returns its Step."""
    with EnvRunner(SPEC, None, 1 if mode == "worker" else 0, 0.5) as r:
        r.open(0, {"name": "a"})
        got = {}

        def run():
            got["first"] = r.step(0, "x")
            try:
                got["second"] = r.step(0, "swallow")
            except EnvError as e:
                got["second"] = e

        if mode == "other thread":
            th = threading.Thread(target=run)
            th.start()
            th.join(CUT_OFF_S)
        else:
            run()
        assert got["first"].observation == "a turn 1: x"
        assert isinstance(got["second"], EnvTimeout), got["second"]


@pytest.mark.parametrize("how", ["exit", "fork_exit"])
def test_a_worker_that_dies_is_an_error_and_is_replaced(how):
    """``os._exit`` in a step (and one whose fork keeps the pipe open: noticed by the pid, not a 20 s timeout)."""
    with EnvRunner(SPEC, None, 1, 20.0) as r:
        r.open(0, {"name": "a"})
        r.open(1, {"name": "b"})
        t0 = time.monotonic()
        with pytest.raises(EnvError, match=f"exited \\(exit code {3 if how == 'exit' else 4}\\) during step") as e:
            r.step(0, how)
        assert not isinstance(e.value, EnvTimeout) and time.monotonic() - t0 < CUT_OFF_S
        with pytest.raises(EnvError, match="the worker was replaced"):
            r.reset(1)
        r.open(2, {"name": "new"})
        assert r.step(2, "z").observation == "new turn 1: z"


def test_call_many_runs_two_workers_in_parallel():
    """Two episodes on two workers each sleep SLEEP_S: together they take about SLEEP_S, one after the other 2x."""
    SLEEP_S = 1.0
    with EnvRunner(SPEC, None, 2, 30.0) as r:
        for e in range(2):
            r.open(e, {"name": str(e)})
            r.reset(e)  # both workers started and loaded: the timing below is the steps only
        t0 = time.monotonic()
        out = r.call_many([(e, "step", (f"sleep:{SLEEP_S}",)) for e in range(2)])
        wall = time.monotonic() - t0
        assert [s.observation for s in out] == [f"0 turn 1: sleep:{SLEEP_S}", f"1 turn 1: sleep:{SLEEP_S}"]
        assert wall < 1.6 * SLEEP_S, f"{wall:.2f} s for two {SLEEP_S} s steps: not in parallel"
        pids = [s.observation for s in r.call_many([(e, "step", ("pid",)) for e in range(2)])]
        assert len(set(pids)) == 2


class Meet:
    """step() waits at a barrier shared by every instance: it passes only when two steps are inside at once."""

    concurrent = True  # instances may be called from several threads: EnvRunner serialises only each episode's calls
    barrier: threading.Barrier

    def __init__(self, **_):
        pass

    def reset(self) -> str:
        return "p"

    def step(self, completion: str) -> Step:
        try:
            Meet.barrier.wait()
        except threading.BrokenBarrierError:
            return Step("alone", 0.0, True)
        return Step("met", 0.0, True)


MEET_WAIT_S = 2.0  # how long a step waits for a second one (the serialised case waits it out once)


class MeetSerial(Meet):
    concurrent = False  # the default: every in-process call under one lock


@pytest.mark.parametrize(
    ("cls", "episodes", "expected"),
    [(Meet, (0, 1), ["met", "met"]), (Meet, (0, 0), ["alone", "alone"]), (MeetSerial, (0, 1), ["alone", "alone"])],
)
def test_a_concurrent_class_steps_different_episodes_at_once_and_one_episode_never(cls, episodes, expected):
    """Two threads step in process: a ``concurrent`` class's two episodes are inside at once (the spool path's
    episode threads wait in parallel); one episode's two steps are serialised by its own lock, and a class that is
    not ``concurrent`` has every call serialised (negative controls: the barrier breaks)."""
    Meet.barrier = threading.Barrier(2, timeout=MEET_WAIT_S)
    with EnvRunner(None, cls, 0, 0.0) as r:
        for e in set(episodes):
            r.open(e, {})
        out: list[str] = []
        threads = [threading.Thread(target=lambda e=e: out.append(r.step(e, "x").observation)) for e in episodes]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=10 * MEET_WAIT_S)
        assert sorted(out) == expected


def test_episodes_are_sticky_to_their_worker():
    """4 episodes on 2 workers, 3 interleaved turns: each counter advances on its own, always in the same worker."""
    with EnvRunner(SPEC, None, 2, 30.0) as r:
        r.call_many([(e, "open", ({"name": f"e{e}", "turns": 3},)) for e in range(4)])
        for turn in range(1, 4):
            order = [3, 1, 0, 2] if turn % 2 else [0, 2, 1, 3]
            out = r.call_many([(e, "step", (f"t{turn}",)) for e in order])
            assert [s.observation for s in out] == [f"e{e} turn {turn}: t{turn}" for e in order]
            assert [s.done for s in out] == [turn == 3] * 4
        pids = [s.observation for s in r.call_many([(e, "step", ("pid",)) for e in range(4)] * 2)]
        assert pids[:4] == pids[4:]  # the same worker each time
        assert sorted(Counter(pids[:4]).values()) == [2, 2]  # the least loaded worker got each open


def test_load_env_class_errors(tmp_path):
    assert load_env_class(SPEC).__name__ == "Scripted"
    cases = [
        ("just_a_name", "--env 'just_a_name': expected 'module:Class' or 'path/to/file.py:Class'"),
        (":Scripted", "expected 'module:Class'"),
        (FIXTURE + ":", "expected 'module:Class'"),
        ("no_such_mod_xyz:Env", "no module 'no_such_mod_xyz'.*--env path/to/file.py:Class"),
        (str(tmp_path / "missing.py") + ":Env", "no such file"),
        (FIXTURE + ":Nope", "has no attribute 'Nope'"),
        (FIXTURE + ":NOT_A_CLASS", "NOT_A_CLASS is a int, not a Class"),
        (FIXTURE + ":not_a_class", "--env: <function not_a_class .* is a function, not a class"),
        (FIXTURE + ":NoStep", r"class NoStep has no step\(\) method"),
    ]
    for spec, want in cases:
        with pytest.raises(InputError, match=want):
            load_env_class(spec)
    with pytest.raises(InputError, match="^--my-env 'x': expected"):
        load_env_class("x", flag="--my-env")


def test_workers_need_json_rows_and_a_loadable_class():
    """Control: the same row and the same local class run in process."""
    with EnvRunner(SPEC, None, 1, 30.0) as r:
        with pytest.raises(InputError, match="--env-workers 1 sends each data row .* not JSON .* --env-workers 0"):
            r.open(0, {"name": object()})
        with pytest.raises(InputError, match="--env-workers 1"):
            r.call_many([(1, "open", ({"name": "ok"},)), (2, "open", ({"name": {1, 2}},))])
    with EnvRunner(SPEC, None, 0, 30.0) as r:
        r.open(0, {"name": object()})

    class Local:
        def __init__(self, **row):
            pass

        def reset(self):
            return "hi"

        def step(self, completion):
            return Step(None, 1.0, True)

    with pytest.raises(InputError, match="Local is defined in __main__ or inside a function.*--env-workers 0"):
        EnvRunner(None, Local, 2, 30.0)
    with EnvRunner(None, Local, 0, 30.0) as r:
        r.open(0, {})
        assert r.reset(0) == "hi"
    with EnvRunner(None, load_env_class(SPEC), 1, 30.0) as r:  # an importable class: the workers load it by its path
        r.open(0, {"name": "x"})
        assert r.step(0, "y").observation == "x turn 1: y"


def test_a_timed_out_workers_children_are_killed(tmp_path):
    """The worker's process group dies with it, on a timeout and at close. Control: the child of a step that
    finished is still alive before close (so the check can see a live one)."""
    pidfile = tmp_path / "pids"
    with EnvRunner(SPEC, None, 1, 1.0) as r:
        r.open(0, {"pidfile": str(pidfile)})
        with pytest.raises(EnvTimeout):
            r.step(0, "spawn_hang")
        hung = int(pidfile.read_text().split()[0])
        r.open(1, {"pidfile": str(pidfile)})
        r.step(1, "spawn")
        finished = int(pidfile.read_text().split()[-2])
        assert alive(finished)
        assert _wait_gone(hung), "the timed-out step's child outlived its worker"
    assert _wait_gone(finished), "a worker's child outlived close()"


def test_a_killed_trainer_takes_its_hung_worker_with_it(tmp_path):
    """kill -9 of the process that owns the runner, while its worker is stuck in a step: the worker and the
    child it started exit by themselves (they watch their parent)."""
    pidfile = tmp_path / "pids"
    driver = textwrap.dedent(f"""
        from align.envs.runner import EnvRunner
        r = EnvRunner({SPEC!r}, None, 1, 0)
        r.open(0, {{"pidfile": {str(pidfile)!r}}})
        r.step(0, "spawn_hang")
    """)
    proc = subprocess.Popen([sys.executable, "-c", driver], env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        deadline = time.monotonic() + 60
        while not (pidfile.exists() and pidfile.read_text().endswith("\n")) and time.monotonic() < deadline:
            time.sleep(0.05)
        child, worker = map(int, pidfile.read_text().split())
        assert alive(worker) and alive(child)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert _wait_gone(worker), "the worker outlived its killed trainer"
    assert _wait_gone(child), "the worker's child outlived the killed trainer"
