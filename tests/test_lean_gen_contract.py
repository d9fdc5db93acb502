"""Contract tests of the stdlib-only half of the Lean driver (lean_prompts.py + lean_gen.py's pure functions).

Runs from the align venv: nothing here imports vllm. The quoted examples are the JSON literals of
shared/reference/goedel.md (copied to tests/lean_fixtures/goedel_examples.json), produced there by
running the reference Goedel-Prover-V2 functions; every one must be reproduced byte for byte.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXTRAS = ROOT / "extras" / "vllm_rollout"
FIX = Path(__file__).resolve().parent / "lean_fixtures"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, EXTRAS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


lp = _load("lean_prompts")
EX = json.loads((FIX / "goedel_examples.json").read_text(encoding="utf-8"))


# --- quoted examples of goedel.md, byte for byte -------------------------------------------------------------------


def test_initial_template_and_header_are_the_quoted_strings():
    assert lp.INITIAL_TEMPLATE == EX["initial_template"]
    assert lp.HEADER == EX["header"] == lp.DEFAULT_IMPORTS


def test_initial_prompt_478():
    assert lp.formal_statement(EX["lean4_code_478"]) == EX["lean4_code_478"]
    assert lp.initial_prompt(EX["lean4_code_478"]) == EX["user_content_478"]
    assert lp.initial_messages(EX["lean4_code_478"]) == [{"role": "user", "content": EX["user_content_478"]}]


def test_rendered_prompt_478_stock_qwen3():
    assert lp.render_qwen3(lp.initial_messages(EX["lean4_code_478"])) == EX["rendered_prompt_478"]


def test_extrac_code_and_full_code_478():
    assert lp.goedel_extrac_code(EX["model_output_478"]) == EX["extrac_code_478"]
    assert lp.goedel_full_code(EX["lean4_code_478"], EX["model_output_478"]) == EX["full_code_478"]
    assert lp.full_code(EX["lean4_code_478"], EX["model_output_478"]) == (EX["full_code_478"], None)


def test_compile_view_478():
    assert lp.compile_view(EX["full_code_478"]) == EX["compiled_code_478"]


def test_error_str_478():
    assert lp.get_error_str(EX["compiled_code_478"], EX["repl_errors_478"], True) == EX["error_str_478"]


def test_truncation_example():
    code = "\n".join(f"L{i}" if i % 2 else f"  L{i}" for i in range(1, 21))
    errors = [{"severity": "error", "pos": {"line": 2, "column": 1}, "endPos": {"line": 12, "column": 2}, "data": "long"}]
    errors += [
        {"severity": "error", "pos": {"line": 1, "column": 0}, "endPos": {"line": 1, "column": 2}, "data": f"e{k}"}
        for k in range(9)
    ]
    head, tail = json.loads(EX["truncation_example_partial"]).split(" ... (errors 3-8 alike, e1..e6) ...\n")
    middle = "".join(
        f"\nError {k + 2}:\n\nCorresponding Code:\n```lean4\n<error>L1</error>\n  L2\n\n```\n\nError Message: e{k}\n"
        for k in range(1, 7)
    )
    assert lp.get_error_str(code, errors, True) == head + middle + tail


def test_feedback_and_rendered_correction_478():
    err = lp.get_error_str(EX["compiled_code_478"], EX["repl_errors_478"])
    assert lp.correction_feedback(err, 1) == EX["feedback_round1_478"]
    msgs = lp.correction_messages(lp.initial_messages(EX["lean4_code_478"]), EX["model_output_478"], err, 1)
    assert [m["role"] for m in msgs] == ["user", "assistant", "user"]
    rendered = lp.render_qwen3(msgs)
    assert rendered == EX["rendered_prompt_478"] + EX["rendered_correction_tail_478"]


# --- extraction edge cases (goedel.md 1.4 table) --------------------------------------------------------------------


@pytest.mark.parametrize(
    "output,expected",
    [
        ("```lean4\nA\n```\n```lean4\nB\n```", "B"),
        ("```lean4\nA```", "A"),
        ("```lean\nA\n```", "A\n"),
        ("```lean4 \nA\n```", None),
        ("```lean4\nA\n```x```lean4\nB", "A"),
        ("no fence", None),
        ("<think>```lean4\nT\n```</think>", "T"),
    ],
)
def test_extract_block_edge_cases(output, expected):
    assert lp.extract_block(output) == expected
    assert lp.goedel_extrac_code(output) == ("None" if expected is None else lp.HEADER + expected)


def test_full_code_error_strings_and_reasons():
    stmt = EX["lean4_code_478"]
    assert lp.full_code(stmt, "none") == (None, "no_code_block")
    assert lp.goedel_full_code(stmt, "none") == "None"
    out = "```lean4\ntheorem x : True := by\n  exact?\n```"
    assert lp.goedel_full_code(stmt, out) == lp.APPLY_EXACT_ERROR
    assert lp.full_code(stmt, out) == (None, "apply_or_exact_used")
    out = "```lean4\nlemma x : True := by trivial\n```"
    code = lp.goedel_full_code(stmt, out)
    assert code == "**Error**, can not find 'theorem' and ':=' in " + "\n".join(
        ["\n"] + ["-- " + x for x in (lp.HEADER + "lemma x : True := by trivial").split("\n")]
    )
    assert lp.full_code(stmt, out)[1] == "proof_theorem_not_found"
    assert lp.full_code("lemma y : True := by sorry", "```lean4\ntheorem a : b := by\n  c\n```")[1] == (
        "statement_theorem_not_found"
    )


def test_remove_comments_and_sorry_removal():
    assert lp.remove_comments("a -- x\n/- b\n c -/d  \n  /-- doc -/e --") == "a \nd  \n  e"
    # every `sorry` of the statement part is deleted, leaving `by ` with a trailing space
    stmt = "theorem sorry_t (h : sorry = 1) : 1 = 1 := by sorry"
    code = lp.goedel_full_code(stmt, "```lean4\ntheorem sorry_t : 1 = 1 := by\n  rfl\n```")
    assert code == "theorem _t (h :  = 1) : 1 = 1 := by \n  rfl"


def test_helper_theorem_before_main_takes_text_after_helper():
    out = "```lean4\ntheorem helper : True := by\n  trivial\ntheorem main : 1 = 1 := by\n  rfl\n```"
    code = lp.goedel_full_code("theorem main : 1 = 1 := by sorry", out)
    assert code == "theorem main : 1 = 1 := by \n  trivial\ntheorem main : 1 = 1 := by\n  rfl"


def test_compile_view_strips_indented_and_prefix_lines_keeps_blanks():
    code = "import X\n\n  open Foo in\nset_option a 1\ntheorem t := by\n  openX\n\n  simp"
    assert lp.compile_view(code) == "\ntheorem t := by\n\n  simp"


# --- error formatting edge cases -------------------------------------------------------------------------------------


def test_error_str_zero_errors_is_empty_and_feedback_has_four_newlines():
    assert lp.get_error_str("a\nb", []) == ""
    assert "position of the error.\n\n\n\nBefore producing" in lp.correction_feedback("", 1)
    assert lp.correction_feedback("", 2).startswith("The proof (Round 1) is not correct.")


def test_error_str_endpos_null_marks_to_end_of_line_and_context():
    code = "l1\nl2\nl3\nl4\nl5\nabc def\nafter\nlast"
    err = [{"severity": "error", "pos": {"line": 6, "column": 4}, "endPos": None, "data": "m"}]
    s = lp.get_error_str(code, err)
    assert s == "\nError 1:\n\nCorresponding Code:\n```lean4\nl2\nl3\nl4\nl5\nabc <error>def</error>\nafter\n\n```\n\nError Message: m\n"


def test_error_str_unicode_columns_are_code_points():
    code = "theorem t (h₀ : ℝ) := by"
    err = [{"severity": "error", "pos": {"line": 1, "column": 11}, "endPos": {"line": 1, "column": 13}, "data": "d"}]
    assert "theorem t (<error>h₀</error> : ℝ) := by\n" in lp.get_error_str(code, err)


def test_error_str_multiline_without_truncation_and_error_thres_false():
    code = "\n".join(f"x{i}" for i in range(12))
    err = [{"severity": "error", "pos": {"line": 1, "column": 1}, "endPos": {"line": 4, "column": 1}, "data": "d"}]
    assert "x<error>0\nx1\nx2\nx</error>3\nx4\n" in lp.get_error_str(code, err)
    long = [{"severity": "error", "pos": {"line": 1, "column": 0}, "endPos": {"line": 12, "column": 0}, "data": "d"}]
    full = lp.get_error_str(code, long * 10, error_thres=False)
    assert "Truncated" not in full and "Omitted" not in full and full.count("Corresponding Code") == 10
    assert "x7\n" in full


def test_error_str_exactly_eight_errors_has_no_omitted_line():
    err = [{"severity": "error", "pos": {"line": 1, "column": 0}, "endPos": None, "data": "d"}] * 8
    assert "Omitted" not in lp.get_error_str("a", err)
    assert lp.get_error_str("a", err + err[:1]).endswith("\n... [Omitted 1 more errors] ...\n")


def test_error_str_position_outside_code_raises():
    err = [{"severity": "error", "pos": {"line": 3, "column": 0}, "endPos": None, "data": "d"}]
    with pytest.raises(ValueError, match="outside"):
        lp.get_error_str("one line", err)


def test_render_qwen3_drops_history_reasoning_before_last_user():
    msgs = [
        {"role": "user", "content": "u1"},
        {"role": "assistant", "content": "<think>\nplan\n</think>\n\nanswer"},
        {"role": "user", "content": "u2"},
    ]
    assert lp.render_qwen3(msgs) == (
        "<|im_start|>user\nu1<|im_end|>\n<|im_start|>assistant\nanswer<|im_end|>\n"
        "<|im_start|>user\nu2<|im_end|>\n<|im_start|>assistant\n"
    )


def test_reference_verdicts_of_recorded_repl_replies():
    rec = json.loads((FIX / "repl_recorded.json").read_text(encoding="utf-8"))
    v = {k: lp.reference_verdict(r) for k, r in rec.items() if not k.startswith("_")}
    assert (v["incomplete"]["pass"], v["unfinished_tactic_block"]["pass"]) == (False, False)
    assert (v["exact_sorry"]["pass"], v["exact_sorry"]["complete"]) == (True, False)
    assert (v["def_eval_ok"]["pass"], v["def_eval_ok"]["complete"]) == (True, True)
    # the reference quirk: a REPL-level error reply scores as complete
    assert (v["unknown_environment"]["pass"], v["unknown_environment"]["complete"]) == (True, True)
    warn_failed = {"messages": [{"severity": "warning", "pos": {"line": 1, "column": 0}, "endPos": None, "data": "x failed"}]}
    assert lp.reference_verdict(warn_failed)["complete"] is False


def test_correction_round_must_be_positive():
    with pytest.raises(ValueError, match="round"):
        lp.correction_feedback("", 0)


def test_fidelity_without_reference_fails_clearly(tmp_path):
    r = subprocess.run(
        [sys.executable, str(EXTRAS / "lean_prompts.py"), "fidelity", "--model", "m", "--out", str(tmp_path / "r.json")],
        capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin"},
    )
    assert r.returncode == 2 and "--reference-src" in r.stderr
    assert not (tmp_path / "r.json").exists()


def test_lean_prompts_is_stdlib_only():
    code = (
        "import sys, importlib.util as u\n"
        f"s = u.spec_from_file_location('lp', {str(EXTRAS / 'lean_prompts.py')!r}); m = u.module_from_spec(s)\n"
        "s.loader.exec_module(m)\n"
        "bad = [k for k in sys.modules if k.split('.')[0] in ('torch','vllm','transformers','numpy','align')]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
