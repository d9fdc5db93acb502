"""Guards against reward hacking: what a proof must satisfy besides "Lean reports no error".

Each guard returns its ``Verdict.reason`` (``align.lean.verify.REASONS``) and a short detail, or None:

- ``format``: the answer (the text after the last ``</think>``, the whole text without one) holds exactly one
  lean4 code block (Goedel's extraction patterns); with the gate off, at least one anywhere (Goedel's rule);
- ``too_long``: the assembled proof (Goedel's ``full_code``) is longer than ``--lean-max-proof-chars``;
- ``statement_changed``: the theorem statement in the model's block (``theorem ... := by``, the one Goedel's
  assembly replaces by the dataset's) differs from the dataset's after stripping comments and all whitespace,
  or the block has none;
- ``sorry``: ``sorry`` / ``admit`` / ``sorryAx`` outside comments (and, after compiling, a ``sorry`` Lean saw);
- ``banned``: a word of ``--lean-banned`` in the code Lean would compile, or ``apply?`` / ``exact?`` (Goedel refuses
  them); a word of ``CODE_RUNNERS`` has its own reason instead (``runs_code``, ``metaprogram``, ``io``): Lean that
  would run a program while it elaborates (``#eval``, ``run_cmd``, an ``elab`` / ``macro`` / ``syntax`` declaration,
  an ``@[init]`` attribute, ``IO.Process``, ...). ``«»``-quoted identifiers are unquoted before matching
  (``«debug».skipKernelTC`` is ``debug.skipKernelTC``), and an entry written ``@[name]`` matches an attribute;
- ``axioms``: an ``axiom`` declaration, or ``#print axioms`` of the theorem lists more than ``--lean-allowed-axioms``
  (propext, Classical.choice, Quot.sound).

The text rules (``FORBIDDEN``, ``AXIOM_DECL``, ``theorem_name``, ``parse_axioms``) are the ones
``extras/vllm_rollout/pipeline_gen_verify.py`` applies too. stdlib only.
"""

from __future__ import annotations

import re

from align.lean import goedel

STANDARD_AXIOMS = ("propext", "Classical.choice", "Quot.sound")
# Words that make Lean accept what it did not check: native_decide trusts the compiler (Lean.ofReduceBool), #exit
# stops elaboration early so the rest is never checked, debug.skipKernelTC skips the kernel's type check,
# implemented_by / extern swap a definition's code for unchecked code. Reason: ``banned``.
SOUNDNESS = ("native_decide", "Lean.ofReduceBool", "#exit", "debug.skipKernelTC", "implemented_by", "extern")
# Lean that runs a program on the verifier host while it elaborates (issue 42: the REPL would run it with the
# trainer's rights). word -> reason. ``runs_code``: commands and tactics that compile and evaluate code;
# ``metaprogram``: declarations that install code Lean runs later (elaborators, macros, syntax, init hooks);
# ``io``: the names of IO itself, a second fence should something run code by another route.
_RUNS_CODE = "#eval #eval! run_cmd run_tac run_elab run_meta by_elab #guard #test #sample plausible slim_check"
_METAPROGRAM = (
    "elab elab_rules macro macro_rules syntax declare_syntax_cat initialize builtin_initialize command_elab "
    "term_elab Lean.Elab Lean.Meta TacticM TermElabM CommandElabM MetaM CoreM "
    "@[init] @[builtin_init] @[tactic] @[command_elab] @[term_elab] @[macro] @[env_linter]"
)
_IO = "IO EIO BaseIO IO.Process IO.FS System.IO IO.getEnv IO.Prim unsafeBaseIO unsafeIO unsafeEIO"
CODE_RUNNERS = {
    **dict.fromkeys(_RUNS_CODE.split(), "runs_code"),
    **dict.fromkeys(_METAPROGRAM.split(), "metaprogram"),
    **dict.fromkeys(_IO.split(), "io"),
}
BANNED_REASONS = tuple(dict.fromkeys(CODE_RUNNERS.values()))  # the reasons of CODE_RUNNERS, in order
DEFAULT_BANNED = SOUNDNESS + tuple(CODE_RUNNERS)
# every Verdict.reason (align.lean.verify.Verdict), each a ``lean/rejected_<reason>`` metric
REASONS = ("format", "too_long", "statement_changed", "sorry", "banned", *BANNED_REASONS, "axioms", "lean_error")
REASONS += ("verifier_error",)
ATTRIBUTES = re.compile(r"(?:@\[|\battribute\s*\[)([^\]]*)\]")  # @[a, b x] / attribute [a] f
FORBIDDEN = re.compile(r"(?<![\w.'])(sorry|admit|sorryAx)(?![\w'!?])")
AXIOM_DECL = re.compile(
    r"^\s*(?:@\[[^\]]*\]\s*)?(?:(?:private|protected|noncomputable|unsafe)\s+)*axiom\s", re.MULTILINE
)
STATEMENT = re.compile(r"((?:theorem).*?:=\s*by\s*sorry)", re.DOTALL)  # goedel.replace_statement_in_proof's
PROOF_STATEMENT = re.compile(r"((?:^|\s)theorem\s+.*?:=\s*by)", re.DOTALL)


def theorem_name(lean4_code: str) -> str | None:
    """The dataset theorem's name (what ``#print axioms`` is asked about)."""
    m = re.search(r"theorem\s+([^\s(:{\[]+)", goedel.remove_comments(lean4_code))
    return m.group(1) if m else None


def parse_axioms(reply: dict) -> list[str] | None:
    """The axioms ``#print axioms`` lists in a REPL reply; None when the reply does not say."""
    for m in reply.get("messages", []):
        d = m.get("data", "")
        if "does not depend on any axioms" in d:
            return []
        if "depends on axioms:" in d:
            inner = d.split("depends on axioms:", 1)[1].strip().strip("[]")
            return [a.strip() for a in inner.split(",") if a.strip()]
    return None


def squash(text: str) -> str:
    """``text`` without comments and without any whitespace: the statement comparison's normal form."""
    return "".join(goedel.remove_comments(text).split())


def answer_blocks(completion: str) -> int:
    """Lean code blocks in the answer (after the last ``</think>``), counted with Goedel's first matching pattern."""
    answer = completion.rsplit("</think>", 1)[-1]
    for pattern in goedel.EXTRACT_PATTERNS:
        found = re.findall(pattern, answer, re.DOTALL)
        if found:
            return len(found)
    return 0


def statement_changed(lean4_code: str, completion: str) -> str | None:
    """Why the model's theorem statement is not the dataset's (None when it is)."""
    want = STATEMENT.search(goedel.remove_comments(goedel.formal_statement(lean4_code)))
    block = goedel.extract_block(completion)
    have = None if block is None else PROOF_STATEMENT.search(goedel.remove_comments(block))
    if want is None or have is None:
        return "no 'theorem ... := by' in the model's code" if want is not None else "no theorem in the statement"
    if squash(want.group(1)[: -len("sorry")]) != squash(have.group(1)):
        return "the model's theorem statement differs from the dataset's"
    return None


def _word(word: str) -> re.Pattern:
    return re.compile(r"(?<![\w.'])" + re.escape(word) + r"(?![\w'])")


def unquote(code: str) -> str:
    """``code`` with the ``«»`` of quoted identifiers dropped (``«debug».skipKernelTC`` -> ``debug.skipKernelTC``)."""
    return code.replace("«", "").replace("»", "")


def _attributes(code: str) -> set[str]:
    """The attribute names of ``@[...]`` and ``attribute [...]`` (the first word of each comma-separated entry)."""
    names = set()
    for group in ATTRIBUTES.findall(code):
        for entry in group.split(","):
            words = entry.split()
            while words and words[0] in ("local", "scoped"):
                words.pop(0)
            names.update(words[:1])
    return names


def banned_word(code: str, banned: tuple[str, ...]) -> str | None:
    """The first ``banned`` word in ``code``, or None. ``code`` is matched as Lean compiles it: Goedel's assembly
    already dropped the proof's comments, and removing them again could hide code (a ``"--"`` string literal), so
    no second pass; ``«»`` are dropped first. An entry ``@[name]`` matches the attribute ``name``."""
    text = unquote(code)
    attributes = _attributes(text) if any(w.startswith("@[") for w in banned) else set()
    for w in banned:
        if w.startswith("@[") and w.endswith("]"):
            if w[2:-1].strip() in attributes:
                return w
        elif _word(w).search(text):
            return w
    return None


def banned_reason(word: str) -> str:
    """The verdict reason of a banned word: its ``CODE_RUNNERS`` reason, else ``banned``."""
    return CODE_RUNNERS.get(word, "banned")


def text_guards(
    lean4_code: str,
    completion: str,
    code: str | None,
    code_error: str | None,
    banned: tuple[str, ...],
    max_chars: int,
    format_gate: bool = True,
) -> tuple[str, str] | None:
    """The guards that need no compiler, cheapest first: ``(reason, detail)`` of the first that rejects.

    ``code, code_error`` are ``goedel.full_code(lean4_code, completion)``."""
    blocks = answer_blocks(completion)
    if code_error == "no_code_block" or (format_gate and blocks != 1):
        return "format", f"{blocks} lean4 code blocks in the answer, need exactly 1" if format_gate else "no code"
    if code_error == "apply_or_exact_used":
        return "banned", "apply? / exact?"
    if code_error == "statement_theorem_not_found":
        return "verifier_error", "the row's formal_statement has no 'theorem ... := by sorry'"
    if code_error == "proof_theorem_not_found" or code is None:
        return "statement_changed", "no 'theorem ... := by' in the model's code"
    if max_chars and len(code) > max_chars:
        return "too_long", f"{len(code)} chars > --lean-max-proof-chars {max_chars}"
    why = statement_changed(lean4_code, completion)
    if why:
        return "statement_changed", why
    body = goedel.remove_comments(code)
    m = FORBIDDEN.search(body)
    if m:
        return "sorry", m.group(1)
    word = banned_word(code, banned)
    if word:
        return banned_reason(word), word
    if AXIOM_DECL.search(body):
        return "axioms", "declares an axiom"
    return None


def extra_axioms(axioms: list[str], allowed: tuple[str, ...]) -> list[str]:
    """The axioms beyond ``allowed``, sorted."""
    return sorted(set(axioms) - set(allowed))
