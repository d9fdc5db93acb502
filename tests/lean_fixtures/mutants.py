"""Hand-written mutants of the Lean driver's pure half; each must make tests/test_lean_gen_contract.py fail.

usage (align venv): .venv/bin/python tests/lean_fixtures/mutants.py
Copies extras/vllm_rollout/*.py to a temp dir, applies one mutant at a time, runs the contract suite against the
copy (ALIGN_LEAN_EXTRAS), and prints killed / tried. The working tree is never modified.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "extras" / "vllm_rollout"
P, R, V = "lean_prompts.py", "lean_records.py", "pipeline_gen_verify.py"

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
    (V, "r\"(?<![\\w.'])(sorry|admit|sorryAx)", "r\"(?<![\\w.'])(sorry|sorryAx)"),
    (V, 'if "env" not in reply:', "if False:"),
    (V, "(prefix is None or not code.startswith(prefix))", "(prefix is None)"),
    (V, "elif set(ax) - set(allowed_axioms):", "elif False:"),
    (V, 'if reply.get("env") != 0 or "messages" in reply:', "if False:"),
]


def main() -> int:
    killed, survivors = 0, []
    for i, (fname, old, new) in enumerate(MUTANTS, 1):
        with tempfile.TemporaryDirectory() as d:
            for f in SRC.glob("*.py"):
                shutil.copy(f, d)
            text = (Path(d) / fname).read_text(encoding="utf-8")
            if text.count(old) != 1:
                print(f"mutant {i}: pattern not found exactly once in {fname}: {old!r}")
                return 2
            (Path(d) / fname).write_text(text.replace(old, new), encoding="utf-8")
            r = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pytest",
                    "-q",
                    "-x",
                    "-p",
                    "no:cacheprovider",
                    "tests/test_lean_gen_contract.py",
                ],
                cwd=ROOT,
                check=False,
                capture_output=True,
                text=True,
                timeout=300,
                env={**os.environ, "ALIGN_LEAN_EXTRAS": d},
            )
            dead = r.returncode != 0
            killed += dead
            if not dead:
                survivors.append((fname, old, new))
            print(f"mutant {i:2d} {'killed' if dead else 'SURVIVED'}: {fname}: {old[:60]!r}", flush=True)
    print(f"{killed}/{len(MUTANTS)} mutants killed")
    return 0 if not survivors else 1


if __name__ == "__main__":
    raise SystemExit(main())
