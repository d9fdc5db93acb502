"""``LeanConfig``: the Lean verifier's settings (``--lean-repl``, ``--lean-server``, ``--lean-workers``, ...).

Meant to be nested in ``TrainConfig`` as ``lean`` with the CLI prefix ``lean-`` (so ``repl`` is ``--lean-repl``).
``check()`` validates the values and that the REPL command exists, before any model loads; starting the
processes (and finding a command that exits at once) is ``LeanVerifier``'s, also before the model loads.
"""

from __future__ import annotations

import math
import os
import shlex
import shutil
from dataclasses import dataclass

from align.errors import InputError
from align.lean.goedel import HEADER
from align.lean.guards import DEFAULT_BANNED
from align.options import flag  # the one definition of a flag's help


@dataclass
class LeanConfig:
    repl: str = flag(
        "",
        "Command starting a Lean REPL (leanprover-community/repl: JSON on stdin/stdout), e.g. 'lake exe repl' "
        "run in a Mathlib project (--lean-repl-cwd); one of --lean-repl / --lean-server.",
    )
    repl_cwd: str = flag("", "Directory the --lean-repl command starts in ('' = here).")
    server: str = flag("", "kimina-lean-server base URL (POST /verify), e.g. http://localhost:12332; or --lean-repl.")
    workers: int = flag(4, "REPL processes in the pool, or concurrent server requests.")
    max_uses: int = flag(200, "Restart a REPL process after this many proofs (0 = never; bounds its memory).")
    timeout_s: float = flag(300.0, "Seconds one proof may take; past it the REPL's process group is killed.")
    import_timeout_s: float = flag(600.0, "Seconds a fresh REPL may take to run the import header (Mathlib loads).")
    memory_mb: int = flag(
        0, "Restart a REPL process whose resident memory (its process group, /proc) passes this (0 = off)."
    )
    max_proof_chars: int = flag(20000, "A proof (the assembled Lean code) longer than this is rejected as too_long.")
    banned: tuple[str, ...] = flag(
        DEFAULT_BANNED,
        "Comma list of words a proof may not contain (reason 'banned'; Lean that runs programs: 'runs_code', "
        "'metaprogram', 'io'; see docs/lean.md); '' = none.",
    )
    allowed_axioms: tuple[str, ...] = flag(
        ("propext", "Classical.choice", "Quot.sound"),
        "Comma list: '#print axioms' of the theorem may list only these (reason 'axioms').",
    )
    format_gate: bool = flag(
        True,
        "Require exactly one lean4 code block in the answer (the text after the last </think>; "
        "reason 'format'); --no-lean-format-gate takes Goedel's last block as it is.",
    )
    header: str = flag(
        HEADER, "The import header a fresh REPL runs once; its env is reused for every proof (Goedel's)."
    )
    server_batch: int = flag(8, "With --lean-server: at most this many proofs per POST /verify.")
    retry_backoff_s: float = flag(1.0, "With --lean-server: seconds before the first retry, doubling after each.")
    retries: int = flag(
        1, "Retries of one proof after a REPL crash / bad JSON or a failed server request (with backoff)."
    )

    def __post_init__(self) -> None:
        for name in ("banned", "allowed_axioms"):  # a comma list from a flag, a list from config.json
            value = getattr(self, name)
            if isinstance(value, str):
                value = value.split(",")
            setattr(self, name, tuple(w.strip() for w in value if w.strip()))
        for name in ("timeout_s", "import_timeout_s", "retry_backoff_s"):  # inf: OverflowError in every wait
            v = getattr(self, name)
            if isinstance(v, (int, float)) and not math.isfinite(v):
                raise InputError(f"--lean-{name.replace('_', '-')} must be a finite number, got {v}")

    def check(self) -> None:
        """The values alone, and that ``--lean-repl``'s program exists: an ``InputError`` naming the flag."""
        if bool(self.repl) == bool(self.server):
            raise InputError(
                "the Lean verifier needs exactly one of --lean-repl CMD (a leanprover-community/repl process, e.g. "
                f"'lake exe repl' in a Mathlib project) or --lean-server URL (kimina-lean-server); got "
                f"--lean-repl {self.repl!r} --lean-server {self.server!r}"
            )
        for name in ("workers", "server_batch"):
            if getattr(self, name) < 1:
                raise InputError(f"--lean-{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        for name in ("max_uses", "memory_mb", "max_proof_chars", "retries", "retry_backoff_s"):
            if getattr(self, name) < 0:
                raise InputError(f"--lean-{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        for name in ("timeout_s", "import_timeout_s"):
            if not getattr(self, name) > 0:
                raise InputError(f"--lean-{name.replace('_', '-')} must be > 0, got {getattr(self, name)}")
        if self.server and not self.server.startswith(("http://", "https://")):
            raise InputError(f"--lean-server must be an http:// or https:// URL, got {self.server!r}")
        if self.repl:
            self._check_repl_command()

    def _check_repl_command(self) -> None:
        if self.repl_cwd and not os.path.isdir(self.repl_cwd):
            raise InputError(f"--lean-repl-cwd {self.repl_cwd!r} is not a directory (the Mathlib project)")
        try:
            argv = shlex.split(self.repl)
        except ValueError as e:
            raise InputError(f"--lean-repl {self.repl!r} is not a valid shell command: {e}") from None
        prog = argv[0] if argv else ""
        if os.sep in prog:  # a path: relative to the directory the REPL starts in
            path = os.path.join(self.repl_cwd or ".", prog)
            found = os.path.isfile(path) and os.access(path, os.X_OK)
        else:
            found = shutil.which(prog) is not None
        if not found:
            raise InputError(
                f"--lean-repl {self.repl!r}: program {prog!r} not found or not executable"
                + (f" (from --lean-repl-cwd {self.repl_cwd!r})" if self.repl_cwd else "")
                + "; install Lean and the REPL (see docs/lean.md) or fix the command"
            )
