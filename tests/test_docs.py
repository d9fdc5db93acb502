"""Docs rot: every ``--flag`` and every repo path named in README.md, docs/*.md and extras/vllm_rollout/README.md
exists.

Flags come from the CLIs themselves: the usage block of ``python -m align.train --help`` (the flags generated from
``TrainConfig`` and its nested configs, so a renamed field shows up here) plus every string literal starting with
``--`` passed to ``add_argument`` in the other CLIs (an ``ast`` scan of align/, extras/, scripts/, benchmarks/;
``action=BooleanOptionalAction`` adds the ``--no-`` form), and the keywords of the benchmarks' ``numeric_flags``
calls (``max_tokens=`` is ``--max-tokens``). Flags of external tools are the explicit allow-list
``EXTERNAL_FLAGS``. Paths: a token that starts with a top-level repo directory (``align/``, ``tests/``, ...) or a
relative markdown link target; paths under a run directory (``runs/``, ``{out}/``, ``<out>/``) never match, since
their first component is not a repo directory. Each check has a planted-violation negative control.
"""

from __future__ import annotations

import ast
import functools
import itertools
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "extras" / "vllm_rollout" / "README.md"]
CLI_SOURCES = ("align", "extras", "scripts", "benchmarks")  # every add_argument literal under these is a flag
REPO_DIRS = ("align", "extras", "scripts", "benchmarks", "examples", "tests", "docs", ".ci")

# Flags of tools that are not this repo's, by tool. Keep it small: a flag here is not checked.
EXTERNAL_FLAGS = {
    "torchrun": {
        "--standalone",
        "--nproc-per-node",
        "--nnodes",
        "--node-rank",
        "--rdzv-backend",
        "--rdzv-endpoint",
        "--rdzv-id",
    },
    "ray start": {"--head", "--address"},
    "ruff format": {"--check"},
    "vllm serve": {"--skip-tokenizer-init"},
    "huggingface-cli download": {"--local-dir"},
}

FLAG_RE = re.compile(r"(?<![\w-])--[a-z][a-z0-9]*(?:-[a-z0-9]+)*")
PATH_RE = re.compile(r"(?<![\w./~{}<>$-])(?:" + "|".join(map(re.escape, REPO_DIRS)) + r")/[\w./{},*-]*")
LINK_RE = re.compile(r"\]\(([^)\s]+)\)")


GENERATED_CLIS = ("align.train", "align.sft")  # CLIs whose flags are generated from config dataclasses


@functools.cache
def train_flags() -> frozenset[str]:
    """The flags of ``python -m align.train`` and ``python -m align.sft``, read from their ``--help``."""
    return frozenset().union(*(help_flags(m) for m in GENERATED_CLIS))


def help_flags(module: str) -> frozenset[str]:
    """The flags of ``python -m MODULE``, read from its ``--help`` (the generated parser): usage and option lines."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    out = subprocess.run(
        [sys.executable, "-m", module, "--help"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, f"python -m {module} --help failed:\n{out.stderr[-2000:]}"
    usage, options = out.stdout.split("\n\n", 1)  # the usage block lists every flag but -h / --help
    invocations = re.findall(r"^  (-\S.*?)(?:  |$)", options, flags=re.MULTILINE)  # "  --adv-refill, --no-adv-refill"
    return frozenset(re.findall(r"--[a-z0-9][a-z0-9-]*", usage + "\n" + "\n".join(invocations)))


def add_argument_flags(source: str) -> set[str]:
    """Every ``--flag`` string literal passed to an ``add_argument`` call in ``source`` (+ ``--no-`` forms), and the
    flag of every keyword of a ``numeric_flags`` call (``benchmarks/common.py``)."""
    flags = set()
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        fn = node.func
        name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", None)
        if name == "numeric_flags":
            flags.update("--" + kw.arg.replace("_", "-") for kw in node.keywords if kw.arg)
        if name != "add_argument":
            continue
        names = [a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("--")]
        flags.update(names)
        for kw in node.keywords:
            action = kw.value
            action_name = action.attr if isinstance(action, ast.Attribute) else getattr(action, "id", None)
            if kw.arg == "action" and action_name == "BooleanOptionalAction":
                flags.update("--no-" + n[2:] for n in names)
    return flags


@functools.cache
def source_flags() -> frozenset[str]:
    flags: set[str] = set()
    for top in CLI_SOURCES:
        for f in sorted((ROOT / top).rglob("*.py")):
            flags |= add_argument_flags(f.read_text())
    return frozenset(flags)


def known_flags() -> set[str]:
    return set(train_flags()) | set(source_flags()) | set().union(*EXTERNAL_FLAGS.values())


def unknown_flags(text: str, known: set[str]) -> list[str]:
    return sorted(set(FLAG_RE.findall(text)) - known)


def expand_braces(path: str) -> list[str]:
    """``a/{b,c}.py`` -> ``a/b.py``, ``a/c.py`` (every group expanded)."""
    parts = re.split(r"\{([^{}]*)\}", path)
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(c) for c in itertools.product(*choices)]


def tree_paths(text: str) -> list[str]:
    """The paths of a "## File structure" block: a line at column 0 names a top-level file or opens a directory
    (``align/``), each indented line names a file in the directory opened last (``  run/config.py  comment``)."""
    m = re.search(r"^## File structure\n+```\n(.*?)\n```", text, flags=re.DOTALL | re.MULTILINE)
    paths, base = [], ""
    for line in m.group(1).splitlines() if m else []:
        name = line.split()[0]
        if line.startswith(" "):
            paths.append(base + name)
        else:
            base = name if name.endswith("/") else ""
            paths.append(name)
    return paths


def missing_paths(text: str, md_file: Path) -> list[str]:
    """Repo paths named in ``text`` (of ``md_file``) that do not exist: repo-rooted tokens, relative links and the
    file tree."""
    named = [(m.rstrip(".,;"), ROOT) for m in PATH_RE.findall(text)] + [(p, ROOT) for p in tree_paths(text)]
    for target in LINK_RE.findall(text):
        target = target.split("#", 1)[0]
        if target and not re.match(r"[a-z]+:", target):  # http:, https:, mailto: are not repo paths
            named.append((target, md_file.parent))
    missing = []
    for path, base in named:
        for p in expand_braces(path):
            if not (any(base.glob(p)) if "*" in p else (base / p).exists()):
                missing.append(p)
    return sorted(set(missing))


def test_docs_are_found():
    names = {p.relative_to(ROOT).as_posix() for p in DOCS}
    assert {"README.md", "docs/eval.md", "extras/vllm_rollout/README.md"} <= names
    assert all(p.is_file() for p in DOCS)


def test_every_flag_named_in_the_docs_exists():
    known = known_flags()
    bad = {p.relative_to(ROOT).as_posix(): unknown_flags(p.read_text(), known) for p in DOCS}
    assert {k: v for k, v in bad.items() if v} == {}


def test_negative_control_unknown_flag_is_caught():
    known = known_flags()
    # The collection is not vacuous: a generated TrainConfig flag, its --no- form, and a worker flag from the scan.
    assert {"--rollout-gpu", "--no-spawn-worker", "--eval-max-in-flight"} <= train_flags()
    assert {"--from-verified", "--train-on", "--per-problem-k"} <= help_flags("align.sft")
    assert {"--logprobs-mode", "--no-enforce-eager", "--corrections-from"} <= source_flags()
    assert {"--decode-tokens", "--latency-requests"} <= source_flags()  # numeric_flags keywords (benchmarks)
    readme = (ROOT / "README.md").read_text()
    planted = readme + "\nRun it with `--rollout-gpus 1` and `--no-such-flag`.\n"
    assert set(unknown_flags(planted, known)) - set(unknown_flags(readme, known)) == {
        "--no-such-flag",
        "--rollout-gpus",
    }


def test_every_repo_path_named_in_the_docs_exists():
    bad = {p.relative_to(ROOT).as_posix(): missing_paths(p.read_text(), p) for p in DOCS}
    assert {k: v for k, v in bad.items() if v} == {}


def test_negative_control_missing_path_is_caught():
    doc = ROOT / "docs" / "overview.md"
    text = doc.read_text()
    planted = (
        text
        + "\nSee `align/no_such_module.py:12`, `align/rollout/{native,nope}.py`, [gone](no_such_page.md)"
        + " and `tests/test_nothing*.py`; `runs/x/align/y.py` and `{out}/checkpoints/` are run paths.\n"
    )
    assert set(missing_paths(planted, doc)) - set(missing_paths(text, doc)) == {
        "align/no_such_module.py",
        "align/rollout/nope.py",
        "no_such_page.md",
        "tests/test_nothing*.py",
    }


def test_negative_control_file_tree_entry_is_caught():
    readme = ROOT / "README.md"
    text = readme.read_text()
    assert {"align/grpo.py", "extras/vllm_rollout/rollout_worker.py", "tests/test_docs.py"} <= set(tree_paths(text))
    planted = text.replace("\nalign/\n", "\nalign/\n  no_such.py           planted\n", 1)
    assert planted != text
    assert set(missing_paths(planted, readme)) - set(missing_paths(text, readme)) == {"align/no_such.py"}


PLACEHOLDER_RE = re.compile(r"@@[A-Z0-9_]+@@|\bTODO\b|\bTBD\b|XXX")


def test_no_unfilled_placeholder_in_the_docs():
    bad = {p.relative_to(ROOT).as_posix(): PLACEHOLDER_RE.findall(p.read_text()) for p in DOCS}
    assert {k: v for k, v in bad.items() if v} == {}
    assert PLACEHOLDER_RE.findall("figures: @@TRL_QUIET@@, and TBD") == ["@@TRL_QUIET@@", "TBD"]  # control
