"""The built-in Lean environment (``--env lean``): Goedel-Prover-V2's prompt, one verified proof attempt per turn.

A row is a Goedel / miniF2F problem: ``name``, ``formal_statement`` (optionally ``informal_prefix``; or lean_gen's
``lean4_code``). ``problem_code(row)`` is the ``lean4_code`` that ``extras/vllm_rollout/lean_gen.py`` reads, so the
first turn, ``goedel.initial_messages(lean4_code)``, is byte for byte lean_gen's prompt. Each ``step`` verifies the
completion (``align.lean.verify.LeanVerifier``: Goedel's ``full_code``, the Lean REPL, the reward-hacking guards):

- reward 1.0 exactly when the ``Verdict`` is ok, else 0.0; the turn's ``info`` names the verdict
  (``lean/ok`` or ``lean/rejected_<reason>``), so the completions log says why a proof was refused;
- ``verifier_error`` (a REPL that crashed or hung, a server that failed): reward NaN, the episode ends. NaN is
  "unscorable" (``align.envs.episodes.episode_scores``): no gradient, counted in ``lean/verifier_errors``, never a
  silent 0 and never a crash;
- a failure with compiler errors (``Verdict.errors``, Goedel's ``get_error_str`` text, capped at
  ``--lean-error-tokens``) is answered with Goedel's correction feedback for the next round
  (``goedel.correction_feedback``), a user message: with ``--max-turns K > 1`` the policy tries again (the feedback
  is environment tokens: masked); at the last turn the episode ends with it in its messages, where
  ``align.lean.corrections`` finds the correction prompt (it equals ``goedel.correction_messages``);
- any other failure (format, sorry, banned, ...) gives no feedback to correct from: the episode ends.

A correction row (``align.lean.corrections``) is the problem row plus ``lean_correction`` (its Goedel correction
prompt and round): the verifier checks it against the same problem, so every guard applies.

The verifier is shared by the run (``bind``): one pool for every episode. ``concurrent = True`` lets
``align.envs.runner.EnvRunner`` call the episodes' steps at once in this process, so each waits only on its own
verdict while the pool verifies N proofs and the other episodes go on generating.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from align.data import InputError
from align.envs import Step
from align.lean.corrections import CORRECTION_KEY, CorrectionQueue
from align.lean.guards import REASONS

ERRORS_CUT = "\n... [Truncated to --lean-error-tokens] ...\n"


def problem_code(row: dict) -> str:
    """The problem's ``lean4_code`` as lean_gen reads it: the row's ``lean4_code`` if it has one, else its
    ``formal_statement`` with ``informal_prefix`` in front (miniF2F's ``formal_statement`` already holds its
    prefix and the import header; then it is taken as it is)."""
    code = row.get("lean4_code")
    if isinstance(code, str) and code:
        return code
    stmt, prefix = row["formal_statement"], row.get("informal_prefix") or ""
    return stmt if prefix in stmt else prefix + stmt


def _check_rows(rows: list[tuple[str, dict]]) -> None:
    """Every ``(where, row)`` is a Lean problem: a ``formal_statement`` (or ``lean4_code``) string with Goedel's
    ``:= by`` marker; one ``InputError`` naming ``where`` (file:line) otherwise, before the model loads."""
    from align.lean import goedel

    for where, row in rows:
        if not isinstance(row, dict):
            raise InputError(f"{where}: a --env lean row is a JSON object with 'formal_statement', got {row!r:.80}")
        has = [k for k in ("formal_statement", "lean4_code") if isinstance(row.get(k), str) and row[k]]
        if not has:
            raise InputError(
                f"{where}: the row has no 'formal_statement' (a Lean theorem statement ending ':= by'); "
                f"--env lean rows are Goedel / miniF2F problems, got keys {sorted(row)}"
            )
        if not isinstance(row.get("informal_prefix") or "", str):
            raise InputError(f"{where}: 'informal_prefix' must be a string, got {row['informal_prefix']!r:.80}")
        if not goedel.has_by_marker(problem_code(row)):
            raise InputError(
                f"{where}: the statement has no ':= by' (Goedel's prompt cuts the statement there and "
                f"appends ':= by sorry'): {problem_code(row)[-120:]!r}"
            )


def cap_errors(errors: str, max_tokens: int, encode: Callable | None, decode: Callable | None) -> str:
    """Goedel's error text cut to its first ``max_tokens`` tokens (0 = whole) with a marker."""
    if max_tokens <= 0 or encode is None:
        return errors
    ids = encode(errors)
    return errors if len(ids) <= max_tokens else decode(ids[:max_tokens]) + ERRORS_CUT


def verdict_info(reason: str | None, correction: bool, first_turn: bool) -> dict[str, int]:
    """A turn's ``Step.info``: which verdict (``lean/ok`` or ``lean/rejected_<reason>``), and on a correction row's
    first turn ``lean/correction`` (what ``metrics`` counts)."""
    info = {"lean/ok" if reason is None else f"lean/rejected_{reason}": 1}
    if correction and first_turn:
        info["lean/correction"] = 1
    return info


class LeanEnv:
    """One proof episode of one problem row (see the module docstring). ``verifier`` is set by ``bind``."""

    verifier: Any = None  # a LeanVerifier (or anything with its submit(lean4_code, completion) -> Future[Verdict])
    error_tokens: int = 0
    encode: Callable | None = None
    decode: Callable | None = None
    concurrent = True  # EnvRunner: steps of different episodes may run at once (the verifier is thread-safe)
    own_timeout = True  # each step is bounded by the verifier (--lean-timeout-s, --lean-retries), not --env-timeout-s
    owned = False  # open() started the verifier, so close() stops it (a class bound by its caller keeps its own)
    corrections: Any = None  # the run's CorrectionConfig (open): --lean-correction-fraction

    def __init__(self, **row: Any) -> None:
        from align.lean import goedel

        if self.verifier is None:
            raise RuntimeError("LeanEnv has no verifier: use LeanEnv.bind(verifier) (--env lean does it)")
        self.code = problem_code(row)
        corr = row.get(CORRECTION_KEY)
        self.correction = corr is not None
        self.round = int(corr["round"]) if corr else 0  # the round of the attempt this prompt asks for
        self.messages = [dict(m) for m in corr["messages"]] if corr else goedel.initial_messages(self.code)
        self.turn = 0

    check_rows = staticmethod(_check_rows)  # the environment hook: the rows checked before the model loads

    @classmethod
    def open(cls, cfg: Any, tokenizer: Any) -> type:
        """The environment hook (``align.envs``): start the verifier pool (``--lean-repl`` / ``--lean-server``,
        ``--lean-workers``; unless the class came bound to one: a REPL that cannot start fails here, before the model
        loads) and bind the episodes to it, error texts cut at ``--lean-error-tokens`` with ``tokenizer``."""
        verifier = cls.verifier
        if verifier is None:
            from align.lean.verify import LeanVerifier

            cfg.lean.check()  # exactly one of --lean-repl / --lean-server
            verifier = LeanVerifier(cfg.lean)
        bound = cls.bind(verifier, cfg.lean_corrections.lean_error_tokens, tokenizer)
        bound.owned, bound.corrections = cls.verifier is None, cfg.lean_corrections
        return bound

    @classmethod
    def close(cls) -> None:
        """The environment hook: stop the verifier pool that ``open`` started."""
        if cls.owned:
            cls.verifier.close()

    @classmethod
    def draws(cls, rows: list[dict], cursor: Any) -> Any:
        """The environment hook: with ``--lean-correction-fraction`` each step's rows come from the correction queue
        (``align.lean.corrections``) over the data cursor; None (the cursor's rows) without it."""
        if cls.corrections is None or cls.corrections.lean_correction_fraction <= 0:
            return None
        return CorrectionQueue(cls.corrections, rows, cursor)

    @classmethod
    def bind(cls, verifier: Any, error_tokens: int = 0, tokenizer: Any = None) -> type:
        """A subclass whose episodes verify through ``verifier`` (and cap error texts with ``tokenizer``)."""
        attrs = {"verifier": verifier, "error_tokens": error_tokens}
        if tokenizer is not None:
            attrs.update(encode=staticmethod(tokenizer.encode), decode=staticmethod(tokenizer.decode))
        return type(cls.__name__, (cls,), attrs)

    def reset(self) -> list[dict]:
        return [dict(m) for m in self.messages]

    def step(self, completion: str) -> Step:
        from align.lean import goedel

        v = self.verifier.submit(self.code, completion).result()  # bounded by the verifier's own --lean-timeout-s
        self.turn += 1
        info = verdict_info(None if v.ok else v.reason, self.correction, self.turn == 1)
        if v.ok:
            return Step(None, 1.0, True, info)
        if v.reason == "verifier_error":
            return Step(None, math.nan, True, info)
        if not v.errors:
            return Step(None, 0.0, True, info)
        self.round += 1
        errors = cap_errors(v.errors, self.error_tokens, self.encode, self.decode)
        return Step([{"role": "user", "content": goedel.correction_feedback(errors, self.round)}], 0.0, False, info)

    @staticmethod
    def metrics(episodes: list) -> dict[str, float]:
        """The ``lean/*`` metrics of a step: verdicts counted over every verified turn (``lean/rejected_<reason>``
        for each reason, ``lean/verifier_errors``, ``lean/proved``: episodes ending in a verified proof),
        ``lean/correction_prompts`` (groups from the correction queue) and ``lean/correction_success`` (the share
        of their episodes that ended verified; 0.0 when there were none)."""
        counts = {r: 0 for r in REASONS}
        corr_groups: set[int] = set()
        corr_eps = corr_ok = 0
        for e in episodes:
            for turn in e.turns:
                for key in turn.get("info") or {}:
                    if key.startswith("lean/rejected_"):
                        counts[key.removeprefix("lean/rejected_")] += 1
            first = (e.turns[0].get("info") or {}) if e.turns else {}
            if first.get("lean/correction"):
                corr_groups.add(e.prompt_index)
                corr_eps += 1
                corr_ok += e.error is None and e.env_reward == 1.0
        out = {f"lean/rejected_{r}": float(n) for r, n in counts.items() if r != "verifier_error"}
        out["lean/verifier_errors"] = float(counts["verifier_error"])
        out["lean/proved"] = float(sum(e.error is None and e.env_reward == 1.0 for e in episodes))
        out["lean/correction_prompts"] = float(len(corr_groups))
        out["lean/correction_success"] = corr_ok / corr_eps if corr_eps else 0.0
        return out
