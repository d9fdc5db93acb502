"""Correction samples in the batch (the Kimina-Prover recipe): ``--lean-correction-fraction f`` of each step's prompts
are Goedel correction prompts built from earlier failed rollouts, the rest fresh problems from the data cursor.

What is queued: a failed episode of a *fresh* problem (a dataset row, not itself a correction) whose last verdict had
compiler errors, i.e. whose conversation ends with Goedel's correction feedback (``align.lean.env``): its messages
are then exactly ``goedel.correction_messages(prompt, completion, errors, round)``, what lean_gen builds for the same
failure. Failures without compiler feedback (format, sorry, banned, axioms, ...) are not queued (lean_gen's default
``--no-feedback-policy skip``), nor are verifier errors, nor failures of correction prompts (one correction round
on top of the episode's own turns keeps prompts bounded).

How many per problem: one; a newer failure of a problem replaces its queued one (its errors come from a newer
policy). Of a group's failures the first by sample index is taken. Max age: an entry made at step s may be drawn
at steps s+1 .. s + ``--lean-correction-max-age``; older ones are dropped. Drawn newest first; each entry is drawn
once. When the queue holds fewer than ``round(f * P)`` entries, fresh problems fill the batch.

The queue lives in the data cursor's state (``cursor.state["lean_corrections"]``, plain JSON-like data, replaced,
never mutated in place), so every checkpoint, pending batch (``--max-async-steps``) and interrupted step keeps the
queue exactly as the data cursor: a resumed run draws what the uninterrupted one draws.

A correction prompt's row is its problem's row plus ``lean_correction`` ({"messages", "round"}): the verifier
checks the corrected proof against the same statement with every guard. In a step's ``Groups`` its index is
``len(rows) + j`` (j: its place among the step's correction rows), so ``idx >= len(rows)`` marks a correction.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from align.options import flag  # the one definition of a flag's help

CORRECTION_KEY = "lean_correction"  # a correction row's prompt: {"messages", "round"}
STATE_KEY = "lean_corrections"


@dataclass
class CorrectionConfig:
    lean_correction_fraction: float = flag(
        0.0,
        "With --env lean: this fraction of each step's prompts are Goedel correction prompts built from "
        "earlier failed rollouts with compiler errors (the Kimina recipe; 0 = off).",
    )
    lean_error_tokens: int = flag(
        0, "With --env lean: cut Lean's error text in a correction prompt to this many tokens (0 = whole)."
    )
    lean_correction_max_age: int = flag(
        4, "With --lean-correction-fraction: a failure may be drawn this many steps after it was made."
    )

    def __post_init__(self) -> None:
        if not (0.0 <= self.lean_correction_fraction < 1.0):
            raise ValueError(
                f"--lean-correction-fraction must be in [0, 1) (fresh problems feed the queue), got "
                f"{self.lean_correction_fraction}"
            )
        if self.lean_error_tokens < 0:
            raise ValueError(f"--lean-error-tokens must be >= 0 (0 = whole), got {self.lean_error_tokens}")
        if self.lean_correction_max_age < 1:
            raise ValueError(f"--lean-correction-max-age must be >= 1, got {self.lean_correction_max_age}")


def correctable(ep: Any) -> bool:
    """A failed episode whose conversation ends with Goedel's correction feedback (a user message after an answer)."""
    m = ep.messages
    return (
        ep.error is None
        and ep.env_reward == 0.0
        and len(m) >= 3
        and m[-1]["role"] == "user"
        and m[-2]["role"] == "assistant"
    )


class CorrectionQueue:
    """The queue over a run's rows and data cursor (``align.run.policy.DataCursor``); see the module docstring.
    ``begin(t)`` opens step t, ``next_prompts(k)`` draws (corrections first), ``row(i)`` is any drawn index's row,
    ``add(groups, t)`` queues the step's failures."""

    def __init__(self, cfg: CorrectionConfig, rows: list[dict], cursor: Any) -> None:
        self.cfg, self.rows, self.cursor = cfg, rows, cursor
        self.drawn: list[dict] = []  # this step's correction rows: index len(rows) + j
        self.t = 0

    def entries(self) -> list[dict]:
        return list(self.cursor.state.get(STATE_KEY, []))

    def begin(self, t: int) -> None:
        self.t, self.drawn = t, []

    def next_prompts(self, k: int) -> list[int]:
        """``k`` prompt indices: ``round(f * k)`` corrections (newest first, as many as are queued), then fresh ones."""
        live = [e for e in self.entries() if self.t - e["step"] <= self.cfg.lean_correction_max_age]
        want = min(math.floor(self.cfg.lean_correction_fraction * k + 0.5), len(live))
        order = sorted(range(len(live)), key=lambda j: -live[j]["step"])  # stable: a step's groups in order
        take = set(order[:want])
        self.cursor.state[STATE_KEY] = [e for j, e in enumerate(live) if j not in take]
        idx = []
        for j in order[:want]:
            e = live[j]
            idx.append(len(self.rows) + len(self.drawn))
            self.drawn.append(
                {**self.rows[e["index"]], CORRECTION_KEY: {"messages": e["messages"], "round": e["round"]}}
            )
        return idx + self.cursor.next_prompts(k - want)

    def row(self, i: int) -> dict:
        return self.rows[i] if i < len(self.rows) else self.drawn[i - len(self.rows)]

    def add(self, groups: Any, t: int) -> int:
        """Queue the first correctable failure of each fresh problem's group in ``groups``; returns how many."""
        entries, added = self.entries(), 0
        by_group: dict[int, list] = {}
        for c in groups.completions:
            by_group.setdefault(c.prompt_index, []).append(c)
        for p, i in enumerate(groups.idx):
            if i >= len(self.rows):
                continue  # a correction's own failure is not queued again
            ep = next((e for e in sorted(by_group.get(p, []), key=lambda e: e.sample_index) if correctable(e)), None)
            if ep is None:
                continue
            entries = [e for e in entries if e["index"] != i]
            entries.append({"step": t, "index": i, "messages": [dict(m) for m in ep.messages], "round": len(ep.turns)})
            added += 1
        self.cursor.state[STATE_KEY] = entries
        return added
