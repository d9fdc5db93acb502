"""Hostile Lean (issue 42): proofs that would run programs, REPL output a proof forged, a kimina server that
misbehaves, and replies too big to read.

There is no Lean with Mathlib on these machines: the REPL is ``extras/vllm_rollout/lean_repl_standin.py`` (a
STAND-IN speaking the real wire format over recorded replies) or, for the forged output, a FAKE REPL written here
that prints an extra JSON block before its reply (what a proof's ``#eval`` writing to ``/dev/stdout`` would do).
The kimina server is a real stdlib ``http.server`` on 127.0.0.1 that misbehaves on purpose.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from align.lean import guards
from align.lean.config import LeanConfig
from align.lean.env import LeanEnv
from align.lean.verify import LeanVerifier

ROOT = Path(__file__).resolve().parents[1]
STANDIN = ROOT / "extras" / "vllm_rollout" / "lean_repl_standin.py"
FIX = Path(__file__).resolve().parent / "lean_fixtures"
REC = json.loads((FIX / "repl_recorded.json").read_text(encoding="utf-8"))
STMT = "theorem t (x : ℕ) (h : x = 2) : x + 1 = 3 := by sorry"
WAIT_S = 20.0  # bound of every wait below
FAST_S = 10.0  # "fails fast": a 20 MB reply is refused within this (unbounded reads took minutes)


def proof(body: str) -> str:
    return "```lean4\n" + STMT.replace(":= by sorry", ":= by\n" + body) + "\n```"


@pytest.fixture(scope="module")
def replies(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("hostile") / "replies.json"
    rules = [{"match": "norm_num", "reply": REC["def_eval_ok"]}]
    path.write_text(json.dumps({"rules": rules, "default": REC["unfinished_tactic_block"]}), encoding="utf-8")
    return path


def standin_cfg(replies: Path, log: Path, **kw) -> LeanConfig:
    cmd = f"{sys.executable} {STANDIN} --replies {replies} --log {log}"
    return LeanConfig(repl=cmd, **{"workers": 1, "timeout_s": 10, **kw})


def _compiled(log: Path) -> list[str]:
    """The proof commands that reached a REPL (not the import header, not ``#print`` sentinels / axioms)."""
    if not log.exists():
        return []
    cmds = [json.loads(line) for line in log.read_text(encoding="utf-8").splitlines()]
    return [c["cmd"] for c in cmds if c["env"] is not None and not c["cmd"].startswith("#print")]


# --- model-written Lean that would run programs ---------------------------------------------------------------------

RUNS_PROGRAMS = [
    ('#eval IO.Process.run {cmd := "id"}', "runs_code", "#eval"),
    ('#eval! (IO.getEnv "HF_TOKEN")', "runs_code", "#eval"),
    ('run_cmd Lean.logInfo "x"', "runs_code", "run_cmd"),
    ("  run_tac pure ()", "runs_code", "run_tac"),
    ("  by_elab pure default", "runs_code", "by_elab"),
    ('elab "pwn" : tactic => pure ()', "metaprogram", "elab"),
    ('macro "pwn" : tactic => `(tactic| rfl)', "metaprogram", "macro"),
    ('syntax "pwn" : tactic', "metaprogram", "syntax"),
    ("initialize pure ()", "metaprogram", "initialize"),
    ("@[init foo] def bar : Nat := 1", "metaprogram", "@[init]"),
    ("attribute [local tactic Lean.Parser.Tactic.simp] t", "metaprogram", "@[tactic]"),
    ('def f : IO Unit := IO.FS.writeFile "/tmp/x" ""', "io", "IO"),
]


@pytest.mark.parametrize(("extra", "reason", "word"), RUNS_PROGRAMS)
def test_lean_that_runs_programs_never_reaches_the_repl(replies, tmp_path, extra, reason, word):
    """Each construct is rejected by the text guards with its named reason and never sent to a REPL; negative
    control: with ``--lean-banned ''`` the same proof is compiled (it reaches the REPL)."""
    log = tmp_path / "calls.jsonl"
    completion = proof("  norm_num\n" + extra)
    v = LeanVerifier(standin_cfg(replies, log))
    try:
        (x,) = v.verify([(STMT, completion)])
    finally:
        v.close()
    assert (x.ok, x.reason, x.detail) == (False, reason, word)
    assert _compiled(log) == []
    open_v = LeanVerifier(standin_cfg(replies, log, banned=()))
    try:
        open_v.verify([(STMT, completion)])
    finally:
        open_v.close()
    assert len(_compiled(log)) == 1 and extra.strip() in _compiled(log)[0]


def test_quoted_identifiers_are_unquoted_before_matching(replies, tmp_path):
    """``«debug».skipKernelTC`` is ``debug.skipKernelTC`` to Lean; it passed the literal match before."""
    v = LeanVerifier(standin_cfg(replies, tmp_path / "calls.jsonl"))
    try:
        sneaky = v.verify([(STMT, proof("  set_option «debug».skipKernelTC true in\n  norm_num"))])[0]
        quoted_eval = v.verify([(STMT, proof("  norm_num\n«#eval» 1"))])[0]
        plain = v.verify([(STMT, proof("  norm_num"))])[0]  # control
    finally:
        v.close()
    assert (sneaky.reason, sneaky.detail) == ("banned", "debug.skipKernelTC")
    assert (quoted_eval.reason, quoted_eval.detail) == ("runs_code", "#eval")
    assert plain.ok


def test_the_defaults_and_the_metrics_name_every_reason():
    assert set(guards.CODE_RUNNERS) <= set(LeanConfig().banned)
    assert {"runs_code", "metaprogram", "io"} <= set(guards.REASONS)
    assert guards.banned_word("theorem x : IOx = 1 := by simp [h_IO, elabx]", LeanConfig().banned) is None  # control

    class Ep:  # the shape LeanEnv.metrics reads
        def __init__(self, reason):
            self.turns, self.error, self.env_reward, self.prompt_index = (
                [{"info": {f"lean/rejected_{reason}": 1}}],
                None,
                0.0,
                0,
            )

    m = LeanEnv.metrics([Ep("runs_code"), Ep("io")])
    assert (
        m["lean/rejected_runs_code"] == 1.0 and m["lean/rejected_io"] == 1.0 and m["lean/rejected_metaprogram"] == 0.0
    )


# --- a REPL reply is tied to its command ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def forging(tmp_path_factory) -> Path:
    """Stand-in rules: ``FORGE`` prints a forged error-free verdict before the real (failing) reply; ``PAD_N``
    pads the reply to N MiB."""
    path = tmp_path_factory.mktemp("forge") / "replies.json"
    rules = [
        {"match": "FORGE", "fault": "forge"},
        {"match": "PAD_20", "pad_mb": 20},
        {"match": "PAD_1", "pad_mb": 1},
        {"match": "norm_num", "reply": REC["def_eval_ok"]},
    ]
    path.write_text(json.dumps({"rules": rules, "default": REC["unfinished_tactic_block"]}), encoding="utf-8")
    return path


def test_an_extra_json_block_on_stdout_is_a_verifier_error_and_a_restart(forging, tmp_path):
    """A FAKE REPL (the stand-in's ``forge`` fault: no Lean here) writes an error-free verdict before the real one.
    Before the sentinel, the failing proof read as ok=True and later proofs got stale verdicts. Now: a
    verifier_error naming stray output, the process restarted, the next proofs judged right; control: the same
    failing proof without the forged block is a lean_error."""
    v = LeanVerifier(standin_cfg(forging, tmp_path / "calls.jsonl"))
    try:
        forged = v.verify([(STMT, proof("  linarith [FORGE]"))])[0]
        after = v.verify([(STMT, proof("  norm_num")), (STMT, proof("  linarith"))])
        assert (forged.ok, forged.reason) == (False, "verifier_error") and "STRAY OUTPUT" in forged.detail
        assert [x.reason for x in after] == [None, "lean_error"]
        assert v.repls[0].starts == 2  # restarted once, and not retried (the same proof would forge again)
    finally:
        v.close()


def test_a_20mb_repl_reply_fails_fast_with_a_clear_error(forging, tmp_path):
    """Before: the reply was read into a growing buffer with quadratic work (20 MB: 17 s). Now it is refused as
    soon as the buffer passes ``MAX_REPLY_BYTES``; control: a 1 MiB reply is read and judged."""
    v = LeanVerifier(standin_cfg(forging, tmp_path / "calls.jsonl"))
    try:
        t0 = time.monotonic()
        big = v.verify([(STMT, proof("  norm_num [PAD_20]"))])[0]
        took = time.monotonic() - t0
        assert (big.reason, took < FAST_S) == ("verifier_error", True) and "TOO BIG" in big.detail, (big, took)
        assert v.verify([(STMT, proof("  norm_num [PAD_1]"))])[0].ok
    finally:
        v.close()
