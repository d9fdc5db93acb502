"""Contract tests of the stdlib-only half of the Lean driver (lean_prompts.py + lean_gen.py's pure functions).

Runs from the align venv: nothing here imports vllm. The quoted examples are the JSON literals of
Goedel-Prover-V2's src/utils.py @ 2e9036e (recorded in tests/lean_fixtures/goedel_examples.json), produced by
running the reference Goedel-Prover-V2 functions; every one must be reproduced byte for byte.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers_lean import load_script

ROOT = Path(__file__).resolve().parents[1]
# ALIGN_LEAN_EXTRAS points the suite at a mutated copy (tests/lean_fixtures/mutants.py)
EXTRAS = Path(os.environ.get("ALIGN_LEAN_EXTRAS", ROOT / "extras" / "vllm_rollout"))
FIX = Path(__file__).resolve().parent / "lean_fixtures"


def _load(name: str):
    return load_script(EXTRAS / f"{name}.py")


lp = _load("lean_prompts")
EX = json.loads((FIX / "goedel_examples.json").read_text(encoding="utf-8"))


# --- quoted reference examples, byte for byte ----------------------------------------------------------------------


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
    errors = [
        {"severity": "error", "pos": {"line": 2, "column": 1}, "endPos": {"line": 12, "column": 2}, "data": "long"}
    ]
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


# --- extraction edge cases (src/utils.py extrac_code) -----------------------------------------------------------------


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
    code = "import X\n\n  open Foo in\nset_option a 1\ntheorem t := by\n  openX\n   import Y\n\n  simp"
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
    assert (
        s
        == "\nError 1:\n\nCorresponding Code:\n```lean4\nl2\nl3\nl4\nl5\nabc <error>def</error>\nafter\n\n```\n\nError Message: m\n"
    )


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
    warn_failed = {
        "messages": [{"severity": "warning", "pos": {"line": 1, "column": 0}, "endPos": None, "data": "x failed"}]
    }
    assert lp.reference_verdict(warn_failed)["complete"] is False


def test_correction_round_must_be_positive():
    with pytest.raises(ValueError, match="round"):
        lp.correction_feedback("", 0)


def test_fidelity_without_reference_fails_clearly(tmp_path):
    r = subprocess.run(
        [
            sys.executable,
            str(EXTRAS / "lean_prompts.py"),
            "fidelity",
            "--model",
            "m",
            "--out",
            str(tmp_path / "r.json"),
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin"},
    )
    assert r.returncode == 2 and "--reference-src" in r.stderr
    assert not (tmp_path / "r.json").exists()


def _check_stdlib_only(*scripts: str) -> None:
    """Importing ``scripts`` (files of EXTRAS, by stem) in a fresh interpreter loads no torch, vLLM, transformers or
    numpy, and of align only ``align.errors`` and the Lean verifier (``align.lean``)."""
    load = "s = u.spec_from_file_location({!r}, {!r}); s.loader.exec_module(u.module_from_spec(s))\n"
    loads = "".join(load.format(n, str(EXTRAS / f"{n}.py")) for n in scripts)
    code = (
        "import sys, importlib.util as u\n"
        + loads
        + "bad = [k for k in sys.modules if k.split('.')[0] in ('torch','vllm','transformers','numpy')\n"
        "       or (k.split('.')[0] == 'align' and k not in ('align', 'align.errors', 'align.child', 'align.lean')\n"
        "           and not k.startswith('align.lean.'))]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_lean_prompts_is_stdlib_only():
    _check_stdlib_only("lean_prompts")


# --- lean_gen pure half ------------------------------------------------------------------------------------------------

lr = _load("lean_records")  # files, plan and records (the stdlib half lean_gen imports)
lg = _load("lean_gen")
pgv = _load("pipeline_gen_verify")
STMT = EX["lean4_code_478"]


def _problems(tmp_path, rows):
    p = tmp_path / "problems.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(p)


def test_derive_seed_is_stable_distinct_and_cap_free():
    s = lr.derive_seed(0, "p", 0, 0)
    assert s == lr.derive_seed(0, "p", 0, 0) and 0 <= s < 2**31
    others = {
        lr.derive_seed(1, "p", 0, 0),
        lr.derive_seed(0, "q", 0, 0),
        lr.derive_seed(0, "p", 1, 0),
        lr.derive_seed(0, "p", 0, 1),
    }
    assert s not in others and len(others) == 4


def test_load_problems_skips_and_errors(tmp_path):
    rows = [
        {"name": "a", "lean4_code": "theorem a : 1 = 1 := by\n"},
        {"name": "b", "lean4_code": "theorem b : True"},
        {"name": "c", "lean4_code": ""},
    ]
    probs, skips = lr.load_problems(_problems(tmp_path, rows))
    assert probs["a"]["lean4_code"] == "theorem a : 1 = 1 := by sorry"
    assert [(s["problem_id"], s["reason"]) for s in skips] == [("b", "no_by_marker"), ("c", "no_lean4_code")]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"name": "a", "lean4_code": "x := by"}\n{not json\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not valid JSON"):
        lr.load_problems(str(bad))
    with pytest.raises(ValueError, match="duplicate problem id"):
        lr.load_problems(_problems(tmp_path, [rows[0], rows[0]]))
    with pytest.raises(ValueError, match="no problem id"):
        lr.load_problems(_problems(tmp_path, [{"lean4_code": "x := by"}]))


def test_minif2f_round0_plan_matches_reference_ids():
    data = Path(__file__).resolve().parent / "data" / "minif2f_test.jsonl"  # shipped; see tests/data/NOTICE.md
    probs, skips = lr.load_problems(str(data))
    assert len(probs) == 244 and not skips
    items = lr.plan_round0(probs, 2, 0)
    assert len(items) == 488 and items[0]["sample_id"] == "mathd_algebra_478_g0"
    assert items[0]["messages"] == [{"role": "user", "content": EX["user_content_478"]}]
    assert len({it["seed"] for it in items}) == 488


def _gen(sid, pid, rnd, text="out", tokens=10, lineage=None, messages=None):
    lineage = lineage or [sid]
    return {
        "sample_id": sid,
        "problem_id": pid,
        "round": rnd,
        "completion_text": text,
        "completion_tokens": tokens,
        "messages": messages or lp.initial_messages(STMT),
        "trajectory": {"lineage": lineage, "cumulative_completion_tokens": tokens},
    }


def _verif(sid, pid, accepted=False, errors=None, code=EX["compiled_code_478"]):
    return {"sample_id": sid, "problem_id": pid, "accepted": accepted, "repl_errors": errors, "repl_code": code}


PROBS = {"p": {"problem_id": "p", "lean4_code": STMT}, "q": {"problem_id": "q", "lean4_code": STMT}}


def test_plan_corrections_builds_goedel_history_and_ids():
    gen = [_gen("p_g0", "p", 0, text=EX["model_output_478"]), _gen("p_g1", "p", 0)]
    ver = [_verif("p_g0", "p", errors=EX["repl_errors_478"]), _verif("p_g1", "p", errors=EX["repl_errors_478"])]
    items, skips = lr.plan_corrections(PROBS, 1, 2, 0, [(ver, gen)])
    assert [it["sample_id"] for it in items] == ["p_g0_corr1_g0", "p_g0_corr1_g1", "p_g1_corr1_g0", "p_g1_corr1_g1"]
    assert [it["sample_idx"] for it in items] == [0, 1, 2, 3] and not skips
    assert items[0]["messages"][1:] == [
        {"role": "assistant", "content": EX["model_output_478"]},
        {"role": "user", "content": EX["feedback_round1_478"]},
    ]
    assert items[0]["lineage"] == ["p_g0", "p_g0_corr1_g0"] and items[0]["ancestor_tokens"] == 10
    assert len({it["seed"] for it in items}) == 4


def test_plan_corrections_skip_reasons_are_counted():
    gen = [
        _gen("p_g0", "p", 0),
        _gen("p_g1", "p", 0),
        _gen("q_g0", "q", 0),
        _gen("q_g1", "q", 0),
        _gen("q_g2", "q", 0),
        _gen("q_g3", "q", 0),
    ]
    ver = [
        _verif("p_g0", "p", accepted=True),
        _verif("p_g1", "p", errors=[{"x": 1}]),
        _verif("q_g0", "q", errors=None),
        _verif("q_g1", "q", errors=[]),
        _verif("zz_g0", "zz", errors=[]),
        _verif(
            "q_g3", "q", errors=[{"severity": "error", "pos": {"line": 99, "column": 0}, "endPos": None, "data": ""}]
        ),
    ]
    items, skips = lr.plan_corrections(PROBS, 1, 1, 0, [(ver, gen)])
    reasons = {s.get("parent_id"): s["reason"] for s in skips}
    assert reasons == {
        "p_g1": "solved",
        "q_g0": "no_repl_errors",
        "q_g1": "skipped_no_feedback",
        "zz_g0": "parent_not_found",
        "q_g2": "not_verified",
        "q_g3": "bad_repl_errors",
    }
    assert items == []
    items, skips = lr.plan_corrections(PROBS, 1, 1, 0, [(ver, gen)], policy="resample", repair_solved=True)
    assert {it["parent_id"]: it["kind"] for it in items} == {"q_g1": "resample"}
    assert items[0]["messages"] == lp.initial_messages(STMT)
    items, _ = lr.plan_corrections(PROBS, 1, 1, 0, [(ver, gen)], policy="goedel")
    assert items[0]["messages"][-1]["content"] == lp.correction_feedback("", 1)


def test_plan_corrections_all_parents_missing_is_an_error():
    with pytest.raises(ValueError, match="none of the verification"):
        lr.plan_corrections(PROBS, 1, 1, 0, [([_verif("x_g0", "x", errors=[])], [_gen("p_g0", "p", 0)])])
    with pytest.raises(ValueError, match="round >= 1"):
        lr.plan_corrections(PROBS, 0, 1, 0, [])


def test_round2_lineage_partial_without_earlier_pairs_and_cap_refuses():
    r0 = _gen("p_g0", "p", 0, tokens=100)
    r1 = _gen("p_g0_corr1_g0", "p", 1, tokens=50, lineage=["p_g0", "p_g0_corr1_g0"])
    r1["trajectory"]["cumulative_completion_tokens"] = 150
    v1 = [_verif("p_g0_corr1_g0", "p", errors=EX["repl_errors_478"])]
    full, _ = lr.plan_corrections(
        PROBS, 2, 1, 0, [([_verif("p_g0", "p", errors=[])], [r0]), (v1, [r1])], trajectory_cap=400
    )
    assert full[0]["lineage_state"] == "complete" and full[0]["ancestor_tokens"] == 150
    assert full[0]["lineage"] == ["p_g0", "p_g0_corr1_g0", "p_g0_corr1_g0_corr2_g0"]
    part, _ = lr.plan_corrections(PROBS, 2, 1, 0, [(v1, [r1])])
    assert part[0]["lineage_state"] == "partial"
    with pytest.raises(ValueError, match="partial"):
        lr.plan_corrections(PROBS, 2, 1, 0, [(v1, [r1])], trajectory_cap=400)


def test_token_budget_cap_context_and_trajectory():
    assert lr.token_budget(16384, 40960, 500) == {
        "max_tokens": 16384,
        "context_clipped": False,
        "budget_clipped": False,
    }
    assert lr.token_budget(40960, 40960, 500) == {"max_tokens": 40460, "context_clipped": True, "budget_clipped": False}
    assert lr.token_budget(100, 1000, 750)["max_tokens"] == 100
    assert lr.token_budget(500, 1000, 500) == {"max_tokens": 500, "context_clipped": False, "budget_clipped": False}
    assert lr.token_budget(100, 1000, 751) is None  # the reference's 3/4 prompt filter
    assert lr.token_budget(100, 1000, 10, 950, 1000) == {
        "max_tokens": 50,
        "context_clipped": False,
        "budget_clipped": True,
    }
    assert lr.token_budget(100, 1000, 10, 1000, 1000) is None


def test_resume_split_and_foreign_records():
    planned = [{"sample_id": s} for s in ("a", "b", "c")]
    todo, done = lr.resume_split(planned, [{"sample_id": "b"}])
    assert [t["sample_id"] for t in todo] == ["a", "c"] and done == {"b"}
    assert lr.resume_split(planned, [{"sample_id": s} for s in "abc"])[0] == []
    with pytest.raises(ValueError, match="not in this plan"):
        lr.resume_split(planned, [{"sample_id": "z"}])


def test_read_jsonl_repairs_only_an_unterminated_tail(tmp_path):
    p = tmp_path / "o.jsonl"
    p.write_text('{"sample_id": "a"}\n{"sample_id": "b"', encoding="utf-8")
    assert [r["sample_id"] for r in lr.read_jsonl(str(p), repair_tail=True)] == ["a"]
    assert p.read_text() == '{"sample_id": "a"}\n'
    p.write_text('{"sample_id": "a"}\n{"sample_id"\n', encoding="utf-8")
    with pytest.raises(ValueError, match="o.jsonl:2"):
        lr.read_jsonl(str(p), repair_tail=True)


def test_make_record_fields_and_ledger():
    item = lr.plan_round0({"p": PROBS["p"]}, 1, 0)[0]
    budget = lr.token_budget(64, 1000, 3)
    rec = lr.make_record(
        item,
        prompt_ids=[1, 2, 3],
        completion_ids=[5, 6, 2],
        completion_text=EX["model_output_478"],
        finish_reason="stop",
        budget=budget,
        cap_tokens=64,
        sampling={"temperature": 1.0, "top_p": 0.95},
        model_rev="m@x",
        adapter=None,
        trajectory_cap=None,
        session=0,
    )
    assert rec["lean_code"] == EX["full_code_478"] and rec["lean_code_error"] is None
    assert rec["sampling"] == {"temperature": 1.0, "top_p": 0.95, "max_tokens": 64, "seed": item["seed"]}
    assert rec["completion_ids"][-1] == 2 and rec["messages"] == lp.initial_messages(STMT)
    assert rec["trajectory"]["root_id"] == "p_g0" and rec["trajectory"]["cumulative_completion_tokens"] == 3
    child = dict(
        rec,
        sample_id="p_g0_corr1_g0",
        round=1,
        trajectory=dict(rec["trajectory"], cumulative_completion_tokens=9, truncated=True),
    )
    ledger = lr.build_trajectory_ledger(
        [rec, child], [{"sample_id": "p_g0"}, {"sample_id": "p_g0_corr1_g0", "accepted": True}]
    )
    assert ledger["p_g0"] == {
        "root_id": "p_g0",
        "problem_id": "p",
        "samples": 2,
        "max_round": 1,
        "max_cumulative_tokens": 9,
        "truncated": 1,
        "budget_clipped": 0,
        "solved_round": 1,
        "lineage_state": "complete",
        "state": "solved",
    }
    assert lr.build_trajectory_ledger([rec], [])["p_g0"]["state"] == "unverified"
    kid = dict(item, sample_id="p_g0_corr1_g0", ancestor_tokens=3, lineage=["p_g0", "p_g0_corr1_g0"])
    krec = lr.make_record(
        kid,
        prompt_ids=[1],
        completion_ids=[7, 8],
        completion_text="",
        finish_reason="length",
        budget=budget,
        cap_tokens=64,
        sampling={},
        model_rev="m",
        adapter=None,
        trajectory_cap=10,
        session=1,
    )
    assert krec["trajectory"]["cumulative_completion_tokens"] == 5 and krec["trajectory"]["truncated"] is True
    assert krec["trajectory"]["ancestor_completion_tokens"] == 3 and krec["trajectory"]["cap_tokens"] == 10
    assert lr.build_trajectory_ledger([rec], [{"sample_id": "p_g0"}])["p_g0"]["state"] == "failed"


def test_max_model_len_above_model_limit_raises(tmp_path):
    (tmp_path / "config.json").write_text('{"max_position_embeddings": 40960}')
    assert lg.resolve_max_model_len(None, lg.model_max_len(str(tmp_path))) == 40960
    with pytest.raises(ValueError, match="above the model's position limit 40960"):
        lg.resolve_max_model_len(40961, 40960)


def test_adapter_sha_and_model_rev(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"x")
    a = tmp_path / "ad"
    a.mkdir()
    (a / "w").write_bytes(b"1")
    sha = lg.sha256_dir(str(a))
    (a / "w").write_bytes(b"2")
    assert lg.sha256_dir(str(a)) != sha
    rev = lg.model_rev(str(tmp_path), sha)
    assert rev.endswith(f"+lora-{sha[:12]}") and "@" in rev


def test_lock_is_exclusive(tmp_path):
    fd = lg.acquire_lock(str(tmp_path / "l"), False, "heavy-GPU lock")
    with pytest.raises(RuntimeError, match="held by another launch"):
        lg.acquire_lock(str(tmp_path / "l"), False, "heavy-GPU lock")
    os.close(fd)
    os.close(lg.acquire_lock(str(tmp_path / "l"), False, "heavy-GPU lock"))


def test_cli_usage_errors_exit_2():
    for argv in (
        ["--problems", "p", "--out", "o", "--cap-tokens", "8", "--round", "1"],
        ["--problems", "p", "--out", "o", "--cap-tokens", "0"],
    ):
        with pytest.raises(SystemExit) as e:
            lg.parse_args(argv)
        assert e.value.code == 2


@pytest.mark.parametrize("value", ["inf", "nan", "0", "-5", "soon"])
def test_pipeline_timeouts_must_be_finite_seconds(value, capsys):
    base = ["--problems", "p", "--workdir", "w", "--cap-tokens", "8"]
    for flag in ("--repl-timeout", "--import-timeout", "--gpu-drain-timeout"):
        with pytest.raises(SystemExit) as e:
            pgv.parse_args([*base, flag, value])
        assert e.value.code == 2 and flag in capsys.readouterr().err
    assert pgv.parse_args([*base, "--repl-timeout", "2.5"]).repl_timeout == 2.5  # control


def test_lean_gen_pure_half_is_stdlib_only():
    _check_stdlib_only("lean_gen", "pipeline_gen_verify")


# --- verification against the recorded-REPL stand-in (no Lean here) ----------------------------------------------------


@pytest.fixture(scope="module")
def repl():
    cmd = f"{sys.executable} {EXTRAS / 'lean_repl_standin.py'} --replies {FIX / 'standin_replies.json'}"
    r = pgv.Repl(cmd, None, timeout=30, import_timeout=30)
    yield r
    r.close()


def _rec(text, sid="p_g0"):
    code, err = lp.full_code(STMT, text)
    return {
        "sample_id": sid,
        "problem_id": "mathd_algebra_478",
        "round": 0,
        "lean4_code": STMT,
        "completion_text": text,
        "lean_code": code,
        "lean_code_error": err,
    }


def _proof(body):
    return "```lean4\n" + STMT.replace(":= by sorry", ":= by\n" + body) + "\n```"


def test_verify_accepts_a_clean_proof(repl):
    v = pgv.verify_record(_rec(_proof("  norm_num")), repl, pgv.STANDARD_AXIOMS)
    assert v["accepted"] and v["reasons"] == [] and v["axioms"] == list(pgv.STANDARD_AXIOMS)
    assert v["repl_code"] == lp.compile_view(v["repl_code"]) and v["repl_errors"] == []


def test_verify_guards_beyond_the_reference(repl):
    def verdict(text, **kw):
        rec = _rec(text)
        rec.update(kw)
        return pgv.verify_record(rec, repl, pgv.STANDARD_AXIOMS)

    v = verdict(_proof("  norm_num\n  all_goals admit"))
    assert not v["accepted"] and "uses_sorry_or_admit" in v["reasons"] and v["reference"]["complete"]
    v = verdict(_proof("  norm_num\naxiom cheat_ax : False"))
    assert "adds_axiom" in v["reasons"] and not v["accepted"]
    v = verdict(_proof("  norm_num -- UNKNOWN_ENV"))
    v2 = verdict(_proof("  norm_num\n  UNKNOWN_ENV"))
    assert v["accepted"] and not v2["accepted"] and v2["reference"]["complete"] and "repl_level_error" in v2["reasons"]
    assert v2["repl_errors"] is None
    changed = _rec(_proof("  norm_num"))
    changed["lean_code"] = changed["lean_code"].replace("v = 65", "v = v")
    v = pgv.verify_record(changed, repl, pgv.STANDARD_AXIOMS)
    assert "statement_changed" in v["reasons"] and not v["accepted"]
    v = verdict(_proof("  sorry"))
    assert v["reference"] == {"pass": True, "complete": False} and not v["accepted"]
    cheat = _rec(_proof("  norm_num"))
    cheat["lean4_code"] = cheat["lean4_code"].replace("mathd_algebra_478", "cheat")
    cheat["lean_code"] = lp.full_code(cheat["lean4_code"], _proof("  norm_num").replace("mathd_algebra_478", "cheat"))[
        0
    ]
    v = pgv.verify_record(cheat, repl, pgv.STANDARD_AXIOMS)
    assert v["reasons"] == ["nonstandard_axioms:myAxiom"] and not v["accepted"]


def test_verify_no_code_sends_the_reference_none_and_keeps_feedback(repl):
    v = pgv.verify_record(_rec("no code here"), repl, pgv.STANDARD_AXIOMS)
    assert v["repl_code"] == "None" and not v["accepted"]
    assert v["reasons"][0] == "no_lean_code:no_code_block" and len(v["repl_errors"]) == 2
    assert "<error>" in lp.get_error_str(v["repl_code"], v["repl_errors"])


def test_repl_timeout_and_eof_are_system_errors(tmp_path):
    with pytest.raises(pgv.ReplError, match="EOF"):
        pgv.Repl("true", None, timeout=5, import_timeout=5)
    wrong = 'sh -c \'printf "{\\"env\\": 3}\\n\\n"; cat >/dev/null\''
    with pytest.raises(pgv.ReplError, match="did not create env 0"):
        pgv.Repl(wrong, None, timeout=5, import_timeout=5)
    with pytest.raises(pgv.ReplError, match="TIMEOUT"):
        pgv.Repl("sleep 30", None, timeout=1, import_timeout=1)


# --- records read back: types, duplicates, encodings (issue 19 "Lean driver records") ---------------------------------


def _jsonl_file(tmp_path, name, rows):
    p = tmp_path / name
    p.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return str(p)


def test_problems_file_that_is_not_utf8_names_the_file(tmp_path):
    p = tmp_path / "latin1.jsonl"
    p.write_bytes(b'{"name": "a", "lean4_code": "theorem a : 1 = 1 := by\\n"}\n{"name": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=r"latin1.jsonl:2: not UTF-8 text .*save the file as UTF-8"):
        lr.load_problems(str(p))


@pytest.mark.parametrize(
    ("row", "why"),
    [
        (
            {"sample_id": "p_g0", "problem_id": "p", "accepted": "false"},
            r"'accepted' is \"false\" \(str\), expected bool",
        ),
        ({"sample_id": "p_g0", "problem_id": "p", "accepted": 1}, r"'accepted' is 1 \(int\), expected bool"),
        ({"problem_id": "p", "accepted": False}, r"no 'sample_id' field"),
        ({"sample_id": 7, "problem_id": "p", "accepted": False}, r"'sample_id' is 7 \(int\), expected str"),
        ({"sample_id": "p_g0", "problem_id": "p", "accepted": False, "repl_errors": "x"}, r"'repl_errors' is \"x\""),
    ],
)
def test_verification_record_types_are_checked_naming_file_and_line(tmp_path, row, why):
    path = _jsonl_file(tmp_path, "verif.jsonl", [_verif("q_g0", "q"), row])
    with pytest.raises(ValueError, match=r"verif.jsonl:2: not a valid verif record: " + why):
        lr.load_records(path, "verif")


def test_generation_record_types_are_checked(tmp_path):
    path = _jsonl_file(tmp_path, "gen.jsonl", [_gen("p_g0", "p", True)])
    with pytest.raises(ValueError, match=r"gen.jsonl:1: .*'round' is true \(bool\), expected int"):
        lr.load_records(path, "gen")


def test_repeated_records_identical_are_dropped_conflicting_are_refused(tmp_path):
    a, b = _verif("p_g0", "p", errors=[]), _verif("p_g1", "p", errors=[])
    rows, dropped = lr.load_records(_jsonl_file(tmp_path, "v.jsonl", [a, b, {**a, "verify_time": 9.0}]), "verif")
    assert [r["sample_id"] for r in rows] == ["p_g0", "p_g1"] and dropped == 1
    bad = _jsonl_file(tmp_path, "v2.jsonl", [a, b, {**a, "accepted": True}])
    with pytest.raises(ValueError, match=r"v2.jsonl:3: sample_id 'p_g0' repeats line 1 with different accepted"):
        lr.load_records(bad, "verif")


def test_plan_corrections_refuses_string_accepted_and_conflicts_across_files():
    gen = [_gen("p_g0", "p", 0), _gen("p_g1", "p", 0)]
    # "accepted": "false" was truthy: the problem counted as solved and its failures were never corrected
    ver = [_verif("p_g0", "p", accepted="false", errors=EX["repl_errors_478"])]
    with pytest.raises(ValueError, match=r"'accepted' is \"false\" \(str\), expected bool"):
        lr.plan_corrections(PROBS, 1, 1, 0, [(ver, gen)])
    v0 = _verif("p_g0", "p", errors=EX["repl_errors_478"])
    with pytest.raises(ValueError, match=r"sample_id 'p_g0' appears twice .* different accepted"):
        lr.plan_corrections(PROBS, 1, 1, 0, [([v0], gen), ([{**v0, "accepted": True}], gen)])
    items, _ = lr.plan_corrections(PROBS, 1, 1, 0, [([v0], gen), ([v0], gen)])  # the same pair twice: harmless
    assert [it["parent_id"] for it in items] == ["p_g0"]


def test_resume_keeps_each_samples_first_record_and_rewrites_the_file(tmp_path):
    first, other = _gen("p_g0", "p", 0, text="first"), _gen("p_g1", "p", 0)
    again = {**first, "completion_text": "second"}  # a rerun that wrote p_g0 again
    path = _jsonl_file(tmp_path, "out.jsonl", [first, other, again])
    rows = lr.load_out_for_resume(path)
    assert rows == [first, other]
    assert lr.read_jsonl(path) == [first, other]  # the repeat is gone from the file too
    todo, done = lr.resume_split([{"sample_id": s} for s in ("p_g0", "p_g1", "p_g2")], rows)
    assert [t["sample_id"] for t in todo] == ["p_g2"] and len(done) == 2


def test_read_jsonl_keeps_a_complete_last_record_that_lacks_its_newline(tmp_path):
    """Issue 30: a complete last record without a trailing newline was truncated away (and regenerated)."""
    p = tmp_path / "o.jsonl"
    p.write_text('{"sample_id": "a"}\n{"sample_id": "b"}', encoding="utf-8")
    assert [r["sample_id"] for r in lr.read_jsonl(str(p), repair_tail=True)] == ["a", "b"]
    assert p.read_text() == '{"sample_id": "a"}\n{"sample_id": "b"}\n'  # only the newline was added
    p.write_text('{"sample_id": "a"}\n{"sample_id": "b"', encoding="utf-8")  # control: a cut line is dropped
    assert [r["sample_id"] for r in lr.read_jsonl(str(p), repair_tail=True)] == ["a"]
    assert p.read_text() == '{"sample_id": "a"}\n'


def test_resume_changes_nothing_in_out_until_the_launch_checks_pass(tmp_path):
    """Issue 30: --out was repaired (truncated, rewritten) before a launch that then failed its vLLM check."""
    first, other = _gen("p_g0", "p", 0, text="first"), _gen("p_g1", "p", 0)
    out = tmp_path / "out.jsonl"
    data = "".join(json.dumps(r) + "\n" for r in (first, other, {**first, "completion_text": "again"}))
    data += '{"sample_id": "p_g2", "probl'  # a write cut by a kill
    out.write_text(data, encoding="utf-8")
    args = lg.parse_args(["--problems", "x", "--out", str(out), "--cap-tokens", "8"])
    ready = [{"sample_id": s} for s in ("p_g0", "p_g1", "p_g2")]
    todo, done = lg.resume(args, ready)
    assert [t["sample_id"] for t in todo] == ["p_g2"] and done == {"p_g0", "p_g1"}
    assert out.read_text(encoding="utf-8") == data and not Path(f"{out}.skipped.jsonl").exists()  # untouched
    lg.commit_resume(args, [])  # control: once the checks passed, --out is repaired
    assert lr.read_jsonl(str(out)) == [first, other] and Path(f"{out}.skipped.jsonl").exists()
    fresh = tmp_path / "fresh.jsonl"
    lg.resume(lg.parse_args(["--problems", "x", "--out", str(fresh), "--cap-tokens", "8"]), ready)
    assert not fresh.exists()  # not created before the checks either


def test_the_engine_on_a_cpu_never_splits_a_prompt(monkeypatch):
    """``lean_engine.build_engine`` without CUDA: chunked prefill off and a step's token budget covering
    max_model_len (vLLM's CPU runner killed its engine core on a seeded prompt over 2048 tokens after a partial
    prefill: tests/test_spool_cut.py runs that case on the rollout worker). vllm is replaced by a stub that records
    the ``LLM(...)`` arguments; the real engine is started by test_lean_gen_e2e."""
    import argparse
    import types

    got: dict = {}
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=lambda **kw: got.update(kw)))
    le = _load("lean_engine")
    names = ("model", "tokenizer", "tp", "max_num_seqs", "gpu_memory_utilization", "seed", "trust_remote_code")
    args = argparse.Namespace(**dict.fromkeys(names), enforce_eager=True, dtype="float32")
    le.build_engine(args, 40960, None)
    assert got["enable_chunked_prefill"] is False and got["max_num_batched_tokens"] == 40960
    le.build_engine(args, 1024, None)
    assert got["max_num_batched_tokens"] == 2048  # never below vLLM's default budget
