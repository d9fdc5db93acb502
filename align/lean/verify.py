"""``LeanVerifier``: (statement, completion) pairs -> ``Verdict``s over a pool of Lean REPLs or a kimina server.

The reward rule: a completion is ``ok`` exactly when every guard passes (``align.lean.guards``), Lean reports no
error and no ``sorry`` (``goedel.reference_verdict`` complete: the rule ``pipeline_gen_verify.py`` applies) and
``#print axioms`` of the theorem lists only ``--lean-allowed-axioms``. The text guards run first, in the caller's
thread (no compiler time is spent on a rejected proof, so such a verdict has no ``errors``); what passes them is
compiled as Goedel compiles it: ``compile_view(full_code)`` in the import header's env.

A verifier failure (a REPL that crashed, hung past ``--lean-timeout-s``, answered malformed JSON or a REPL-level
error; a server request that failed its retries) is ``reason="verifier_error"``: the sample is unscorable, never
a crash and never a silent 0. A crash or bad JSON is retried ``--lean-retries`` times on a fresh process (a
timeout, a reply past the size cap or stray output is not: the same proof would do it again).
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
from dataclasses import dataclass, field

from align.errors import InputError
from align.lean import goedel, guards
from align.lean.config import LeanConfig
from align.lean.repl import Repl, ReplError
from align.lean.server import LeanServer

log = logging.getLogger(__name__)

REASONS = guards.REASONS
# REPL failures the same proof would cause again on a fresh process: a hang, a reply past the cap, stray output
NO_RETRY = ("timeout", "too_big", "stray")


@dataclass
class Verdict:
    """One completion's verdict. ``reason`` is None when ``ok``, else one of ``REASONS``; ``proof`` is Goedel's
    ``full_code`` (None when it has none); ``errors`` the ``get_error_str`` text a correction prompt quotes
    ("" when ok or when nothing was compiled); ``messages`` the REPL's raw messages; ``detail`` a short
    human-readable why (the banned word, the extra axioms, the verifier's failure)."""

    ok: bool
    reason: str | None
    proof: str | None
    errors: str = ""
    messages: list[dict] = field(default_factory=list)
    detail: str = ""


def _done(verdict: Verdict) -> concurrent.futures.Future:
    fut: concurrent.futures.Future = concurrent.futures.Future()
    fut.set_result(verdict)
    return fut


def judge(code: str, view: str, reply: dict, axioms: list[str] | None, cfg: LeanConfig, repl_level: bool) -> Verdict:
    """The verdict of one compiled proof: ``reply`` is the REPL's answer to ``view`` (positions index into it),
    ``axioms`` what ``#print axioms`` listed (None: it did not say), ``repl_level`` whether the reply is a
    REPL-level error (``{"message": ...}``, e.g. an unknown env) rather than a compilation."""
    msgs = reply.get("messages", [])
    if repl_level:
        return Verdict(False, "verifier_error", code, "", msgs, f"REPL-level error: {reply.get('message', reply)}")
    ref = goedel.reference_verdict(reply)
    if ref["errors"]:
        try:
            text = goedel.get_error_str(view, ref["errors"])
        except ValueError as e:  # a position outside the compiled text: no feedback rather than a wrong one
            text = ""
            log.warning("Lean error positions outside the compiled code: %s", e)
        return Verdict(False, "lean_error", code, text, msgs, str(ref["errors"][0].get("data", ""))[:200])
    if not ref["complete"]:
        sorry = ref["sorries"] or any("sorry" in w.get("data", "") for w in ref["warnings"])
        return Verdict(False, "sorry" if sorry else "lean_error", code, "", msgs, "incomplete: sorry or failed")
    if axioms is None:
        return Verdict(False, "verifier_error", code, "", msgs, "#print axioms gave no axiom list")
    extra = guards.extra_axioms(axioms, cfg.allowed_axioms)
    if extra:
        return Verdict(False, "axioms", code, "", msgs, ",".join(extra))
    return Verdict(True, None, code, "", msgs, "")


class LeanVerifier:
    """A pool of ``cfg.workers`` REPL processes (``cfg.repl``) or a kimina-lean-server client (``cfg.server``).

    Construct it before the model loads: a REPL that cannot start, or a server that fails its health check, is an
    ``InputError`` naming ``--lean-repl`` / ``--lean-server``."""

    def __init__(self, cfg: LeanConfig) -> None:
        cfg.check()
        self.cfg = cfg
        self.repls: list[Repl] = []
        self.server: LeanServer | None = None
        self._idle: queue.Queue = queue.Queue()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        if cfg.server:
            self.server = LeanServer(
                cfg.server, cfg.workers, cfg.server_batch, cfg.timeout_s, cfg.retries, cfg.retry_backoff_s
            )
            return
        self._pool = concurrent.futures.ThreadPoolExecutor(cfg.workers, thread_name_prefix="lean")
        starts = [self._pool.submit(self._start_repl) for _ in range(cfg.workers)]
        failures = []
        for f in starts:
            try:
                self.repls.append(f.result())
            except (ReplError, OSError) as e:
                failures.append(e)
        if failures:
            self.close()
            raise InputError(
                f"--lean-repl {cfg.repl!r} did not start a Lean REPL: {failures[0]}; check the command, "
                "--lean-repl-cwd (the Mathlib project) and --lean-import-timeout-s"
            )
        for r in self.repls:
            self._idle.put(r)

    def _start_repl(self) -> Repl:
        c = self.cfg
        return Repl(c.repl, c.repl_cwd, c.timeout_s, c.import_timeout_s, c.header, c.max_uses, c.memory_mb)

    def submit(self, lean4_code: str, completion: str) -> concurrent.futures.Future[Verdict]:
        """Non-blocking: the text guards now, the compilation on the pool; the future never raises."""
        c = self.cfg
        try:
            code, code_error = goedel.full_code(lean4_code, completion)
            rejected = guards.text_guards(
                lean4_code, completion, code, code_error, c.banned, c.max_proof_chars, c.format_gate
            )
        except Exception as e:  # noqa: BLE001 - one bad item is that item's verifier_error, never the batch's
            return _done(Verdict(False, "verifier_error", None, detail=f"{type(e).__name__}: {e}"))
        if rejected:
            return _done(Verdict(False, rejected[0], code, detail=rejected[1]))
        view, name = goedel.compile_view(code), guards.theorem_name(lean4_code)
        if self.server is not None:
            return self._submit_server(code, view, name)
        return self._pool.submit(self._check_repl, code, view, name)

    def verify(self, items: list[tuple[str, str]]) -> list[Verdict]:
        """Blocking: the verdicts of ``(lean4_code, completion)`` pairs, in order, checked in parallel."""
        return [f.result() for f in [self.submit(s, c) for s, c in items]]

    def _check_repl(self, code: str, view: str, name: str | None) -> Verdict:
        repl = self._idle.get()
        attempt = 0
        try:
            while True:
                try:
                    reply = repl.run(view)
                    axioms = None
                    if "env" in reply and goedel.reference_verdict(reply)["complete"]:
                        axioms = guards.parse_axioms(repl.send({"cmd": f"#print axioms {name}", "env": reply["env"]}))
                    return judge(code, view, reply, axioms, self.cfg, "env" not in reply)
                except ReplError as e:
                    if e.kind in NO_RETRY or attempt >= self.cfg.retries:
                        return Verdict(False, "verifier_error", code, detail=str(e)[:500])
                    attempt += 1
                    log.warning("Lean REPL failed (%s); retrying on a fresh process", e)
        except Exception as e:  # noqa: BLE001 - never raise for one item (e.g. a REPL that cannot restart)
            return Verdict(False, "verifier_error", code, detail=f"{type(e).__name__}: {e}"[:500])
        finally:
            self._idle.put(repl)

    def _submit_server(self, code: str, view: str, name: str | None) -> concurrent.futures.Future[Verdict]:
        """The server compiles header + view + ``#print axioms``; its positions are taken as the whole snippet's
        (kimina's) and shifted back by the header's lines, so ``errors`` index into ``view`` as with the REPL."""
        shift, last = self.cfg.header.count("\n"), self.cfg.header.count("\n") + view.count("\n") + 1
        inner = self.server.submit(self.cfg.header + view + f"\n\n#print axioms {name}")
        outer: concurrent.futures.Future = concurrent.futures.Future()

        def finish(f: concurrent.futures.Future) -> None:
            try:
                reply = f.result()
                proof_msgs, ax_msgs = [], []
                for m in reply.get("messages") or []:
                    line = (m.get("pos") or {}).get("line", 0)
                    if line > last:
                        ax_msgs.append(m)
                    else:
                        proof_msgs.append(_shifted(m, shift))
                reply = {**reply, "messages": proof_msgs}
                repl_level = "message" in reply and not proof_msgs
                verdict = judge(code, view, reply, guards.parse_axioms({"messages": ax_msgs}), self.cfg, repl_level)
            except Exception as e:  # noqa: BLE001 - ServerError or a malformed reply: this item only
                verdict = Verdict(False, "verifier_error", code, detail=f"{type(e).__name__}: {e}"[:500])
            outer.set_result(verdict)

        inner.add_done_callback(finish)
        return outer

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        for r in self.repls:
            r.close()
        if self.server is not None:
            self.server.close()


def _shifted(msg: dict, lines: int) -> dict:
    out = dict(msg)
    for key in ("pos", "endPos"):
        if isinstance(out.get(key), dict):
            out[key] = {**out[key], "line": out[key]["line"] - lines}
    return out
