"""The layout, read from the sources with ``ast`` (as the firewall test reads imports): file sizes, the length of
``train()``, the directions imports may point in, and no import circle among the vLLM extras. Each rule has a
planted-violation negative control, so a checker that sees nothing cannot pass."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ALIGN = ROOT / "align"
EXTRAS = ROOT / "extras" / "vllm_rollout"

MAX_FILE_LINES = 600
MAX_TRAIN_LINES = 80
ALGORITHM = ["model", "moe", "attention", "packing", "kernels", "lora", "grpo", "advantages", "learner", "device",
             "dist", "atomic"]  # fmt: skip
# (the files a rule covers, the modules they may not import): imports point down only
FORBIDDEN = [
    ([f"align/{m}.py" for m in ALGORITHM], ["align.run", "align.rollout.pipeline", "align.eval", "align.train"]),
    (["align/rollout/"], ["align.run", "align.eval", "align.train"]),
    (["align/eval/"], ["align.run", "align.train"]),
    (["align/envs/", "align/chat.py", "align/lean/"], ["align.run", "align.eval", "align.train"]),
    (
        [
            "align/data.py",
            "align/errors.py",
            "align/rewards.py",
            "align/reward_pool.py",
            "align/verifiers.py",
            "align/tasks/",
        ],
        ["align.run", "align.train"],
    ),
]


def modules_imported(path: Path) -> set[str]:
    """Every module ``path`` imports, at module level or inside a function (``from align import x`` counts as
    ``align.x``)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names}
    return names


def violations(root: Path, rules: list[tuple[list[str], list[str]]]) -> list[str]:
    out = []
    for files, banned in rules:
        for f in sorted(root.rglob("*.py")):
            rel = f.relative_to(root).as_posix()
            if not any(rel == p or (p.endswith("/") and rel.startswith(p)) for p in files):
                continue
            for m in sorted(modules_imported(f)):
                if any(m == b or m.startswith(b + ".") for b in banned):
                    out.append(f"{rel} imports {m}")
    return out


def long_files(root: Path, limit: int) -> list[str]:
    out = []
    for f in sorted((root / "align").rglob("*.py")):
        rel = f.relative_to(root).as_posix()
        n = len(f.read_text().splitlines())
        if n > limit:
            out.append(f"{rel}: {n} lines")
    return out


def function_lines(path: Path, name: str) -> int:
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node.end_lineno - node.lineno + 1
    raise AssertionError(f"{path} has no top-level {name}()")


def import_cycles(folder: Path) -> list[list[str]]:
    """Circles among the modules of one script folder (they import each other by bare name)."""
    mods = {f.stem: f for f in folder.glob("*.py")}
    graph = {m: sorted(n for n in modules_imported(f) if n in mods and n != m) for m, f in mods.items()}
    cycles, state = [], {}

    def visit(m: str, stack: list[str]) -> None:
        state[m] = "open"
        for n in graph[m]:
            if state.get(n) == "open":
                cycles.append([*stack[stack.index(n) :], n])
            elif n not in state:
                visit(n, [*stack, n])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    return cycles


def test_no_align_file_passes_the_size_budget():
    assert long_files(ROOT, MAX_FILE_LINES) == []


def test_negative_control_a_long_file_is_caught(tmp_path):
    (tmp_path / "align").mkdir()
    (tmp_path / "align" / "big.py").write_text("x = 1\n" * (MAX_FILE_LINES + 1))
    (tmp_path / "align" / "ok.py").write_text("x = 1\n" * MAX_FILE_LINES)
    assert long_files(tmp_path, MAX_FILE_LINES) == [f"align/big.py: {MAX_FILE_LINES + 1} lines"]


def test_train_reads_as_a_page_of_stages():
    n = function_lines(ALIGN / "train.py", "train")
    assert n <= MAX_TRAIN_LINES, f"train() is {n} lines: move setup into align/run/build.py"


def test_negative_control_a_long_train_is_caught(tmp_path):
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_TRAIN_LINES))
    (tmp_path / "train.py").write_text("def train():\n" + body)
    assert function_lines(tmp_path / "train.py", "train") == MAX_TRAIN_LINES + 1


def test_imports_point_down_only():
    assert violations(ROOT, FORBIDDEN) == []


def test_negative_control_a_climbing_import_is_caught(tmp_path):
    (tmp_path / "align" / "rollout").mkdir(parents=True)
    (tmp_path / "align" / "model.py").write_text("def f():\n    from align.train import train\n")  # function-local
    (tmp_path / "align" / "rollout" / "x.py").write_text("from align import eval\nimport align.rollout.protocol\n")
    (tmp_path / "align" / "grpo.py").write_text("import align.rollout.protocol\n")  # allowed: down
    assert violations(tmp_path, FORBIDDEN) == [
        "align/model.py imports align.train",
        "align/model.py imports align.train.train",
        "align/rollout/x.py imports align.eval",
    ]


def test_no_import_circle_among_the_vllm_extras():
    assert import_cycles(EXTRAS) == []


def test_negative_control_an_extras_circle_is_caught(tmp_path):
    (tmp_path / "a.py").write_text("import b\n")
    (tmp_path / "b.py").write_text("def f():\n    import a\n")
    (tmp_path / "c.py").write_text("import a\n")
    assert import_cycles(tmp_path) == [["a", "b", "a"]]


def test_the_commit_marker_is_defined_once():
    hits = [f.relative_to(ROOT).as_posix() for f in ALIGN.rglob("*.py") if '".complete"' in f.read_text()]
    assert hits == ["align/atomic.py"]
