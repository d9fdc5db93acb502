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
from helpers_http import LocalServer, QuietHandler

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


# --- a kimina server that misbehaves (a real http.server on 127.0.0.1) ---------------------------------------------------


class Misbehaving(LocalServer):
    """``GET /health`` answers ok unless ``health`` is ``"drip"``; ``POST /verify`` acts out ``mode``."""

    daemon_threads = True

    def __init__(self, mode: str, health: str = "ok") -> None:
        super().__init__(_Bad)
        self.mode, self.health = mode, health
        self.start()


class _Bad(QuietHandler):
    server: Misbehaving

    def _head(self, length: int | None) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        if length is not None:
            self.send_header("Content-Length", str(length))
        self.end_headers()

    def _drip(self) -> None:
        self._head(10**6)
        for _ in range(int(WAIT_S / 0.05)):  # one byte at a time, each well inside any per-read timeout
            try:
                self.wfile.write(b" ")
                self.wfile.flush()
            except OSError:
                return
            time.sleep(0.05)

    def do_GET(self) -> None:
        if self.server.health == "drip":
            return self._drip()
        data = b'{"status": "ok"}'
        self._head(len(data))
        self.wfile.write(data)

    def do_POST(self) -> None:
        codes = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["codes"]
        mode = self.server.mode
        if mode == "ok":  # a proof that compiles, its #print axioms on the snippet's last line (kimina's shape)
            info = {"severity": "info", "pos": {"line": 10**6, "column": 0}, "data": "'t' depends on axioms: [propext]"}
            ok = {"env": 0, "messages": [info]}
            data = json.dumps(
                {"results": [{"custom_id": c["custom_id"], "error": None, "response": ok} for c in codes]}
            )
            self._head(len(data))
            self.wfile.write(data.encode())
        elif mode == "bad_status":
            self.wfile.write(b"NOT HTTP AT ALL\r\n\r\n")
        elif mode == "incomplete":
            self._head(1000)
            self.wfile.write(b'{"results": [')
        elif mode == "deep":
            data = b"[" * 200_000 + b"]" * 200_000
            self._head(len(data))
            self.wfile.write(data)
        elif mode == "drip":
            self._drip()
        elif mode in ("huge", "huge_unsized"):
            self._head(20 << 20 if mode == "huge" else None)
            with_length = mode == "huge"
            try:
                for _ in range(20 * 16 if with_length else 40 * 16):  # 20 MB (40 MB without a length)
                    self.wfile.write(b" " * (1 << 16))
            except OSError:
                pass
        elif mode == "wrong_shape":
            data = b'{"results": [1, "x", null]}'
            self._head(len(data))
            self.wfile.write(data)
        self.close_connection = True


@pytest.fixture
def bad_server():
    servers = []

    def make(mode: str, health: str = "ok") -> Misbehaving:
        servers.append(Misbehaving(mode, health))
        return servers[-1]

    yield make
    for s in servers:
        s.shutdown()
        s.server_close()


@pytest.mark.parametrize(
    ("mode", "named"),
    [
        ("bad_status", "BadStatusLine"),
        ("incomplete", "IncompleteRead"),
        ("deep", "RecursionError"),
        ("drip", "total deadline"),
        ("huge", "cap"),
        ("huge_unsized", "cap"),
        ("wrong_shape", "TypeError"),
    ],
)
def test_a_misbehaving_kimina_server_resolves_every_future(bad_server, monkeypatch, mode, named):
    """Before: BadStatusLine / IncompleteRead / RecursionError killed the sender thread and left the batch's
    futures unresolved forever; a dripping server outlived every timeout (urllib's is per read); a 20 MB body was
    read whole. Now each future is a verifier_error naming the cause, within the request's total deadline, and the
    client still serves the next batch (control: a behaving server's reply is accepted)."""
    from align.lean import server as kimina

    monkeypatch.setattr(
        kimina, "SLACK_S", 1.0, raising=False
    )  # the total deadline: timeout_s * batch + SLACK_S = 2 s here
    s = bad_server(mode)
    v = LeanVerifier(LeanConfig(server=s.url, workers=1, timeout_s=1.0, retries=0))
    try:
        t0 = time.monotonic()
        futs = [v.submit(STMT, proof("  norm_num")) for _ in range(2)]
        verdicts = [f.result(timeout=WAIT_S) for f in futs]
        assert time.monotonic() - t0 < FAST_S
        assert all(x.reason == "verifier_error" and named in x.detail for x in verdicts), verdicts
        assert all(t.is_alive() for t in v.server._threads)  # the sender survived
        s.mode = "ok"  # control: the same client, a good reply
        assert v.submit(STMT, proof("  norm_num")).result(timeout=WAIT_S).ok
    finally:
        v.close()


def test_a_health_check_that_drips_is_refused_within_its_timeout(bad_server, monkeypatch):
    from align.errors import InputError
    from align.lean import server as kimina

    monkeypatch.setattr(kimina, "HEALTH_TIMEOUT_S", 1.0, raising=False)
    s = bad_server("ok", health="drip")
    t0 = time.monotonic()
    with pytest.raises(InputError, match=r"--lean-server .*\(total deadline\)"):
        LeanVerifier(LeanConfig(server=s.url, workers=1, timeout_s=1.0))
    assert time.monotonic() - t0 < FAST_S
