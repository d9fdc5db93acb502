"""Goedel-Prover-V2 prompts: the fidelity CLI over ``align.lean.goedel`` (the one copy of the logic).

The prompts, code extraction, error feedback and REPL verdicts live in ``align/lean/goedel.py`` (stdlib only,
shared with the trainer's Lean environment and ``pipeline_gen_verify.py``); this module keeps its path, re-exports
them for ``lean_gen.py`` / ``lean_records.py`` and the tests, and holds the synthetic generators and the
``fidelity`` command that compares them with the reference Goedel-Prover-V2 ``src/utils.py`` (see LEAN.md).

CLI: ``python lean_prompts.py fidelity --model SNAPSHOT --reference-src PATH/src --out r.json``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo's own align, stdlib-only modules
from align.lean.goedel import (
    APPLY_EXACT_ERROR,
    BY_MARKER,
    CORRECTION_TEMPLATE,
    DEFAULT_IMPORTS,
    EXTRACT_PATTERNS,
    HEADER,
    INITIAL_TEMPLATE,
    MAX_ERRORS,
    SHOW_LINES,
    compile_view,
    correction_feedback,
    correction_messages,
    extract_block,
    formal_statement,
    full_code,
    get_error_str,
    goedel_extrac_code,
    goedel_full_code,
    has_by_marker,
    initial_messages,
    initial_prompt,
    reference_verdict,
    remove_comments,
    render_qwen3,
    replace_statement_in_proof,
    statement_prefix,
)

__all__ = [
    "APPLY_EXACT_ERROR",
    "BY_MARKER",
    "CORRECTION_TEMPLATE",
    "DEFAULT_IMPORTS",
    "EXTRACT_PATTERNS",
    "HEADER",
    "INITIAL_TEMPLATE",
    "MAX_ERRORS",
    "SHOW_LINES",
    "compile_view",
    "correction_feedback",
    "correction_messages",
    "extract_block",
    "fidelity",
    "formal_statement",
    "full_code",
    "get_error_str",
    "goedel_extrac_code",
    "goedel_full_code",
    "has_by_marker",
    "initial_messages",
    "initial_prompt",
    "main",
    "reference_verdict",
    "remove_comments",
    "render_qwen3",
    "replace_statement_in_proof",
    "statement_prefix",
]  # fmt: skip


# --- fidelity against the reference src/utils.py ----------------------------------------------------------------------


def _synthetic_outputs(lean4_codes: list[str], count: int = 63) -> list[tuple[str, str]]:
    """Deterministic (statement, model output) pairs covering every extraction / assembly branch."""
    import random

    rng = random.Random(0)
    shapes = [
        "Plan.\n\n```lean4\n{hdr}/-- doc -/\n{stmt}\n  nlinarith [sq_nonneg 1] -- c\n```",
        "```lean4\nA\n```\n```lean4\n{hdr}{stmt}\n  simp\n```",
        "```lean4\n{stmt}\n  norm_num```",
        "```lean\n{stmt}\n  omega\n```",
        "```lean4 \n{stmt}\n```",
        "no fence at all",
        "<think>```lean4\n{stmt}\n  linarith\n```</think>\n```lean4\nlemma x : True := by trivial\n```",
        "```lean4\n{stmt}\n  exact?\n```",
        "```lean4\nlemma aux : 1 = 1 := by rfl\ntheorem t : True := by\n  trivial\n```",
        "```lean4\n{stmt}\n  /- block\ncomment -/ sorry\n```x```lean4\nB",
    ]
    out = []
    for i in range(count):
        code = lean4_codes[rng.randrange(len(lean4_codes))]
        stmt = code.split(BY_MARKER)[0] + ":= by"
        out.append((code, shapes[i % len(shapes)].format(hdr=HEADER, stmt=stmt)))
    return out


def _synthetic_error_sets(count: int = 60) -> list[tuple[str, list[dict]]]:
    import random

    rng = random.Random(1)
    sets = []
    for _ in range(count):
        lines = ["  " * rng.randrange(3) + f"line{j} ≤ x" for j in range(rng.randrange(1, 25))]
        errs = []
        for e in range(rng.randrange(0, 11)):
            sl = rng.randrange(len(lines))
            el = rng.randrange(sl, len(lines))
            sc = rng.randrange(len(lines[sl]) + 1)
            end = None if rng.random() < 0.2 else {"line": el + 1, "column": rng.randrange(len(lines[el]) + 1)}
            if end is not None and el == sl:
                end["column"] = max(end["column"], sc)
            errs.append({"severity": "error", "pos": {"line": sl + 1, "column": sc}, "endPos": end, "data": f"e{e}"})
        sets.append(("\n".join(lines), errs))
    return sets


def fidelity(model: str, reference_src: str | None, problems: str, out: str) -> dict:
    """Compare this module with the reference ``src/utils.py`` (+ ``src/compile.py:handle`` when importable).

    Needs the Goedel-Prover-V2 checkout (``--reference-src PATH/src``) and the model's tokenizer
    (rollout venv). Raises ``RuntimeError`` when the reference is not given: there is no fallback."""
    import importlib
    import json
    import os

    if not reference_src or not os.path.isfile(os.path.join(reference_src, "utils.py")):
        raise RuntimeError(
            "fidelity needs the reference Goedel-Prover-V2 sources: pass --reference-src PATH/src "
            f"(a directory holding utils.py from Goedel-LM/Goedel-Prover-V2 @ 2e9036e); got {reference_src!r}"
        )
    from transformers import AutoTokenizer  # rollout venv

    sys.path.insert(0, reference_src)
    ref = importlib.import_module("utils")
    tok = AutoTokenizer.from_pretrained(model, trust_remote_code=True)
    handler = ref.DeepSeekCoTHandler()
    with open(problems, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    report: dict = {"model": model, "reference_src": reference_src, "problems": len(rows), "mismatches": []}

    def check(kind: str, key: str, ours, theirs) -> None:
        if ours != theirs:
            report["mismatches"].append({"kind": kind, "key": key, "ours": ours, "reference": theirs})

    for row in rows:
        code = formal_statement(row["lean4_code"])
        ref_text, ref_msgs = handler.prover_inference(code, tok)
        ours = tok.apply_chat_template(initial_messages(code), tokenize=False, add_generation_prompt=True)
        check("prompt", row["name"], ours, ref_text)
        check("messages", row["name"], initial_messages(code), ref_msgs)
        check("token_ids", row["name"], tok.encode(ours), tok.encode(ref_text))
    pairs = _synthetic_outputs([r["lean4_code"] for r in rows])
    for i, (stmt, output) in enumerate(pairs):
        ref_x = handler.extrac_code(output)
        check("extrac_code", str(i), goedel_extrac_code(output), ref_x)
        if ref_x not in ("None", None):
            check(
                "problem_check",
                str(i),
                goedel_full_code(stmt, output),
                handler.problem_check(formal_statement(stmt), ref_x),
            )
    for i, (code, errs) in enumerate(_synthetic_error_sets()):
        try:
            theirs = ref.get_error_str(code, errs, True)
        except Exception as exc:  # noqa: BLE001 - record the reference's own failure as data
            theirs = f"<reference raised {type(exc).__name__}>"
        check("get_error_str", str(i), get_error_str(code, errs, True), theirs)
        history = initial_messages(rows[i % len(rows)]["lean4_code"])
        ref_prompt, ref_msgs = handler.generate_correction_prompt(
            rows[i % len(rows)]["lean4_code"], history, f"out {i}", theirs, tok, 1 + i % 2
        )
        msgs = correction_messages(history, f"out {i}", theirs, 1 + i % 2)
        check("correction_messages", str(i), msgs, ref_msgs)
        check(
            "correction_prompt",
            str(i),
            tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True),
            ref_prompt,
        )
    try:
        compile_mod = importlib.import_module("compile")
        handle = compile_mod.handle
    except Exception as exc:  # noqa: BLE001 - compile.py pulls the REPL scheduler; report, don't hide
        report["compile_handle"] = f"not checked: {type(exc).__name__}: {exc}"
    else:
        for i, (stmt, output) in enumerate(pairs):
            fc = goedel_full_code(stmt, output)
            theirs = handle({"full_code": fc, "problem_id": str(i)})
            check("compile_view", str(i), compile_view(fc), theirs["code"] if isinstance(theirs, dict) else theirs)
        report["compile_handle"] = "checked"
    report["ok"] = not report["mismatches"]
    with open(out, "w", encoding="utf-8") as f:
        json.dump(report, f, ensure_ascii=False, indent=1)
    return report


def main(argv: list[str] | None = None) -> int:
    import argparse
    import os

    here = os.path.dirname(os.path.abspath(__file__))
    p = argparse.ArgumentParser(prog="lean_prompts.py", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fidelity", help="compare against the reference Goedel-Prover-V2 src/utils.py")
    f.add_argument("--model", required=True, help="model snapshot whose tokenizer / chat template renders prompts")
    f.add_argument(
        "--reference-src",
        default=os.environ.get("GOEDEL_REFERENCE_SRC"),
        help="Goedel-Prover-V2 checkout's src/ directory (env GOEDEL_REFERENCE_SRC)",
    )
    f.add_argument("--problems", default=os.path.join(here, "..", "..", "..", "shared", "data", "minif2f_test.jsonl"))
    f.add_argument("--out", required=True)
    args = p.parse_args(argv)
    try:
        report = fidelity(args.model, args.reference_src, args.problems, args.out)
    except RuntimeError as exc:
        print(f"lean_prompts fidelity: {exc}", file=sys.stderr)
        return 2
    print(f"fidelity: {len(report['mismatches'])} mismatches -> {args.out}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
