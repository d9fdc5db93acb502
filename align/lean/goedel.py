"""Goedel-Prover-V2 prompts, code extraction and Lean error feedback, byte-identical to the reference.

The one copy of the Goedel logic: the trainer's Lean environment, ``extras/vllm_rollout/lean_gen.py`` and
``pipeline_gen_verify.py`` all use it (``extras/vllm_rollout/lean_prompts.py`` re-exports it and keeps the
fidelity CLI). stdlib only. Every string and rule here reproduces the public Goedel-Prover-V2 pipeline
(``src/utils.py`` ``DeepSeekCoTHandler``, ``src/compile.py:handle``, ``src/inference.py``,
Goedel-LM/Goedel-Prover-V2 @ 2e9036e; see extras/vllm_rollout/LEAN.md); the reference code itself is not
vendored. Where the reference returns sentinel strings (``"None"``, ``"**Error**, ..."``) the ``goedel_*``
functions return them unchanged (they are what the reference compiles); ``full_code`` is the record-level view
that maps them to ``(None, reason)``.

Chat rendering is done by the model's own tokenizer; ``render_qwen3`` is a stdlib model of the stock Qwen3
template, used by tests and as a cross-check.
"""

from __future__ import annotations

import re

# QUOTED DATA (src/utils.py, src/compile.py): the fixed header DeepSeekCoTHandler.extrac_code prefixes, and the
# REPL's env-0 command (identical text).
HEADER = "import Mathlib\nimport Aesop\n\nset_option maxHeartbeats 0\n\nopen BigOperators Real Nat Topology Rat\n\n"
DEFAULT_IMPORTS = HEADER

# QUOTED DATA (src/utils.py prover_inference): initial user prompt; `{formal_statement}` is the only field.
INITIAL_TEMPLATE = (
    "Complete the following Lean 4 code:\n\n```lean4\n{formal_statement}```\n\n"
    "Before producing the Lean 4 code to formally prove the given theorem, provide a detailed proof plan "
    "outlining the main proof steps and strategies.\n"
    "The plan should highlight key ideas, intermediate lemmas, and proof structures that will guide the "
    "construction of the final formal proof."
)

# QUOTED DATA (src/utils.py DeepSeekCoTHandler.generate_correction_prompt): correction feedback; `prev_round` = k - 1.
CORRECTION_TEMPLATE = (
    "The proof (Round {prev_round}) is not correct. Following is the compilation error message, where we use "
    "<error></error> to signal the position of the error.\n\n{error_str}"
    "\n\nBefore producing the Lean 4 code to formally prove the given theorem, provide a detailed analysis of "
    "the error message."
)

# QUOTED DATA (src/utils.py problem_check / replace_statement_in_proof).
APPLY_EXACT_ERROR = "**Error**, 'apply?' or 'exact?' is used, which is not allowed."

# QUOTED DATA (src/utils.py extrac_code): tried in order, first pattern with any match wins, last match taken.
EXTRACT_PATTERNS = (r"```lean4\n(.*?)\n```", r"```lean4\n(.*?)```", r"```lean\n(.*?)```")

BY_MARKER = ":= by"
SHOW_LINES = 6  # get_error_str: lines shown of a multi-line error span before truncation
MAX_ERRORS = 8  # get_error_str with error_thres truthy (the pipeline default)


# --- prompt ------------------------------------------------------------------------------------------------------------


def formal_statement(lean4_code: str) -> str:
    """The reference normalisation: text before the first ``:= by`` plus ``:= by sorry``.

    The reference applies it even when ``:= by`` is absent (it then appends to the whole text);
    callers should refuse such problems first (``has_by_marker``)."""
    return lean4_code.split(BY_MARKER)[0] + ":= by sorry"


def has_by_marker(lean4_code: str) -> bool:
    return BY_MARKER in lean4_code


def initial_prompt(lean4_code: str) -> str:
    """The initial user-message content (one user message, no system message)."""
    return INITIAL_TEMPLATE.format(formal_statement=formal_statement(lean4_code))


def initial_messages(lean4_code: str) -> list[dict]:
    return [{"role": "user", "content": initial_prompt(lean4_code)}]


def correction_feedback(error_str: str, round_k: int) -> str:
    """The user feedback of correction round ``round_k`` (>= 1); it names the previous round ``k - 1``."""
    if round_k < 1:
        raise ValueError(f"correction round must be >= 1, got {round_k}")
    return CORRECTION_TEMPLATE.format(prev_round=round_k - 1, error_str=error_str)


def correction_messages(history: list[dict], prev_output: str, error_str: str, round_k: int) -> list[dict]:
    """``generate_correction_prompt``'s message list: the previous attempt's PROMPT messages, then the raw
    previous output as the assistant turn, then the feedback as a user turn."""
    return [
        *[dict(m) for m in history],
        {"role": "assistant", "content": prev_output},
        {"role": "user", "content": correction_feedback(error_str, round_k)},
    ]


def render_qwen3(messages: list[dict], add_generation_prompt: bool = True) -> str:
    """stdlib model of the stock Qwen3 chat template for user/assistant turns (Qwen3's tokenizer_config.json).

    Assistant turns before the last user turn keep only the text after their last ``</think>``
    (left-stripped of newlines). No system prompt is injected; no ``<think>`` in the generation prompt."""
    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1)
    out = []
    for i, m in enumerate(messages):
        content = m["content"]
        if m["role"] == "assistant":
            reasoning = ""
            if "</think>" in content:
                reasoning = content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
                content = content.split("</think>")[-1].lstrip("\n")
            if i > last_user and reasoning:
                content = "<think>\n" + reasoning.strip("\n") + "\n</think>\n\n" + content.lstrip("\n")
        elif m["role"] not in ("user", "system"):
            raise ValueError(f"render_qwen3 supports system/user/assistant roles, got {m['role']!r}")
        out.append(f"<|im_start|>{m['role']}\n{content}<|im_end|>\n")
    if add_generation_prompt:
        out.append("<|im_start|>assistant\n")
    return "".join(out)


# --- extraction and full code ------------------------------------------------------------------------------------------


def extract_block(output: str) -> str | None:
    """The base ``extrac_code`` without the header prefix; ``None`` when no pattern matches."""
    for pattern in EXTRACT_PATTERNS:
        matches = re.findall(pattern, output, re.DOTALL)
        if matches:
            return matches[-1]
    return None


def goedel_extrac_code(output: str) -> str:
    """``DeepSeekCoTHandler.extrac_code``: header + last block, or the 4-char string ``"None"``."""
    block = extract_block(output)
    return "None" if block is None else HEADER + block


def remove_comments(text: str) -> str:
    text = re.sub(r"/-.*?-/", "", text, flags=re.DOTALL)
    return "\n".join(line.split("--", 1)[0] for line in text.split("\n")).strip()


def _commented(text: str) -> str:
    return "\n".join(["\n"] + ["-- " + x for x in text.split("\n")])


def replace_statement_in_proof(statement: str, proof: str) -> str:
    """The reference full-code assembly (``problem_check``); returns ``**Error**`` strings as the reference does."""
    if "apply?" in proof or "exact?" in proof:
        return APPLY_EXACT_ERROR
    stats_re = remove_comments(statement)
    stmt = re.search(r"((?:theorem).*?:=\s*by\s*sorry)", stats_re, re.DOTALL)
    if stmt is None:
        return f"**Error**, can not find 'theorem' and ':= sorry' in {_commented(statement)}"
    proof_str = remove_comments(proof)
    prf = re.search(r"((?:^|\s)theorem\s+.*?:=\s*by)", proof_str, re.DOTALL)
    if prf is None:
        return f"**Error**, can not find 'theorem' and ':=' in {_commented(proof)}"
    return stats_re[: stmt.span()[1]].replace("sorry", "") + proof_str[prf.span()[1] :]


def goedel_full_code(lean4_code: str, output: str) -> str:
    """What ``inference.py`` stores as ``full_code`` (and the reference compiles): ``"None"``, an
    ``**Error**`` string, or the assembled code. ``lean4_code`` is normalised first, as the reference does."""
    extracted = goedel_extrac_code(output)
    if extracted == "None":
        return "None"
    return replace_statement_in_proof(formal_statement(lean4_code), extracted)


def full_code(lean4_code: str, output: str) -> tuple[str | None, str | None]:
    """Record view of ``goedel_full_code``: ``(code, None)`` or ``(None, reason)``."""
    code = goedel_full_code(lean4_code, output)
    if code == "None":
        return None, "no_code_block"
    if code == APPLY_EXACT_ERROR:
        return None, "apply_or_exact_used"
    if code.startswith("**Error**, can not find 'theorem' and ':= sorry'"):
        return None, "statement_theorem_not_found"
    if code.startswith("**Error**, can not find 'theorem' and ':='"):
        return None, "proof_theorem_not_found"
    return code, None


def statement_prefix(lean4_code: str) -> str | None:
    """The dataset statement part of every assembled ``full_code`` (comment-free, ``sorry`` removed)."""
    stats_re = remove_comments(formal_statement(lean4_code))
    stmt = re.search(r"((?:theorem).*?:=\s*by\s*sorry)", stats_re, re.DOTALL)
    return None if stmt is None else stats_re[: stmt.span()[1]].replace("sorry", "")


# --- compile view and error feedback ----------------------------------------------------------------------------------


def compile_view(code: str) -> str:
    """``compile.py:handle``: drop lines whose stripped text starts with import/set_option/open; keep blanks.

    REPL positions in the verification record index into exactly this text."""
    return "\n".join(
        line
        for line in code.split("\n")
        if not (
            line.strip().startswith("import")
            or line.strip().startswith("set_option")
            or line.strip().startswith("open")
        )
    )


def _leading_spaces(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def get_error_str(code: str, errors: list[dict], error_thres: bool = True) -> str:
    """The reference feedback text with ``<error>``/``</error>`` markers (src/utils.py get_error_str).

    ``code`` is the compiled (``compile_view``) text; ``errors`` are REPL messages with severity error.
    Lines are 1-based, columns 0-based code points. Positions outside ``code`` raise ``ValueError``
    (the reference would raise ``IndexError`` or mark the wrong line)."""
    lines = code.split("\n")
    limit = MAX_ERRORS if error_thres else len(errors)
    out = ""
    for i, err in enumerate(errors[:limit]):
        sl, sc = err["pos"]["line"] - 1, err["pos"]["column"]
        end = err.get("endPos")
        if end is None:
            el, ec = sl, (len(lines[sl]) if 0 <= sl < len(lines) else 0)
        else:
            el, ec = end["line"] - 1, end["column"]
        if not (0 <= sl < len(lines) and 0 <= el < len(lines)):
            raise ValueError(f"error {i + 1} position lines {sl + 1}..{el + 1} outside the {len(lines)}-line code")
        out += f"\nError {i + 1}:\n"
        out += "\nCorresponding Code:\n```lean4\n"
        snippet = ""
        for k in (-4, -3, -2, -1):
            if sl + k >= 0:
                snippet += lines[sl + k] + "\n"
        if sl != el:
            snippet += lines[sl][:sc] + "<error>" + lines[sl][sc:] + "\n"
            if not error_thres:
                for j in range(sl + 1, el):
                    snippet += lines[j] + "\n"
            else:
                for j in range(sl + 1, min(el, sl + SHOW_LINES)):
                    snippet += lines[j] + "\n"
                if el > sl + SHOW_LINES:
                    snippet += "\n" + " " * _leading_spaces(lines[sl + SHOW_LINES - 1]) + "... --[Truncated]-- ...\n"
            snippet += lines[el][:ec] + "</error>" + lines[el][ec:] + "\n"
        else:
            snippet += lines[sl][:sc] + "<error>" + lines[sl][sc:ec] + "</error>" + lines[sl][ec:] + "\n"
        if el + 1 < len(lines):
            snippet += lines[el + 1] + "\n"
        out += snippet
        out += "\n```\n"
        out += f"\nError Message: {err['data']}\n"
    if len(errors) > limit:
        out += f"\n... [Omitted {len(errors) - limit} more errors] ...\n"
    return out


# --- REPL verdicts (src/compile.py, lean_compiler/repl_scheduler.py) --------------------------------------------------


def reference_verdict(reply: dict) -> dict:
    """The reference ``pass`` / ``complete`` of one REPL JSON reply (quirks included: a REPL-level
    ``{"message": ...}`` reply has no messages, so it is pass and complete here)."""
    msgs = reply.get("messages", [])
    errors = [m for m in msgs if m.get("severity") == "error"]
    warnings = [m for m in msgs if m.get("severity") == "warning"]
    sorries = reply.get("sorries", [])
    passed = not errors
    complete = (
        passed
        and not sorries
        and not any("declaration uses 'sorry'" in w["data"] or "failed" in w["data"] for w in warnings)
    )
    return {"pass": passed, "complete": complete, "errors": errors, "warnings": warnings, "sorries": sorries}
