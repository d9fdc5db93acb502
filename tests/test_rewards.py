"""align.rewards: spec loading and its errors, weighted sums, timeouts and errors in-process and in worker
processes (a hung reward never hangs the run), and the built-in verifiable rewards on tricky cases."""

from __future__ import annotations

import math
import textwrap
import threading
import time
from fractions import Fraction

import pytest
from helpers_locks import alive

from align.data import InputError
from align.rewards import (
    RewardConfig,
    RewardScorer,
    boxed_match,
    check_signature,
    exact_match,
    last_number,
    last_number_match,
    load_rewards,
    parse_number,
    think_answer_format,
)

REWARDS_FILE = textwrap.dedent("""
    import time

    def length(prompt, completion, **fields):
        print("noise on stdout must not break the worker protocol")
        return len(completion)

    def slow(prompt, completion, **fields):
        if completion == "hang":
            time.sleep(60)
        return 1.0

    def spin(prompt, completion, **fields):
        if completion == "hang":
            while True:
                pass
        return 1.0

    def broken(prompt, completion, answer=None, **fields):
        if completion == "bad":
            raise ZeroDivisionError("boom")
        return 0.5 if answer is None else None

    def die(prompt, completion, **fields):
        if completion == "die":
            import os
            os._exit(3)
        return 1.0

    def two_args(prompt):
        return 0.0

    NOT_A_FUNCTION = 3
""")


@pytest.fixture
def rfile(tmp_path):
    p = tmp_path / "my_rewards.py"
    p.write_text(REWARDS_FILE)
    return str(p)


def test_spec_errors_are_named(rfile, tmp_path):
    with pytest.raises(InputError, match="expected 'module:function'"):
        load_rewards(["just_a_name"])
    with pytest.raises(InputError, match="no module 'no_such_mod_xyz'"):
        load_rewards(["no_such_mod_xyz:fn"])
    with pytest.raises(InputError, match="no such file"):
        load_rewards([str(tmp_path / "missing.py") + ":fn"])
    with pytest.raises(InputError, match="has no attribute 'nope'"):
        load_rewards([rfile + ":nope"])
    with pytest.raises(InputError, match="NOT_A_FUNCTION is a int, not a function"):
        load_rewards([rfile + ":NOT_A_FUNCTION"])
    (fn,) = load_rewards([rfile + ":two_args"])
    with pytest.raises(InputError, match=r"reward 'two_args' cannot be called as fn\(prompt, completion, \*\*fields\)"):
        check_signature(fn.name, fn.fn, ["answer"])
    (fn,) = load_rewards(["align.rewards:exact_match"])
    check_signature(fn.name, fn.fn, ["answer", "extra"])  # **_ takes any column
    with pytest.raises(ValueError, match="--reward-weights has 1 value"):
        RewardConfig(reward=["a:b", "c:d"], reward_weights=[1.0])
    with pytest.raises(InputError, match="no reward"):
        load_rewards([])
    names = [r.name for r in load_rewards([rfile + ":length", rfile + ":length"])]
    assert names == ["length", "length_2"]


@pytest.mark.parametrize("workers", [1, 2])
def test_weighted_sum_abstain_errors_and_timeouts(rfile, workers):
    rewards = load_rewards([rfile + ":length", rfile + ":broken", rfile + ":slow"])
    scorer = RewardScorer(rewards, weights=[1.0, 2.0, 0.5], workers=workers, timeout_s=1.5)
    try:
        items = [
            ({"prompt": "p"}, "ok"),
            ({"prompt": "p", "answer": "x"}, "abc"),
            ({"prompt": "p"}, "bad"),
            ({"prompt": "p"}, "hang"),
            ({"prompt": "p"}, "after"),
        ]
        t0 = time.monotonic()
        s = scorer.score(items)
        assert time.monotonic() - t0 < 30  # the 60 s sleep was cut off
        assert s.totals[0] == 2 + 2 * 0.5 + 0.5
        assert s.totals[1] == 3 + 0.5  # 'broken' abstained (None): the others' weighted sum
        assert math.isnan(s.totals[2]) and math.isnan(s.totals[3])  # raised / timed out: unscorable
        assert s.totals[4] == 5 + 1 + 0.5  # the pool replaced the killed worker and went on
        assert s.timeouts == 1 and len(s.errors) == 1 and "ZeroDivisionError: boom" in s.errors[0]
        assert s.terms["length"] == [2, 3, 3, 4, 5] and math.isnan(s.terms["slow"][3])
        assert math.isnan(s.terms["broken"][1]) and s.terms["broken"][0] == 0.5
    finally:
        scorer.close()


def test_a_busy_looping_or_dying_reward_in_a_worker(rfile):
    scorer = RewardScorer(load_rewards([rfile + ":spin"]), workers=2, timeout_s=1.0)
    try:
        s = scorer.score([({"prompt": "p"}, "hang"), ({"prompt": "p"}, "x")])
        assert math.isnan(s.totals[0]) and s.totals[1] == 1.0 and s.timeouts == 1
    finally:
        scorer.close()
    scorer = RewardScorer(load_rewards([rfile + ":die"]), workers=2, timeout_s=10.0)
    try:
        s = scorer.score([({"prompt": "p"}, "die"), ({"prompt": "p"}, "x"), ({"prompt": "p"}, "y")])
        assert math.isnan(s.totals[0]) and s.totals[1:] == [1.0, 1.0] and s.failed == 1
        assert "reward worker died (exit code 3)" in s.errors[0]
    finally:
        scorer.close()


def test_pool_needs_loadable_rewards():
    def local(prompt, completion, **_):
        return 1.0

    with pytest.raises(InputError, match="worker processes cannot load them"):
        RewardScorer(load_rewards(fns=local), workers=2)
    scorer = RewardScorer(load_rewards(fns=[exact_match]), workers=2)  # an importable function works
    try:
        assert scorer.score([({"prompt": "p", "answer": "4"}, " 4\n")]).totals == [1.0]
        with pytest.raises(InputError, match="not JSON values"):
            scorer.score([({"prompt": "p", "answer": object()}, "4")])
    finally:
        scorer.close()


@pytest.mark.parametrize(
    "text,want",
    [
        ("42", 42),
        ("-7", -7),
        ("+3", 3),
        ("1,234", 1234),
        ("-1,234,567.5", Fraction(-2469135, 2)),
        ("3/4", Fraction(3, 4)),
        ("-3/4", Fraction(-3, 4)),
        ("0.75", Fraction(3, 4)),
        (".5", Fraction(1, 2)),
        ("\\frac{3}{4}", Fraction(3, 4)),
        ("-\\dfrac{1}{2}", Fraction(-1, 2)),
        ("$42$", 42),
        ("42.", 42),
        ("−5", -5),
        ("1,23", None),
        ("abc", None),
        ("1/0", None),
        ("", None),
        ("4 5", None),
    ],
)
def test_parse_number(text, want):
    assert parse_number(text) == want


def test_last_number_on_tricky_text():
    assert last_number("I have 3 apples and -2,500 debts") == -2500
    assert last_number("so the answer is 3/4.") == Fraction(3, 4)
    assert last_number("the list 1,2,3") == 3  # not a thousands group
    assert last_number("version v2 costs 10.50 dollars") == Fraction(21, 2)
    assert last_number("no numbers here") is None
    assert last_number("x2 and y3") is None  # digits inside words are not numbers


def test_builtin_rewards_tricky_cases():
    assert exact_match("p", "  Paris\n", answer="Paris") == 1.0 and exact_match("p", "paris", answer="Paris") == 0.0
    assert exact_match("p", "x") == 0.0  # no answer column: never a match
    # boxed: the last box wins; nested braces; numeric equality across forms
    assert boxed_match("p", "first \\boxed{1} then \\boxed{\\frac{3}{4}}", answer="0.75") == 1.0
    assert boxed_match("p", "\\boxed{\\frac{3}{4}} then \\boxed{1}", answer="0.75") == 0.0
    assert boxed_match("p", "\\boxed{\\{1, 2\\} \\cup \\{x^{2}\\}}", answer="\\{1,2\\}\\cup\\{x^{2}\\}") == 1.0
    assert boxed_match("p", "\\boxed{1,000}", answer="1000") == 1.0
    assert boxed_match("p", "\\boxed{-5}", answer="5") == 0.0
    assert boxed_match("p", "\\boxed{12", answer="12") == 0.0  # unclosed
    assert boxed_match("p", "the answer is 12", answer="12") == 0.0  # no box
    # last number
    assert last_number_match("p", "so 2 + 2 = 4, total 1,204", answer="1204") == 1.0
    assert last_number_match("p", "it is -3/6", answer="-1/2") == 1.0
    assert last_number_match("p", "it is 3/6", answer="-1/2") == 0.0
    assert last_number_match("p", "answer: 42 (not 41)", answer=42) == 0.0  # the last number is 41
    assert last_number_match("p", "42", answer="forty-two") == 0.0
    # format
    assert think_answer_format("p", "<think>\nhm\n</think>\n\n42") == 1.0
    assert think_answer_format("p", "<think>hm</think>   ") == 0.0  # no answer
    assert think_answer_format("p", "42 <think>hm</think> 42") == 0.0
    assert think_answer_format("p", "<think>a</think>b<think>c</think>d") == 0.0


SPIN_S = 20.0  # how long the spinning reward below runs when nothing cuts it off
THREAD_TIMEOUT_S = 0.5


def _spin_reward(prompt, completion, **_):
    end = time.monotonic() + (SPIN_S if completion == "hang" else 0.0)
    while time.monotonic() < end:  # pure Python: the watchdog's exception lands here
        pass
    return 1.0


def test_in_process_timeout_holds_off_the_main_thread():
    """--reward-workers 1 scoring on another thread (the --max-async-steps producer), where SIGALRM cannot reach."""
    (fn,) = load_rewards(fns=_spin_reward)
    scorer = RewardScorer([fn], workers=1, timeout_s=THREAD_TIMEOUT_S)
    got = {}

    def run():
        t0 = time.monotonic()
        got["s"] = scorer.score([({"prompt": "p"}, "hang"), ({"prompt": "p"}, "x")])
        got["later"] = scorer.score([({"prompt": "p"}, "y")])  # no stray exception after a timeout
        got["dt"] = time.monotonic() - t0

    th = threading.Thread(target=run)
    th.start()
    th.join(SPIN_S * 2)
    s = got["s"]
    assert s.timeouts == 1 and math.isnan(s.totals[0]) and s.totals[1] == 1.0
    assert got["later"].totals == [1.0] and got["later"].timeouts == 0
    assert got["dt"] < SPIN_S / 2  # cut off, not run to its end


def test_in_process_timeouts_off_the_main_thread_start_no_thread_per_call(monkeypatch):
    """The producer's reward calls share one watchdog thread: 40 calls start at most one thread (each call started a
    ``threading.Timer`` before, a GIL hand-off per call on the producer's path), and a hanging call is still cut."""
    (fn,) = load_rewards(fns=_spin_reward)
    scorer = RewardScorer([fn], workers=1, timeout_s=THREAD_TIMEOUT_S)
    started, real = [], threading.Thread.start
    got = {}

    def run():
        monkeypatch.setattr(threading.Thread, "start", lambda th: (started.append(th.name), real(th))[1])
        got["many"] = scorer.score([({"prompt": "p"}, f"x{i}") for i in range(40)])
        got["hang"] = scorer.score([({"prompt": "p"}, "hang"), ({"prompt": "p"}, "y")])

    th = threading.Thread(target=run)
    th.start()
    th.join(SPIN_S * 2)
    assert got["many"].totals == [1.0] * 40 and got["many"].timeouts == 0
    assert got["hang"].timeouts == 1 and math.isnan(got["hang"].totals[0]) and got["hang"].totals[1] == 1.0
    assert len(started) <= 1, started


HARD_FILE = textwrap.dedent("""
    import os, subprocess, sys, time

    def swallow(prompt, completion, **fields):
        if completion != "hang":
            return 1.0
        try:  # short sleeps: off the main thread the timeout lands only between blocking calls; 3 s outlasts the
            for _ in range(30):  # 0.3 s timeout 10x, and caps the test where the timeout lands only once it returns
                time.sleep(0.1)
        except:  # noqa: E722 -- a user's bare except catches the in-process timeout
            pass
        return 0.0

    def spawn(prompt, completion, pidfile=None, **fields):
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        with open(pidfile, "a") as f:
            f.write(f"{child.pid}\\n")
        if completion == "hang":
            time.sleep(60)
        return 1.0

    def fork_exit(prompt, completion, **fields):
        if completion == "exit" and os.fork() == 0:  # the child keeps the worker's pipe open, then the worker exits
            time.sleep(60)
            os._exit(0)
        if completion == "exit":
            os._exit(4)
        return 1.0
""")
CHILD_GONE_S = 10.0  # killed children are reaped well within this


@pytest.fixture
def hard_file(tmp_path):
    p = tmp_path / "hard_rewards.py"
    p.write_text(HARD_FILE)
    return str(p)


@pytest.mark.parametrize("on_thread", [False, True])
def test_a_bare_except_cannot_swallow_the_in_process_timeout(hard_file, on_thread):
    """The reward catches CallTimeout and returns 0.0: still a timeout, unscorable (the old SIGALRM path scored 0.0).
    Control: the same reward that does not hang scores 1.0 and no timeout."""
    scorer = RewardScorer(load_rewards([hard_file + ":swallow"]), workers=1, timeout_s=0.3)
    got = {}

    def run():
        got["s"] = scorer.score([({"prompt": "p"}, "hang"), ({"prompt": "p"}, "x")])

    if on_thread:
        th = threading.Thread(target=run)
        th.start()
        th.join(60)
    else:
        run()
    s = got["s"]
    assert s.timeouts == 1 and math.isnan(s.totals[0]) and s.failed == 1
    assert s.totals[1] == 1.0  # control


def test_a_timed_out_rewards_children_are_killed(hard_file, tmp_path):
    """--reward-workers 2: the worker's process group dies with it, on a timeout and at close (no orphans).
    Control: before close, the child of the call that finished is still alive (so the check can see one)."""
    pidfile = tmp_path / "pids"
    scorer = RewardScorer(load_rewards([hard_file + ":spawn"]), workers=2, timeout_s=1.0)
    try:
        s = scorer.score([({"prompt": "p", "pidfile": str(pidfile)}, "hang")])
        assert s.timeouts == 1
        (hung,) = [int(p) for p in pidfile.read_text().split()]
        s = scorer.score([({"prompt": "p", "pidfile": str(pidfile)}, "x")])
        assert s.totals == [1.0]
        finished = int(pidfile.read_text().split()[-1])
        assert alive(finished)  # control: a live child is seen as alive
        deadline = time.monotonic() + CHILD_GONE_S
        while alive(hung) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(hung), "the timed-out call's child outlived its worker"
    finally:
        scorer.close()
    deadline = time.monotonic() + CHILD_GONE_S
    while alive(finished) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(finished), "a worker's child outlived the pool's close"


def test_a_worker_that_exits_while_its_fork_holds_the_pipe(hard_file):
    """The worker exits but a forked child keeps its stdout open (no EOF): the pool watches the pid and reports the
    call as an error at once, not as a timeout 20 s later. Control: the other rows score 1.0."""
    scorer = RewardScorer(load_rewards([hard_file + ":fork_exit"]), workers=2, timeout_s=20.0)
    try:
        s = scorer.score([({"prompt": "p"}, "exit"), ({"prompt": "p"}, "x"), ({"prompt": "p"}, "y")])
        assert s.timeouts == 0 and s.failed == 1 and math.isnan(s.totals[0]) and s.totals[1:] == [1.0, 1.0]
        assert "exit code 4" in s.errors[0]
    finally:
        scorer.close()
