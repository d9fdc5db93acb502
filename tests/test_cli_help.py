"""The generated CLI's manners: grouped short ``--help`` / full ``--help-all``, no abbreviations, one-line errors
with the closest flags, and a user file that fails to import reported as one line naming file:line."""

from __future__ import annotations

import pytest

from align.data import InputError
from align.rewards import load_spec
from align.run.fields import _flags
from align.train import CLI_PREFIXES, TrainConfig, main


def run_main(argv: list[str], capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as e:
        main(argv)
    out = capsys.readouterr()
    return e.value.code, out.out, out.err


def every_flag() -> list[str]:
    return [f"--{flag}" for flag, *_ in _flags(TrainConfig, CLI_PREFIXES)]


def test_short_help_is_grouped_and_names_every_flag(capsys):
    code, out, _ = run_main(["--help"], capsys)
    assert code == 0
    assert len(out) < 6000  # the flat help was ~33k characters
    for section in ("run:", "sampling:", "optimizer:", "rollout:", "loss:", "eval:", "envs:"):
        assert f"\n{section}\n" in out, section
    missing = [f for f in every_flag() if f not in out]
    assert missing == []
    assert "--no-spawn-worker" in out  # booleans show both forms


def test_help_all_has_each_flags_help_in_its_section(capsys):
    code, out, _ = run_main(["--help-all"], capsys)
    assert code == 0
    sampling = out.split("\nsampling:\n", 1)[1].split("\n\n", 1)[0]
    assert "--group-size" in sampling and "Completions per prompt" in sampling
    assert "--lr " not in sampling  # negative control: an optimizer flag is not in the sampling group


@pytest.mark.parametrize(
    ("argv", "unknown", "suggested"),
    [
        (["--group", "4"], "--group", "--group-size"),  # an abbreviation is refused, with the full name offered
        (["--max-tokns", "3"], "--max-tokns", "--max-tokens"),
        (["--lr=1e-6", "--eps-hihg", "0.28"], "--eps-hihg", "--eps-high"),
    ],
)
def test_unknown_flag_is_one_line_with_the_closest_flags(capsys, argv, unknown, suggested):
    code, out, err = run_main(argv, capsys)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1, err
    assert unknown.split("=")[0] in err and suggested in err


def test_a_known_flag_parses(capsys):
    from align.run.cli import parse

    cfg = parse(TrainConfig, ["--group-size", "4"], CLI_PREFIXES)  # negative control for the refusals above
    assert cfg.group_size == 4


def test_a_bad_value_is_one_line(capsys):
    code, _, err = run_main(["--steps", "x"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "--steps" in err


@pytest.mark.parametrize(
    ("source", "line", "error"),
    [
        ("import os\n\n\ndef r(prompt, completion):\n    return 1 +\n", 5, "SyntaxError"),
        ("x = 1\nraise RuntimeError('boom')\n", 2, "RuntimeError: boom"),
        ("import os\nimport no_such_module_xyz\n", 2, "ModuleNotFoundError"),
    ],
)
@pytest.mark.parametrize(("flag", "kind"), [("--reward", "function"), ("--env", "Class"), ("--tools", "function")])
def test_a_user_file_that_fails_to_import_is_one_line(tmp_path, source, line, error, flag, kind):
    path = tmp_path / f"user_{line}.py"
    path.write_text(source)
    with pytest.raises(InputError) as e:
        load_spec(f"{path}:r", flag, kind)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(flag) and f"{path}:{line}:" in msg and error in msg, msg


def test_a_good_user_file_loads(tmp_path):
    path = tmp_path / "good.py"
    path.write_text("def r(prompt, completion):\n    return 1.0\n")
    assert load_spec(f"{path}:r")("p", "c") == 1.0


def test_tools_file_failure_is_one_line(tmp_path):
    from align.envs.tools import load_tools

    path = tmp_path / "tools_bad.py"
    path.write_text("def add(a: int, b: int) -> int:\n    return a +\n")
    with pytest.raises(InputError, match=rf"--tools .*{path.name}:2: SyntaxError"):
        load_tools([f"{path}:add"])


@pytest.mark.parametrize(("module", "argv", "first"), [("align.sft", ["--bogus"], "align.sft: error: unknown flag --bogus"),
                                                       ("align.train", ["--help"], "usage: python -m align.train ")])  # fmt: skip
def test_the_cli_names_the_module_it_runs_as(module, argv, first):
    """``python -m align.sft`` errors name ``align.sft`` (argparse's default is the file: ``__main__.py: error``), as
    the run's own error lines do; the usage line is the command to type."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    p = subprocess.run(
        [sys.executable, "-m", module, *argv], capture_output=True, text=True, cwd=root, timeout=120, check=False
    )
    assert (p.stdout + p.stderr).startswith(first), p.stdout[:300] + p.stderr[-300:]
