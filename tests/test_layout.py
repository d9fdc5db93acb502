"""The layout of ``align/``, read from the sources with ``ast`` (as the firewall test reads imports): every module on
one floor of ``FLOORS``, imports pointing to the same floor or lower (module-level and inside functions), no import
circle anywhere in ``align/``, ``train()`` and every module within their budgets as ``ruff format`` writes them, and no
``# fmt: skip`` / ``# fmt: off`` beyond a named allow-list. Each rule has a planted-violation negative control, so a
checker that sees nothing cannot pass."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ALIGN = ROOT / "align"
EXTRAS = ROOT / "extras" / "vllm_rollout"

MAX_FILE_LINES = 600
MAX_TRAIN_LINES = 60
# A module allowed past MAX_FILE_LINES, with the most lines it may have and why. None: split a module instead.
LONG_FILES: dict[str, int] = {}
# Where '# fmt: skip' / '# fmt: off' may stay (an aligned table that reads better so), with the reason; never to meet
# a size budget. None today: every one was dropped in 0b49000.
FMT_SKIP_ALLOWED: dict[str, str] = {}

# The floors of align/, bottom first (module names relative to ``align``; "" is the package itself). A module may
# import modules of its own floor or of a lower one, never of a higher one; a module on no floor fails the test.
FLOORS = [
    ("stdlib base", " atomic child errors heartbeat options"),
    (
        "the algorithm",
        "cxx fused_cpu cpu_linear attention moe model packing kernels lora grpo advantages device dist learner",
    ),
    ("what goes in", "char_tokenizer hub chat data specs verifiers reward_calls reward_pool rewards"),
    (
        "the rollout wing",
        (
            "rollout rollout.process rollout.message rollout.spool rollout.protocol rollout.cpu_decode rollout.cpu_sample rollout.cpu_kernel rollout.graph_decode rollout.native "
            "rollout.sessions rollout.client rollout.watcher rollout.teacher_logprobs rollout.cut rollout.sleep_mode rollout.deadlines rollout.groups rollout.partial rollout.engines rollout.backends "
            "rollout.pipeline"
        ),
    ),
    (
        "environments",
        (
            "envs envs.config envs.launcher envs.sandbox envs.runner envs.tools envs.episodes envs.partial envs.sampler lean lean.goedel lean.guards "
            "lean.config lean.server lean.repl lean.verify lean.env lean.corrections"
        ),
    ),
    ("the gateway", "gateway gateway.capture gateway.messages gateway.server gateway.agents gateway.workers"),
    ("the built-in tasks", "tasks tasks.warm tasks.reverse tasks.reverse_moe tasks.multiturn tasks.agent"),
    (
        "eval",
        "eval eval.config eval.metrics eval.checkpoint_eval eval.dispatcher eval.fleet eval.evaluator eval.pinned",
    ),
    (
        "the run wing",
        (
            "run run.parts run.fields run.help run.cli run.config_file run.advice run.sources run.presets run.log run.plot run.safety run.checkpoint run.teacher run.watchdog run.config run.task "
            "run.policy run.evaluation run.build"
        ),
    ),
    ("entry points", "train report serve sft sft.__main__ sft.config sft.data sft.run"),
]


def floor_of(floors: list[tuple[str, str]]) -> dict[str, int]:
    """``align.x.y`` -> the index of its floor."""
    return {("align." + m).rstrip("."): i for i, (_, mods) in enumerate(floors) for m in mods.split(" ")}


def module_files(root: Path) -> dict[str, Path]:
    """Every module under ``root/align`` by dotted name (a package by its ``__init__.py``)."""
    out = {}
    for f in sorted((root / "align").rglob("*.py")):
        parts = f.relative_to(root).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def import_graph(root: Path) -> dict[str, set[str]]:
    """``module -> the align modules it imports``, at module level or inside a function, relative imports resolved;
    ``from align import x`` is ``align.x`` when that is a module, an imported name resolves to its module. A string
    that names a module (``"align.x.y"`` or ``"align.x.y:attr"``: what ``importlib`` or a spec loader imports) counts
    as an import of it too."""
    files = module_files(root)
    graph = {}
    for name, f in files.items():
        package = name if f.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(f.read_text(), filename=str(f))):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join([*up, *([node.module] if node.module else [])])
                found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names}
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.split(":")[0] in files:
                found.add(node.value.split(":")[0])
        targets = set()
        for m in found:
            while m and m not in files:  # a name inside a module: the module
                m = m.rpartition(".")[0]
            if m and m != name:
                targets.add(m)
        graph[name] = targets
    return graph


def unplaced_modules(root: Path, floors: list[tuple[str, str]]) -> list[str]:
    """Modules on no floor, and floor entries that name no module (a stale row)."""
    placed, present = floor_of(floors), set(module_files(root))
    return sorted(f"{m}: on no floor" for m in present - set(placed)) + sorted(
        f"{m}: on a floor, but no such module" for m in set(placed) - present
    )


def climbing_imports(root: Path, floors: list[tuple[str, str]]) -> list[str]:
    floor = floor_of(floors)
    out = []
    for m, targets in sorted(import_graph(root).items()):
        for t in sorted(targets):
            if m in floor and t in floor and floor[t] > floor[m]:
                out.append(f"{m} ({floors[floor[m]][0]}) imports {t} ({floors[floor[t]][0]})")
    return out


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The circles of an import graph, each found once (depth-first, from the first module of each)."""
    cycles, state = [], {}

    def visit(m: str, stack: list[str]) -> None:
        state[m] = "open"
        for n in sorted(graph.get(m, ())):
            if state.get(n) == "open":
                cycles.append([*stack[stack.index(n) :], n])
            elif n not in state:
                visit(n, [*stack, n])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    return cycles


def script_graph(folder: Path) -> dict[str, set[str]]:
    """The modules of one script folder (they import each other by bare name)."""
    mods = {f.stem: f for f in folder.glob("*.py")}
    graph = {}
    for m, f in mods.items():
        names = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module)
        graph[m] = {n for n in names if n in mods and n != m}
    return graph


def ruff_formatted(text: str, name: str = "x.py") -> str:
    """``text`` as ``ruff format`` writes it under the repo's settings (pyproject.toml: 120 columns)."""
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    assert ruff, "ruff is not installed: pip install -e '.[test]'"
    out = subprocess.run(
        [ruff, "format", "--stdin-filename", name, "-"],
        input=text,
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def long_files(root: Path, limit: int, allowed: dict[str, int]) -> list[str]:
    out = []
    for f in sorted((root / "align").rglob("*.py")):
        rel = f.relative_to(root).as_posix()
        n = len(ruff_formatted(f.read_text(), rel).splitlines())
        if n > allowed.get(rel, limit):
            out.append(f"{rel}: {n} lines as ruff formats it")
    return out


def function_lines(source: str, name: str) -> int:
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node.end_lineno - node.lineno + 1
    raise AssertionError(f"no top-level {name}()")


def fmt_skips(root: Path, allowed: dict[str, str]) -> list[str]:
    out = []
    for f in sorted((root / "align").rglob("*.py")):
        rel = f.relative_to(root).as_posix()
        for i, line in enumerate(f.read_text().splitlines(), 1):
            if ("# fmt: skip" in line or "# fmt: off" in line) and rel not in allowed:
                out.append(f"{rel}:{i}")
    return out


def test_every_module_is_on_one_floor():
    names = [m for _, mods in FLOORS for m in mods.split(" ")]
    assert len(names) == len(set(names)), "a module is on two floors"
    assert unplaced_modules(ROOT, FLOORS) == []


def test_negative_control_a_module_on_no_floor_is_caught(tmp_path):
    (tmp_path / "align" / "rollout").mkdir(parents=True)
    for rel in ("__init__.py", "atomic.py", "new.py", "rollout/__init__.py"):
        (tmp_path / "align" / rel).write_text("")
    floors = [("base", " atomic gone"), ("rollout", "rollout")]
    assert unplaced_modules(tmp_path, floors) == [
        "align.new: on no floor",
        "align.gone: on a floor, but no such module",
    ]


def test_imports_point_down_only():
    assert climbing_imports(ROOT, FLOORS) == []


def test_negative_control_a_climbing_import_is_caught(tmp_path):
    (tmp_path / "align" / "rollout").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "model.py": "def f():\n    from align.train import train\n",  # function-local
        "grpo.py": "from align.rollout import protocol\nfrom align import model\n",  # climbs once; same floor is fine
        "train.py": "import align.grpo\nfrom align.rollout.protocol import X\n",  # down: allowed
        "rollout/__init__.py": "",
        "rollout/protocol.py": "from .. import train\nfrom . import spool\n",  # relative imports resolve
        "rollout/spool.py": "import align.rollout\n",
        "rollout/lazy.py": "import importlib\nNAMES = {'x': 'align.train:x', 'y': 'align.grpo'}\n",  # by name
    }
    for rel, text in files.items():
        (tmp_path / "align" / rel).write_text(text)
    floors = [
        ("base", " model grpo"),
        ("rollout", "rollout rollout.protocol rollout.spool rollout.lazy"),
        ("top", "train"),
    ]
    assert climbing_imports(tmp_path, floors) == [
        "align.grpo (base) imports align.rollout.protocol (rollout)",
        "align.model (base) imports align.train (top)",
        "align.rollout.lazy (rollout) imports align.train (top)",
        "align.rollout.protocol (rollout) imports align.train (top)",
    ]


def test_no_import_circle_in_align():
    assert import_cycles(import_graph(ROOT)) == []


def test_negative_control_an_align_circle_is_caught(tmp_path):
    (tmp_path / "align").mkdir()
    files = {"__init__.py": "", "a.py": "import align.b\n", "b.py": "def f():\n    from align import a\n"}
    files["c.py"] = "from align.a import x\n"  # into the circle, not part of it
    for rel, text in files.items():
        (tmp_path / "align" / rel).write_text(text)
    assert import_cycles(import_graph(tmp_path)) == [["align.a", "align.b", "align.a"]]


def test_no_import_circle_among_the_vllm_extras():
    assert import_cycles(script_graph(EXTRAS)) == []


def test_negative_control_an_extras_circle_is_caught(tmp_path):
    (tmp_path / "a.py").write_text("import b\n")
    (tmp_path / "b.py").write_text("def f():\n    import a\n")
    (tmp_path / "c.py").write_text("import a\n")
    assert import_cycles(script_graph(tmp_path)) == [["a", "b", "a"]]


def test_no_module_passes_the_size_budget_as_ruff_formats_it():
    assert long_files(ROOT, MAX_FILE_LINES, LONG_FILES) == []


def test_negative_control_a_long_file_is_caught_as_formatted(tmp_path):
    (tmp_path / "align" / "run").mkdir(parents=True)
    call = "f(" + ", ".join(f"argument_{i}" for i in range(40)) + ")\n"  # one line on disk, 42 once formatted
    (tmp_path / "align" / "squeezed.py").write_text("x = 1\n" * (MAX_FILE_LINES - 5) + call)
    (tmp_path / "align" / "ok.py").write_text("x = 1\n" * MAX_FILE_LINES)
    (tmp_path / "align" / "run" / "build.py").write_text("x = 1\n" * (MAX_FILE_LINES + 3))  # within its allowance
    allowed = {"align/run/build.py": MAX_FILE_LINES + 3}
    assert long_files(tmp_path, MAX_FILE_LINES, allowed) == [
        f"align/squeezed.py: {MAX_FILE_LINES + 37} lines as ruff formats it"
    ]
    assert long_files(tmp_path, MAX_FILE_LINES, {}) == [
        f"align/run/build.py: {MAX_FILE_LINES + 3} lines as ruff formats it",
        f"align/squeezed.py: {MAX_FILE_LINES + 37} lines as ruff formats it",
    ]


def test_train_reads_as_a_page_of_stages():
    n = function_lines(ruff_formatted((ALIGN / "train.py").read_text(), "align/train.py"), "train")
    assert n <= MAX_TRAIN_LINES, f"train() is {n} lines as ruff formats it: move setup into align/run/"


def test_negative_control_a_long_train_is_caught_as_formatted():
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_TRAIN_LINES - 2))
    squeezed = "def train():\n" + body + "    f(" + ", ".join(f"argument_{i}" for i in range(40)) + ")\n"
    assert function_lines(squeezed, "train") == MAX_TRAIN_LINES  # on disk: within the budget
    assert function_lines(ruff_formatted(squeezed), "train") == MAX_TRAIN_LINES + 41  # as ruff writes it: past it


def test_no_fmt_skip_beyond_the_allow_list():
    assert fmt_skips(ROOT, FMT_SKIP_ALLOWED) == []
    assert all(reason.strip() for reason in FMT_SKIP_ALLOWED.values()), "each allowed file needs its reason"


def test_negative_control_a_fmt_skip_is_caught(tmp_path):
    (tmp_path / "align").mkdir()
    (tmp_path / "align" / "table.py").write_text("X = [1,  2]  # fmt: skip\n")
    (tmp_path / "align" / "off.py").write_text("# fmt: off\nX = [1,  2]\n# fmt: on\n")
    (tmp_path / "align" / "clean.py").write_text("X = [1, 2]\n")
    assert fmt_skips(tmp_path, {}) == ["align/off.py:1", "align/table.py:1"]
    assert fmt_skips(tmp_path, {"align/table.py": "an aligned table", "align/off.py": "another"}) == []


def marker_definitions(root: Path) -> list[str]:
    """The files of ``root/align`` that spell the commit marker's name."""
    return sorted(
        f.relative_to(root).as_posix() for f in (root / "align").rglob("*.py") if '".complete"' in f.read_text()
    )


def test_the_commit_marker_is_defined_once():
    assert marker_definitions(ROOT) == ["align/atomic.py"]


def test_negative_control_a_second_commit_marker_is_caught(tmp_path):
    (tmp_path / "align" / "run").mkdir(parents=True)
    (tmp_path / "align" / "atomic.py").write_text('COMMIT_MARKER = ".complete"\n')
    (tmp_path / "align" / "run" / "save.py").write_text('done = path / ".complete"\n')
    (tmp_path / "align" / "run" / "ok.py").write_text("from align.atomic import COMMIT_MARKER\n")
    assert marker_definitions(tmp_path) == ["align/atomic.py", "align/run/save.py"]
