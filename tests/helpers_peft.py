"""The peft side of the LoRA parity tests: ``tests/peft_reference.py`` run under a python that has peft and
transformers (test-only; shared by test_lora and test_moe_lora)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def peft_python() -> str:
    """A python with peft and transformers: this one, else the rollout venv's. Fails (never skips) without."""
    candidates = [
        sys.executable,
        str(Path(os.environ.get("ALIGN_ROLLOUT_VENV", REPO / ".venv-rollout")) / "bin/python"),
    ]
    for py in candidates:
        if (
            Path(py).exists()
            and subprocess.run([py, "-c", "import peft, transformers"], check=False, capture_output=True).returncode
            == 0
        ):
            return py
    pytest.fail(
        f"peft + transformers are needed for the LoRA parity test and none of {candidates} has them: "
        "install peft into the test venv (pip install peft)"
    )


def peft_reference(tmp_path: Path, spec: dict) -> dict:
    """Run ``tests/peft_reference.py`` on ``spec`` (written to ``tmp_path/spec.json``) under ``peft_python()``, one
    thread, and return the tensors it wrote to ``spec["out"]``."""
    from safetensors.torch import load_file

    (tmp_path / "spec.json").write_text(json.dumps(spec))
    env = {**os.environ, "PYTHONPATH": "", "OMP_NUM_THREADS": "1"}
    r = subprocess.run(
        [peft_python(), str(REPO / "tests" / "peft_reference.py"), str(tmp_path / "spec.json")],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return load_file(spec["out"])
