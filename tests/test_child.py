"""align.child: the one child-process helper (reward pool, environment workers, python tool, Lean REPL) against
real child processes: framed JSON both ways, a deadline, a cap read in linear time, the whole group killed."""

from __future__ import annotations

import math
import sys
import time

import pytest
from helpers_locks import alive

from align.child import Child, ChildError

FAST_S = 5.0  # a 20 MB message is refused within this (a buffer searched again after every read took 17 s)
ECHO = "import sys\nfor line in sys.stdin:\n    sys.stdout.write(line)\n    sys.stdout.flush()"


def child(code: str, **kw) -> Child:
    return Child([sys.executable, "-c", code], **{"max_bytes": 16 << 20, **kw})


@pytest.mark.parametrize("framing", ["line", "block"])
def test_messages_round_trip_in_order(framing):
    code = (
        ECHO
        if framing == "line"
        else "import sys\nfor line in sys.stdin:\n    sys.stdout.write(line); sys.stdout.flush()"
    )
    c = child(code, framing=framing)
    try:
        for i in range(3):
            c.send({"i": i, "text": "a\nb"})  # a newline inside a string is escaped by JSON
        assert [c.read(time.monotonic() + 10) for _ in range(3)] == [{"i": i, "text": "a\nb"} for i in range(3)]
        assert not c.pending()
    finally:
        c.close()
    assert c.proc.returncode is not None


def test_a_20mb_message_is_refused_fast_and_a_small_one_read():
    big = "import sys\nsys.stdout.write('[' + '1,' * (10 * 10**6) + '1]\\n'); sys.stdout.flush()\nimport time; time.sleep(60)"
    c = child(big)
    try:
        t0 = time.monotonic()
        with pytest.raises(ChildError, match=r"more than 16777216 bytes") as e:
            c.read(time.monotonic() + 30)
        assert e.value.kind == "too_big" and time.monotonic() - t0 < FAST_S
        assert len(c.buf) <= (16 << 20) + (1 << 16)  # read no further than the cap (and one chunk)
    finally:
        c.kill()
    ok = child(big.replace("10 * 10**6", "10**6"))  # control: 2 MB, under the cap
    try:
        assert len(ok.read(time.monotonic() + 30)) == 10**6 + 1
    finally:
        ok.kill()


def test_deadline_eof_and_garbled_are_named():
    c = child("import time; time.sleep(60)")
    try:
        t0 = time.monotonic()
        with pytest.raises(ChildError) as e:
            c.read(time.monotonic() + 0.5)
        assert e.value.kind == "timeout" and time.monotonic() - t0 < FAST_S
    finally:
        c.kill()
    c = child("import os; os._exit(3)")
    with pytest.raises(ChildError, match="exit code 3") as e:
        c.read(math.inf)
    assert e.value.kind == "eof"
    c.kill()
    c = child("print('not json', flush=True); import time; time.sleep(60)")
    with pytest.raises(ChildError, match="not JSON") as e:
        c.read(time.monotonic() + 10)
    assert e.value.kind == "garbled"
    c.kill()


def test_an_exit_is_noticed_while_a_forked_child_holds_the_pipe():
    c = child("import os, time\nif os.fork() == 0:\n    time.sleep(60)\nos._exit(4)")
    t0 = time.monotonic()
    with pytest.raises(ChildError, match="exit code 4"):
        c.read(time.monotonic() + 30)
    assert time.monotonic() - t0 < FAST_S
    c.kill()


def test_kill_ends_the_whole_group_and_reaps():
    c = child(
        "import subprocess, time\np = subprocess.Popen(['sleep', '60'])\nprint(p.pid, flush=True)\ntime.sleep(60)"
    )
    grandchild = c.read(time.monotonic() + 10)
    assert alive(grandchild)  # control: it runs until the group is killed
    c.kill()
    assert c.proc.returncode is not None
    deadline = time.monotonic() + 10
    while alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not alive(grandchild)
    c.kill()  # idempotent


def test_send_to_a_dead_child_is_eof():
    c = child("pass")
    c.proc.wait()
    with pytest.raises(ChildError) as e:
        for _ in range(100):  # the pipe may take a write before the kernel sees the reader gone
            c.send({"x": "y" * 4096})
    assert e.value.kind == "eof"
    c.kill()


def test_a_reward_workers_20mb_reply_fails_its_call_fast_and_the_pool_goes_on(tmp_path):
    """The reward pool on ``Child``: a reward whose error (its traceback) is 20 MB fails that call naming the cap,
    within seconds, and the worker is replaced; control: the other completions score."""
    from align.rewards import RewardScorer, load_rewards

    f = tmp_path / "huge_rewards.py"
    f.write_text(
        "def huge(prompt, completion, **_):\n    if completion == 'big':\n        raise ValueError('x' * 20_000_000)\n    return 1.0\n"
    )
    scorer = RewardScorer(load_rewards([f"{f}:huge"]), workers=2, timeout_s=30.0)
    try:
        t0 = time.monotonic()
        s = scorer.score([({"prompt": "p"}, "big"), ({"prompt": "p"}, "a"), ({"prompt": "p"}, "b")])
        assert time.monotonic() - t0 < 3 * FAST_S
        assert math.isnan(s.totals[0]) and "16777216 bytes" in s.errors[0] and s.totals[1:] == [1.0, 1.0]
        assert scorer.score([({"prompt": "p"}, "c")]).totals == [1.0]  # the replaced worker scores
    finally:
        scorer.close()
