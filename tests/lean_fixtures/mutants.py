"""Hand-written mutants of the Lean driver's pure half and of align.lean; each must make its test file fail.

usage (align venv): .venv/bin/python tests/lean_fixtures/mutants.py
Copies align/, tests/ and extras/vllm_rollout/ to a temp dir, applies one mutant at a time, runs the mutant's
suite (tests/test_lean_gen_contract.py unless it names another) in the copy (cwd, PYTHONPATH and
ALIGN_LEAN_EXTRAS point there), and prints killed / tried. The working tree is never modified.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
P, R, V = "align/lean/goedel.py", "extras/vllm_rollout/lean_records.py", "extras/vllm_rollout/pipeline_gen_verify.py"
G, L, W = "align/lean/guards.py", "align/lean/repl.py", "align/lean/verify.py"
CONTRACT, VERIFY = "tests/test_lean_gen_contract.py", "tests/test_lean_verify.py"

MUTANTS = [
    (P, "proof steps and strategies.\\n", "proof steps and strategies. "),
    (
        P,
        'return lean4_code.split(BY_MARKER)[0] + ":= by sorry"',
        'return lean4_code.split(BY_MARKER)[0] + ":= by\\n  sorry"',
    ),
    (P, "            return matches[-1]", "            return matches[0]"),
    (
        P,
        'EXTRACT_PATTERNS = (r"```lean4\\n(.*?)\\n```", r"```lean4\\n(.*?)```",',
        'EXTRACT_PATTERNS = (r"```lean4\\n(.*?)```", r"```lean4\\n(.*?)\\n```",',
    ),
    (P, 'line.split("--", 1)[0] for line', 'line.split("--", 1)[0].rstrip() for line'),
    (P, '.replace("sorry", "") + proof_str', '.replace("sorry", "", 1) + proof_str'),
    (P, '            line.strip().startswith("import")', '            line.startswith("import")'),
    (P, "for k in (-4, -3, -2, -1):", "for k in (-3, -2, -1):"),
    (P, "SHOW_LINES = 6", "SHOW_LINES = 5"),
    (P, "_leading_spaces(lines[sl + SHOW_LINES - 1])", "_leading_spaces(lines[el])"),
    (P, "MAX_ERRORS = 8", "MAX_ERRORS = 9"),
    (
        P,
        "        if el + 1 < len(lines):\n            snippet += lines[el + 1]",
        "        if False:\n            snippet += lines[el + 1]",
    ),
    (P, "CORRECTION_TEMPLATE.format(prev_round=round_k - 1,", "CORRECTION_TEMPLATE.format(prev_round=round_k,"),
    (P, 'content = content.split("</think>")[-1].lstrip("\\n")', 'content = content.split("</think>")[-1]'),
    (P, 'or "failed" in w["data"]', 'or "never" in w["data"]'),
    (R, 'f"{seed}\\x00{problem_id}\\x00{sample_idx}\\x00{round_k}"', 'f"{seed}\\x00{problem_id}\\x00{sample_idx}"'),
    (R, "if prompt_len > max_model_len * PROMPT_FIT:", "if prompt_len >= max_model_len * PROMPT_FIT:"),
    (
        R,
        '"context_clipped": max_model_len - prompt_len < cap,',
        '"context_clipped": max_model_len - prompt_len <= cap,',
    ),
    (R, "elif pid in solved and not repair_solved:", "elif False:"),
    (R, 'elif v.get("repl_errors") is None or', 'elif not v.get("repl_errors") or'),
    (R, "    if extra:\n        raise", "    if False:\n        raise"),
    (R, 'keep = data.rfind(b"\\n") + 1', 'keep = data.rfind(b"\\n")'),
    (R, 'cumulative = item["ancestor_tokens"] + len(completion_ids)', "cumulative = len(completion_ids)"),
    (R, 'state = "complete" if traj and all(a in gen for a in lineage) else "partial"', 'state = "complete"'),
    # records read back (issue 19): bool is no int, conflicts are refused, repeats across files checked, UTF-8 named
    (
        R,
        "if (isinstance(v, bool) and bool not in types) or not isinstance(v, types) or empty_id:",
        "if not isinstance(v, types) or empty_id:",
    ),
    (R, "            if diff and not keep_first:", "            if False:"),
    (
        R,
        '    verif = _unique((v for vs, _ in pairs for v in vs), "verif")',
        '    verif = {v["sample_id"]: v for vs, _ in pairs for v in vs}',
    ),
    (R, '        line_no = data[: exc.start].count(b"\\n") + 1', "        line_no = 1"),
    (G, "r\"(?<![\\w.'])(sorry|admit|sorryAx)", "r\"(?<![\\w.'])(sorry|sorryAx)"),
    (V, 'if "env" not in reply:', "if False:"),
    (V, "(prefix is None or not code.startswith(prefix))", "(prefix is None)"),
    (V, "elif set(ax) - set(allowed_axioms):", "elif False:"),
    (L, 'if reply.get("env") != 0 or "messages" in reply:', "if False:"),
    # align.lean's verifier (issue 27), against tests/test_lean_verify.py
    (G, 'if squash(want.group(1)[: -len("sorry")]) != squash(have.group(1)):', "if False:", VERIFY),
    (G, 'answer = completion.rsplit("</think>", 1)[-1]', "answer = completion", VERIFY),
    (G, "format_gate and blocks != 1", "format_gate and blocks < 1", VERIFY),
    (G, "if max_chars and len(code) > max_chars:", "if False:", VERIFY),
    (G, 'return re.compile(r"(?<![\\w.\'])" + re.escape(word)', 'return re.compile("^" + re.escape(word)', VERIFY),
    (G, "    if AXIOM_DECL.search(body):\n", "    if False:\n", VERIFY),
    (W, "    if extra:\n", "    if False:\n", VERIFY),
    (W, 'sorry = ref["sorries"] or', "sorry = False and", VERIFY),
    (W, 'if e.kind == "timeout" or attempt >= self.cfg.retries:', "if attempt >= self.cfg.retries:", VERIFY),
    (W, "proof_msgs.append(_shifted(m, shift))", "proof_msgs.append(m)", VERIFY),
    (L, "(self.max_uses and self.uses >= self.max_uses)", "False", VERIFY),
    (L, "return bool(self.memory_mb) and", "return False and", VERIFY),
    (L, "                reap_group(self.proc.pid, grace_s=2)\n", "                self.proc.kill()\n", VERIFY),
]


def _copy(d: str) -> None:
    """The repo's Lean-relevant half (align/, tests/, extras/vllm_rollout/, pyproject.toml) under ``d``."""
    skip = shutil.ignore_patterns("__pycache__")
    for part in ("align", "tests", "extras/vllm_rollout"):
        shutil.copytree(ROOT / part, Path(d) / part, ignore=skip)
    shutil.copy(ROOT / "pyproject.toml", d)


def _passes(d: str, suite: str) -> bool:
    try:
        r = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", suite],
            cwd=d,
            check=False,
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "ALIGN_LEAN_EXTRAS": str(Path(d) / "extras" / "vllm_rollout"), "PYTHONPATH": d},
        )
    except subprocess.TimeoutExpired:  # a mutant that hangs the suite is caught too
        return False
    return r.returncode == 0


def main() -> int:
    with tempfile.TemporaryDirectory() as d:  # control: the unmutated copy passes, so a failure means the mutant
        _copy(d)
        for suite in (CONTRACT, VERIFY):
            if not _passes(d, suite):
                print(f"control: {suite} fails on the unmutated copy; fix that first")
                return 2
    killed, survivors = 0, []
    for i, (fname, old, new, *suite) in enumerate(MUTANTS, 1):
        with tempfile.TemporaryDirectory() as d:
            _copy(d)
            text = (Path(d) / fname).read_text(encoding="utf-8")
            if text.count(old) != 1:
                print(f"mutant {i}: pattern not found exactly once in {fname}: {old!r}")
                return 2
            (Path(d) / fname).write_text(text.replace(old, new), encoding="utf-8")
            dead = not _passes(d, suite[0] if suite else CONTRACT)
            killed += dead
            if not dead:
                survivors.append((fname, old, new))
            print(f"mutant {i:2d} {'killed' if dead else 'SURVIVED'}: {fname}: {old[:60]!r}", flush=True)
    print(f"{killed}/{len(MUTANTS)} mutants killed")
    return 0 if not survivors else 1


if __name__ == "__main__":
    raise SystemExit(main())
