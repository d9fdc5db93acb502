"""The built-in number rewards on GSM8K / MATH-style answer columns: ``#### N``, ``\\boxed{}``, a ``solution``
column, and ``--answer-key``."""

from __future__ import annotations

import pytest

from align.data import to_record
from align.errors import InputError
from align.verifiers import boxed_match, exact_match, final_answer, last_number_match

GSM8K = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nAltogether she sold 48+24 = <<48+24=72>>72 clips.\n#### 72"
MATH = "We have $x = \\frac{3}{4}$, so the answer is $\\boxed{\\frac{3}{4}}$."


@pytest.mark.parametrize(
    ("reward", "completion", "fields", "want"),
    [
        (last_number_match, "She sold 72 clips.", {"answer": GSM8K}, 1.0),
        (last_number_match, "She sold 71 clips.", {"answer": GSM8K}, 0.0),  # negative control
        (last_number_match, "She sold 72 clips.", {"solution": GSM8K}, 1.0),
        (last_number_match, "The answer is \\boxed{72}, from steps 1 and 2", {"answer": "72"}, 1.0),
        (last_number_match, "#### 72\n(checked in 3 steps)", {"answer": "72"}, 1.0),
        (last_number_match, "so 3/4", {"solution": MATH}, 1.0),
        (boxed_match, "\\boxed{72}", {"answer": GSM8K}, 1.0),
        (boxed_match, "\\boxed{0.75}", {"solution": MATH}, 1.0),
        (boxed_match, "\\boxed{0.7}", {"solution": MATH}, 0.0),  # negative control
        (exact_match, "72", {"answer": GSM8K}, 1.0),
        (exact_match, "72", {}, 0.0),  # no answer column at all
    ],
)
def test_number_rewards_read_gsm8k_and_boxed_answers(reward, completion, fields, want):
    assert reward("q", completion, **fields) == want


def test_the_answer_before_this_change_scored_zero():
    # what the issue measured: the last number of '#### 72' as a *reference* was never parsed as a whole solution
    assert final_answer(GSM8K) == "72" and final_answer(MATH) == "\\frac{3}{4}" and final_answer("12") == "12"


def test_answer_key_names_the_column():
    row = {"prompt": "q", "label": "#### 5"}
    rec = to_record(row, "f:1", "prompt", None, answer_key="label")
    assert rec["answer"] == "#### 5" and last_number_match("q", "5", **{k: v for k, v in rec.items() if k != "prompt"})
    with pytest.raises(InputError, match="--answer-key 'gold'.*no such column"):
        to_record(row, "f:1", "prompt", None, answer_key="gold")
    assert "answer" not in to_record(row, "f:1", "prompt", None)  # default: no copy
