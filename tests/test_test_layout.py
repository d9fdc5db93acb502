"""The test suite's own layout: no test module imports another (shared code lives in tests/helpers_*.py), the e2e
file list names files that exist, and the shared char model's read-only check sees a write."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import E2E_FILES
from helpers_train import build_char_model, tree_digest

TESTS = Path(__file__).resolve().parent


def imported_test_modules(source: str) -> list[str]:
    """The ``test_*`` modules that ``source`` imports, at any depth (function-level imports included)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0].startswith("test_")]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module.split(".")[0].startswith("test_"):
            found.append(node.module)
    return found


def test_no_imported_test_modules_another():
    offenders = {p.name: imported_test_modules(p.read_text()) for p in sorted(TESTS.glob("*.py"))}
    assert {name: mods for name, mods in offenders.items() if mods} == {}
    # negative control: each spelling of a test-module import is found, also inside a function
    planted = "import os\nimport test_train\ndef f():\n    from test_learner import cfg\n    import test_x.y as z\n"
    assert imported_test_modules(planted) == ["test_train", "test_learner", "test_x.y"]
    assert imported_test_modules("from helpers_train import TOK\nfrom . import test_a\n") == []


def test_e2e_files_exist():
    assert E2E_FILES == sorted(set(E2E_FILES))
    assert [name for name in E2E_FILES if not (TESTS / name).is_file()] == []


def test_the_read_only_check_sees_a_write(tmp_path):
    model = Path(build_char_model(tmp_path / "m"))
    before = tree_digest(model)
    assert before == tree_digest(model) and "model.safetensors" in before
    (model / "config.json").write_text((model / "config.json").read_text() + " ")
    assert tree_digest(model) != before
