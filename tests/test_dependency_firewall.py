"""The firewall: core align imports only stdlib, torch, triton, numpy, safetensors;
align/rollout/protocol.py and spool.py import with torch absent; nothing in align reaches extras/."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BANNED = ("vllm", "ray", "pyarrow", "transformers", "tokenizers", "datasets")


def align_modules() -> list[str]:
    mods = []
    for f in sorted((ROOT / "align").rglob("*.py")):
        parts = f.relative_to(ROOT).with_suffix("").parts
        mods.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return mods


def banned_loaded(module: str, extra_path: str | None = None) -> list[str]:
    """Import ``module`` in a fresh interpreter; return the banned top-level packages it loaded."""
    code = textwrap.dedent(f"""
        import importlib, json, sys
        sys.path[:0] = {[p for p in (extra_path, str(ROOT)) if p]!r}
        importlib.import_module({module!r})
        print(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}} & set({list(BANNED)!r}))))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=120)
    assert out.returncode == 0, f"importing {module} failed:\n{out.stderr[-2000:]}"
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_every_align_module_is_found():
    mods = align_modules()
    assert {"align", "align.model", "align.rollout.protocol", "align.rollout.native"} <= set(mods)


def test_core_modules_load_no_banned_package():
    # One interpreter per module would take minutes (torch import ~4 s); import each in turn in one
    # fresh interpreter and check after every import, so a hit is attributed to the module that caused it.
    code = textwrap.dedent(f"""
        import importlib, json, sys
        sys.path.insert(0, {str(ROOT)!r})
        hits = {{}}
        for m in {align_modules()!r}:
            importlib.import_module(m)
            loaded = sorted({{k.split('.')[0] for k in sys.modules}} & set({list(BANNED)!r}))
            if loaded:
                hits[m] = loaded
                break
        print(json.dumps(hits))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {}


def test_negative_control_planted_import_is_caught(tmp_path):
    # A fake 'vllm' package and a module that imports it: the checker must flag it.
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text("")
    (tmp_path / "planted_mod.py").write_text("import json\nimport vllm\n")
    assert banned_loaded("planted_mod", str(tmp_path)) == ["vllm"]
    assert banned_loaded("json") == []


# Modules that must import with torch (and numpy, triton, safetensors) absent: the worker's one import and what it
# pulls in (the spool transport, which the protocol re-exports), the atomic-file helpers every floor uses, and the
# environment runner (its worker process starts fast).
STDLIB_ONLY = [
    "align", "align.rollout", "align.atomic", "align.child", "align.rollout.process", "align.rollout.protocol",
    "align.rollout.spool", "align.rollout.message", "align.specs", "align.envs.runner",
    "align.lean.goedel", "align.lean.config", "align.lean.repl", "align.lean.server", "align.lean.guards",
    "align.lean.verify",  # the Lean verifier: extras/vllm_rollout (the rollout venv) imports it too
    "align.rollout.teacher_logprobs", "align.rollout.cut", "align.rollout.sleep_mode",
]  # fmt: skip
NO_TORCH = ("torch", "numpy", "triton", "safetensors")


def import_without_torch(modules: list[str], extra_path: str | None = None) -> subprocess.CompletedProcess:
    """Import ``modules`` in a fresh interpreter where ``NO_TORCH`` cannot be imported; prints "ok" if all load."""
    code = textwrap.dedent(f"""
        import sys
        sys.path[:0] = {[p for p in (extra_path, str(ROOT)) if p]!r}
        for name in {list(NO_TORCH)!r}:
            sys.modules[name] = None  # makes `import torch` raise ImportError
        import importlib
        for name in {modules!r}:
            importlib.import_module(name)
        print("ok")
    """)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=60)


def test_protocol_imports_without_torch():
    out = import_without_torch(STDLIB_ONLY)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_negative_control_torch_blocker_works(tmp_path):
    # spool.py with a stray module-level `import torch` planted, beside the stdlib-only list: the check must fail on
    # it, naming torch; the same list without it loads.
    source = (ROOT / "align" / "rollout" / "spool.py").read_text()
    planted = source.replace(
        "from __future__ import annotations\n", "from __future__ import annotations\nimport torch\n"
    )
    assert planted != source
    (tmp_path / "planted_spool.py").write_text(planted)
    out = import_without_torch([*STDLIB_ONLY, "planted_spool"], str(tmp_path))
    assert out.returncode != 0 and out.stdout.strip() != "ok" and "torch" in out.stderr, out.stderr[-2000:]
    assert import_without_torch(STDLIB_ONLY, str(tmp_path)).stdout.strip() == "ok"


def imports_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("extras."):
            names.add(node.value)  # importlib.import_module("extras.…")
    return names


def test_extras_are_not_reachable_from_core():
    offenders = {}
    for f in (ROOT / "align").rglob("*.py"):
        bad = {n for n in imports_of(f) if n.split(".")[0] == "extras"}
        if bad:
            offenders[str(f.relative_to(ROOT))] = sorted(bad)
    # (client.py may name the worker script's path: it runs it as a subprocess in another venv.)
    assert offenders == {}


def test_negative_control_extras_import_is_caught(tmp_path):
    f = tmp_path / "m.py"
    f.write_text(
        "import importlib\nfrom extras.vllm_rollout import rollout_worker\nimportlib.import_module('extras.x')\n"
    )
    assert {"extras.vllm_rollout", "extras.x"} <= imports_of(f)
