"""The Lean verifier (align.lean): guards, the REPL pool's restarts, the kimina-lean-server client.

There is no Lean with Mathlib on these machines. The REPL here is ``extras/vllm_rollout/lean_repl_standin.py``, a
STAND-IN that speaks the real wire format and replays replies recorded from the real REPL
(tests/lean_fixtures/repl_recorded.json), plus the faults it can act out (crash, hang, malformed JSON, memory).
The server is a STAND-IN too: a stdlib ``http.server`` speaking kimina-lean-server's ``/health`` and ``/verify``
shapes over the same recorded replies. Marker names in the proofs (``norm_num [HANG]``) pick a stand-in's rule.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from contextlib import closing
from pathlib import Path

import pytest
from helpers_http import LocalServer, QuietHandler
from helpers_locks import alive

from align.errors import InputError
from align.lean import goedel
from align.lean.config import LeanConfig
from align.lean.verify import LeanVerifier, Verdict

ROOT = Path(__file__).resolve().parents[1]
STANDIN = ROOT / "extras" / "vllm_rollout" / "lean_repl_standin.py"
FIX = Path(__file__).resolve().parent / "lean_fixtures"
REC = json.loads((FIX / "repl_recorded.json").read_text(encoding="utf-8"))
EX = json.loads((FIX / "goedel_examples.json").read_text(encoding="utf-8"))
STMT = EX["lean4_code_478"]
WAIT_S = 20.0  # bound of every poll below


def proof(body: str, stmt: str = STMT) -> str:
    """A model completion: a plan, then one lean4 block restating ``stmt`` with ``body`` as the proof."""
    return "Plan: substitute.\n\n```lean4\n" + stmt.replace(":= by sorry", ":= by\n" + body) + "\n```"


@pytest.fixture(scope="module")
def replies(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("lean")
    cheat_axioms = {
        "messages": [
            {
                "severity": "info",
                "pos": {"line": 1, "column": 0},
                "endPos": {"line": 1, "column": 13},
                "data": "'cheat' depends on axioms: [propext, myAxiom]",
            }
        ],
        "env": 0,
    }
    rules = [
        {"match": "CRASH_ALWAYS", "fault": "crash"},
        {"match": "CRASH_ONCE", "fault": "crash", "once_file": str(d / "crashed_once")},
        {"match": "HANG", "fault": "hang"},
        {"match": "MALFORMED", "fault": "malformed"},
        {"match": "ALLOC", "alloc_mb": 64, "reply": REC["def_eval_ok"]},
        {"match": "LEAN_SORRY", "reply": REC["exact_sorry"]},
        {"match": "UNKNOWN_ENV", "reply": REC["unknown_environment"]},
        {"match": "#print axioms cheat", "reply": cheat_axioms},
        {"match": "norm_num", "reply": REC["def_eval_ok"]},
    ]
    path = d / "replies.json"
    path.write_text(json.dumps({"rules": rules, "default": REC["unfinished_tactic_block"]}), encoding="utf-8")
    return path


def cfg_for(replies: Path, **kw) -> LeanConfig:
    return LeanConfig(repl=f"{sys.executable} {STANDIN} --replies {replies}", **{"workers": 1, "timeout_s": 10, **kw})


@pytest.fixture(scope="module")
def verifier(replies):
    v = LeanVerifier(cfg_for(replies, workers=2))
    yield v
    v.close()


# --- the reward rule and the guards ------------------------------------------------------------------------------------


def test_a_clean_proof_is_accepted(verifier):
    text = proof("  norm_num")
    (v,) = verifier.verify([(STMT, text)])
    assert v == Verdict(True, None, goedel.goedel_full_code(STMT, text), "", [], "")
    lean_error = verifier.verify([(STMT, proof("  linarith"))])[0]  # negative control: the default (an error)
    assert not lean_error.ok and lean_error.reason == "lean_error"
    view = goedel.compile_view(lean_error.proof)
    assert lean_error.errors == goedel.get_error_str(view, REC["unfinished_tactic_block"]["messages"])
    assert "<error>" in lean_error.errors and lean_error.messages == REC["unfinished_tactic_block"]["messages"]


@pytest.mark.parametrize(
    ("completion", "reason", "detail"),
    [
        ("I could not find a proof.", "format", "0 lean4 code blocks"),
        (proof("  norm_num") + "\n" + proof("  simp"), "format", "2 lean4 code blocks"),
        (proof("  norm_num\n" + "  skip\n" * 3000), "too_long", "--lean-max-proof-chars"),
        (proof("  norm_num", STMT.replace("v = 65", "v = v")), "statement_changed", "differs"),
        (proof("  norm_num", STMT.replace("theorem", "lemma")), "statement_changed", "no 'theorem"),
        (proof("  norm_num\n  all_goals admit"), "sorry", "admit"),
        (proof("  sorry"), "sorry", "sorry"),
        (proof("  norm_num [show (2:ℝ) = 2 by native_decide]"), "banned", "native_decide"),
        (proof("  norm_num\n#exit"), "banned", "#exit"),
        (proof("  exact?"), "banned", "apply? / exact?"),
        (proof("  norm_num\naxiom cheat_ax : False"), "axioms", "declares an axiom"),
        (proof("  norm_num [LEAN_SORRY]"), "sorry", "incomplete"),  # no sorry in the text; Lean reports one
    ],
)
def test_each_guard_rejects_its_hack(verifier, completion, reason, detail):
    (v,) = verifier.verify([(STMT, completion)])
    assert (v.ok, v.reason) == (False, reason) and detail in v.detail, v


def test_guards_are_what_reject(replies):
    """Negative controls: the same texts pass once their guard is off, so the guard (not Lean) rejected them."""
    with closing(LeanVerifier(cfg_for(replies, banned=(), max_proof_chars=0, format_gate=False))) as v:
        padded = proof("  norm_num\n" + "  skip\n" * 3000)
        two = proof("  linarith") + "\n" + proof("  norm_num")  # Goedel takes the last block
        native = proof("  norm_num [show (2:ℝ) = 2 by native_decide]")
        assert [x.reason for x in v.verify([(STMT, padded), (STMT, two), (STMT, native)])] == [None, None, None]
        comment_only = proof("  norm_num -- sorry, admit and native_decide only in a comment")
        assert verifier_ok(v, comment_only)


def test_the_format_gate_counts_only_the_answer(verifier):
    draft = "<think>\nA first try:\n```lean4\ntheorem x : True := by trivial\n```\n</think>\n\n"
    assert verifier_ok(verifier, draft + proof("  norm_num"))
    unclosed = verifier.verify([(STMT, draft.replace("</think>", "") + proof("  norm_num"))])[0]  # control
    assert (unclosed.reason, unclosed.detail) == ("format", "2 lean4 code blocks in the answer, need exactly 1")


def verifier_ok(v: LeanVerifier, completion: str) -> bool:
    return v.verify([(STMT, completion)])[0].ok


def test_print_axioms_beyond_the_standard_three_are_rejected(verifier):
    cheat_stmt = STMT.replace("mathd_algebra_478", "cheat")
    (v,) = verifier.verify([(cheat_stmt, proof("  norm_num", cheat_stmt))])
    assert (v.ok, v.reason, v.detail) == (False, "axioms", "myAxiom")


def test_a_repl_level_error_is_a_verifier_error_not_a_pass(verifier):
    (v,) = verifier.verify([(STMT, proof("  norm_num [UNKNOWN_ENV]"))])
    assert (v.ok, v.reason) == (False, "verifier_error") and "Unknown environment" in v.detail


def test_whitespace_and_comments_do_not_change_the_statement(verifier):
    stmt = STMT.replace("(h₂ : b = 30)", "/- a comment -/ (h₂ :   b = 30)").replace("\n    ", "\n  ")
    assert verifier_ok(verifier, proof("  norm_num", stmt).replace(stmt.split("theorem")[0], ""))


# --- the REPL pool: crash, hang, malformed JSON, max uses, memory --------------------------------------------------------


def test_a_repl_crash_mid_batch_is_restarted_and_the_batch_finishes(replies, tmp_path):
    with closing(LeanVerifier(cfg_for(replies, workers=2))) as v:
        items = [(STMT, proof("  norm_num"))] * 6
        items[2] = (STMT, proof("  norm_num [CRASH_ALWAYS]"))
        out = v.verify(items)
        assert [x.ok for x in out] == [True, True, False, True, True, True]
        assert out[2].reason == "verifier_error" and "EOF ERROR" in out[2].detail and "exit code 3" in out[2].detail
        assert sum(r.starts for r in v.repls) >= 3  # 2 + the retry's fresh process (which crashed too)
        (once,) = v.verify([(STMT, proof("  norm_num [CRASH_ONCE]"))])  # transient: the retry succeeds
        assert once.ok and (replies.parent / "crashed_once").exists()


def test_without_retries_a_transient_crash_is_a_verifier_error(replies):
    (replies.parent / "crashed_once").unlink(missing_ok=True)
    with closing(LeanVerifier(cfg_for(replies, retries=0))) as v:
        (x,) = v.verify([(STMT, proof("  norm_num [CRASH_ONCE]"))])
        assert x.reason == "verifier_error" and "EOF ERROR" in x.detail
        assert v.verify([(STMT, proof("  norm_num"))])[0].ok  # and the next proof gets a fresh process


def test_a_hang_hits_the_timeout_and_the_process_group_is_killed(replies, tmp_path):
    """The REPL command starts a child first (as ``lake exe repl`` does): the timeout must kill the whole group."""
    child = tmp_path / "child.pid"
    cmd = f"sh -c 'sleep 300 & echo $! > {child}; exec {sys.executable} {STANDIN} --replies {replies}'"
    with closing(LeanVerifier(LeanConfig(repl=cmd, workers=1, timeout_s=1.0))) as v:
        pid, child_pid = v.repls[0].pid, int(child.read_text())
        assert alive(child_pid)  # control: the child runs beside the REPL
        t0 = time.monotonic()
        (x,) = v.verify([(STMT, proof("  norm_num [HANG]"))])
        assert time.monotonic() - t0 < 10
        assert x.reason == "verifier_error" and "TIMEOUT ERROR" in x.detail
        assert v.repls[0].proc is None and not Path(f"/proc/{pid}").exists()  # killed and reaped
        deadline = time.monotonic() + WAIT_S
        while alive(child_pid) and time.monotonic() < deadline:  # init reaps the orphaned child
            time.sleep(0.05)
        assert not alive(child_pid)
        assert v.verify([(STMT, proof("  norm_num"))])[0].ok and v.repls[0].starts == 2


def test_malformed_json_is_named(replies):
    with closing(LeanVerifier(cfg_for(replies, retries=0))) as v:
        (x,) = v.verify([(STMT, proof("  norm_num [MALFORMED]"))])
        assert x.reason == "verifier_error" and "malformed JSON" in x.detail and "'{\"env\": 1,'" in x.detail


@pytest.mark.parametrize(("max_uses", "starts"), [(2, 3), (0, 1)])
def test_max_uses_restarts_the_process(replies, max_uses, starts):
    with closing(LeanVerifier(cfg_for(replies, max_uses=max_uses))) as v:
        pids = set()
        for _ in range(5):
            assert v.verify([(STMT, proof("  norm_num"))])[0].ok
            pids.add(v.repls[0].pid)
        assert v.repls[0].starts == starts and len(pids) == starts


@pytest.mark.parametrize(("memory_mb", "starts"), [(40, 2), (0, 1)])
def test_a_process_past_the_memory_limit_is_restarted(replies, memory_mb, starts):
    with closing(LeanVerifier(cfg_for(replies, memory_mb=memory_mb))) as v:
        assert v.verify([(STMT, proof("  norm_num [ALLOC]"))])[0].ok  # the stand-in now holds 64 MiB more
        assert v.verify([(STMT, proof("  norm_num"))])[0].ok
        assert v.repls[0].starts == starts


def test_submit_overlaps_and_returns_futures(verifier):
    futs = [verifier.submit(STMT, proof("  norm_num")) for _ in range(4)]
    assert [f.result(timeout=WAIT_S).ok for f in futs] == [True] * 4


# --- bad configuration: one clear error before any model loads ----------------------------------------------------------


def test_bad_configuration_is_one_input_error(replies):
    with pytest.raises(InputError, match="exactly one of --lean-repl CMD"):
        LeanConfig().check()
    with pytest.raises(InputError, match="exactly one of --lean-repl CMD"):
        LeanConfig(repl="lake exe repl", server="http://x").check()
    with pytest.raises(InputError, match=r"--lean-repl 'no-such-lean-repl-here': program .* not found"):
        LeanConfig(repl="no-such-lean-repl-here").check()
    with pytest.raises(InputError, match="--lean-workers must be >= 1"):
        cfg_for(replies, workers=0).check()
    with pytest.raises(InputError, match=r"--lean-repl 'false' did not start a Lean REPL: EOF ERROR.*exit code 1"):
        LeanVerifier(LeanConfig(repl="false"))
    cfg_for(replies).check()  # negative control: a good one passes


def test_banned_is_a_comma_list_flag():
    from align.run.cli import parse

    cfg = parse(LeanConfig, ["--lean-banned", "native_decide, #exit", "--lean-repl", "x"], {"": "lean-"})
    assert cfg.banned == ("native_decide", "#exit") and cfg.repl == "x"
    assert parse(LeanConfig, ["--lean-banned", ""], {"": "lean-"}).banned == ()


# --- the kimina-lean-server client, against a stdlib stand-in -----------------------------------------------------------


class KiminaStandin(LocalServer):
    """A STAND-IN for kimina-lean-server: ``GET /health`` and ``POST /verify`` in its shapes; a code containing
    ``norm_num`` compiles (the ``#print axioms`` info on the snippet's last line), anything else gets the recorded
    error, positions in whole-snippet lines (header included, as kimina reports them)."""

    def __init__(self) -> None:
        super().__init__(_Handler)
        self.health_status, self.fail_next, self.batches = 200, 0, []
        self.gate = threading.Event()
        self.gate.set()
        self.start()


class _Handler(QuietHandler):
    server: KiminaStandin

    def do_GET(self) -> None:
        self.send_json(self.server.health_status, {"status": "ok"} if self.server.health_status == 200 else {})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.batches.append([c["custom_id"] for c in body["codes"]])
        self.server.gate.wait(WAIT_S)
        if self.server.fail_next:
            self.server.fail_next -= 1
            return self.send_json(503, {"detail": "busy"})
        self.send_json(200, {"results": [_kimina_result(c) for c in body["codes"]]})


def _kimina_result(code: dict) -> dict:
    text, header_lines = code["proof"], goedel.HEADER.count("\n")
    if "norm_num" in text:
        last = text.count("\n") + 1
        info = {"severity": "info", "pos": {"line": last, "column": 0}, "endPos": None,
                "data": "'mathd_algebra_478' depends on axioms: [propext, Classical.choice, Quot.sound]"}  # fmt: skip
        return {"custom_id": code["custom_id"], "error": None, "response": {"env": 0, "messages": [info]}}
    msgs = [
        {**m, **{k: {**m[k], "line": m[k]["line"] + header_lines} for k in ("pos", "endPos") if m[k]}}
        for m in REC["unfinished_tactic_block"]["messages"]
    ]
    return {"custom_id": code["custom_id"], "error": None, "response": {"env": 0, "messages": msgs}}


@pytest.fixture
def kimina():
    s = KiminaStandin()
    yield s
    s.shutdown()
    s.server_close()


def server_cfg(url: str, **kw) -> LeanConfig:
    return LeanConfig(server=url, **{"workers": 1, "retry_backoff_s": 0.01, "timeout_s": 10, **kw})


def test_server_verdicts_match_the_repl_rule(kimina):
    with closing(LeanVerifier(server_cfg(kimina.url))) as v:
        ok, bad, hack = v.verify([(STMT, proof("  norm_num")), (STMT, proof("  linarith")), (STMT, proof("  sorry"))])
        assert ok.ok and ok.messages == [] and hack.reason == "sorry"
        assert sum(len(b) for b in kimina.batches) == 2  # the hack was never sent
        assert bad.reason == "lean_error"
        assert bad.errors == goedel.get_error_str(
            goedel.compile_view(bad.proof), REC["unfinished_tactic_block"]["messages"]
        )


def test_server_batches_what_is_waiting(kimina):
    with closing(LeanVerifier(server_cfg(kimina.url, server_batch=4))) as v:
        kimina.gate.clear()
        first = v.submit(STMT, proof("  norm_num"))
        deadline = time.monotonic() + WAIT_S
        while not kimina.batches and time.monotonic() < deadline:
            time.sleep(0.01)
        rest = [v.submit(STMT, proof("  norm_num")) for _ in range(5)]  # queued behind the held request
        kimina.gate.set()
        assert all(f.result(timeout=WAIT_S).ok for f in [first, *rest])
        assert [len(b) for b in kimina.batches] == [1, 4, 1]


@pytest.mark.parametrize(("retries", "ok"), [(1, True), (0, False)])
def test_server_retries_with_backoff(kimina, retries, ok):
    kimina.fail_next = 1
    with closing(LeanVerifier(server_cfg(kimina.url, retries=retries))) as v:
        (x,) = v.verify([(STMT, proof("  norm_num"))])
        assert x.ok is ok and len(kimina.batches) == 1 + retries
        if not ok:
            assert x.reason == "verifier_error" and "503" in x.detail


def test_server_health_check_failure_names_the_flag(kimina):
    kimina.health_status = 500
    with pytest.raises(InputError, match=r"--lean-server http://127.0.0.1:\d+: the health check GET /health failed"):
        LeanVerifier(server_cfg(kimina.url))
    url = kimina.url
    kimina.shutdown()
    kimina.server_close()  # nothing listens there now
    with pytest.raises(InputError, match="--lean-server .* health check"):
        LeanVerifier(server_cfg(url))
    with pytest.raises(InputError, match="must be an http"):
        LeanVerifier(server_cfg("localhost:1234"))
