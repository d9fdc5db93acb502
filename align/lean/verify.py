"""``LeanVerifier``: (statement, completion) pairs -> ``Verdict``s over a pool of Lean REPLs or a kimina server.

The reward rule: a completion is ``ok`` exactly when every guard passes (``align.lean.guards``) and Lean
reports no error and no ``sorry`` (``goedel.reference_verdict`` complete, the rule ``pipeline_gen_verify.py``
applies), and ``#print axioms`` lists only the standard three. A verifier failure (a REPL that crashed, hung,
answered bad JSON; a server that failed its retries) is ``reason="verifier_error"``: unscorable, never a crash
and never a silent 0.
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass, field

from align.lean.config import LeanConfig

REASONS = ("format", "too_long", "statement_changed", "sorry", "banned", "axioms", "lean_error", "verifier_error")


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


class LeanVerifier:
    """A pool of REPL processes (``cfg.repl``) or a kimina-lean-server client (``cfg.server``)."""

    def __init__(self, cfg: LeanConfig) -> None:
        raise NotImplementedError("LeanVerifier: in progress on branch leanv")

    def verify(self, items: list[tuple[str, str]]) -> list[Verdict]:
        raise NotImplementedError

    def submit(self, lean4_code: str, completion: str) -> concurrent.futures.Future[Verdict]:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError
