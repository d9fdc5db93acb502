"""scripts/test.sh's skip policy (tests/skip_policy.py), run for real in pytest subprocesses on throwaway tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent

INI = """[pytest]
addopts = --strict-markers -p no:cacheprovider
markers =
    gpu: needs a CUDA GPU
    avx512: needs AVX-512
    avx2: needs AVX2 + FMA
"""

CASES = {
    "plain_skip": "import pytest\ndef test_a():\n    pytest.skip('no reason')\ndef test_b():\n    pass\n",
    "gpu_skip": (
        "import pytest\n@pytest.mark.gpu\ndef test_g():\n    pytest.skip('no CUDA here')\n"
        "@pytest.mark.gpu\n@pytest.mark.skipif(True, reason='no CUDA either')\ndef test_h():\n    pass\n"
        "def test_b():\n    pass\n"
    ),
    "avx512_skip": "import pytest\n@pytest.mark.avx512\ndef test_k():\n    pytest.skip('no AVX-512')\n",
    "avx2_skip": "import pytest\n@pytest.mark.avx2\ndef test_k():\n    pytest.skip('no AVX2')\n",
    "fixture_skip": "import pytest\n@pytest.fixture\ndef f():\n    pytest.skip('setup skip')\ndef test_a(f):\n    pass\n",
    "module_skip": "import pytest\npytest.skip('whole module', allow_module_level=True)\n",
    "module_skip_beside_a_pass": "import pytest\npytest.skip('whole module', allow_module_level=True)\n",
    "xfail": "import pytest\n@pytest.mark.xfail(reason='known')\ndef test_x():\n    assert False\n",
    "failure_and_gpu_skip": (
        "import pytest\n@pytest.mark.gpu\ndef test_g():\n    pytest.skip('no CUDA')\ndef test_f():\n    assert False\n"
    ),
    "failure_and_plain_skip": "import pytest\ndef test_s():\n    pytest.skip('x')\ndef test_f():\n    assert False\n",
}


def _run(tmp_path: Path, case: str, strict: bool) -> subprocess.CompletedProcess:
    d = tmp_path / case
    d.mkdir()
    (d / "pytest.ini").write_text(INI)
    (d / f"test_{case}.py").write_text(CASES[case])
    if case == "module_skip_beside_a_pass":
        (d / "test_other.py").write_text("def test_ok():\n    pass\n")
    env = {k: v for k, v in os.environ.items() if k != "ALIGN_FAIL_ON_SKIP"}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), str(ROOT), env.get("PYTHONPATH", "")])
    if strict:
        env["ALIGN_FAIL_ON_SKIP"] = "1"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "skip_policy", "-c", str(d / "pytest.ini"), str(d)]
    return subprocess.run(cmd, check=False, cwd=d, env=env, capture_output=True, text=True, timeout=120)


def test_skip_policy_exit_codes(tmp_path):
    expected = {  # case: (exit code with ALIGN_FAIL_ON_SKIP=1, exit code without)
        "plain_skip": (1, 0),
        "gpu_skip": (0, 0),
        "avx512_skip": (0, 0),  # an x86 CPU without AVX-512: listed, not a failure
        "avx2_skip": (0, 0),  # nor AVX2 + FMA: the same
        "fixture_skip": (1, 0),
        "module_skip": (5, 5),  # nothing collected: pytest's own non-zero status
        "module_skip_beside_a_pass": (1, 0),
        "xfail": (0, 0),
        "failure_and_gpu_skip": (1, 1),
        "failure_and_plain_skip": (1, 1),
    }
    got = {}
    (tmp_path / "strict").mkdir()
    (tmp_path / "loose").mkdir()
    for case in expected:
        strict = _run(tmp_path / "strict", case, strict=True)
        loose = _run(tmp_path / "loose", case, strict=False)
        got[case] = (strict.returncode, loose.returncode)
        if case == "plain_skip":
            assert "SKIP-FAILS" in strict.stdout and "test_plain_skip.py::test_a: no reason" in strict.stdout
            assert "SKIP-FAILS" not in loose.stdout
        if case == "gpu_skip":
            out = strict.stdout
            assert "2 gpu test(s) skipped" in out, out
            assert "GPU-SKIPPED" in out and "test_g: no CUDA here" in out and "test_h: no CUDA either" in out
            assert "SKIP-FAILS" not in out
        if case == "avx512_skip":
            assert "1 avx512 test(s) skipped" in strict.stdout and "AVX512-SKIPPED" in strict.stdout, strict.stdout
            assert "test_k: no AVX-512" in strict.stdout and "SKIP-FAILS" not in strict.stdout
        if case == "avx2_skip":
            assert "1 avx2 test(s) skipped" in strict.stdout and "AVX2-SKIPPED" in strict.stdout, strict.stdout
            assert "test_k: no AVX2" in strict.stdout and "SKIP-FAILS" not in strict.stdout
    assert got == expected
