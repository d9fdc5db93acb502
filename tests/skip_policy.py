"""No silent skips: with ALIGN_FAIL_ON_SKIP=1 (set by scripts/test.sh) any skipped test fails the run.

The one exception is a test marked with hardware this machine lacks (``gpu``: a CUDA GPU; ``cpu_bf16``: a CPU with
native bf16; ``avx512`` / ``avx2``: an x86 CPU with AVX-512 / with AVX2 + FMA, for the native decode kernels): it
skips here, by name (``tests/conftest.py`` asks ``missing_hardware``), and every such skip is listed at the end of the run, so nothing passes for coverage it did
not get. Skips are recorded from the test reports (setup, call and collection), and the verdict is applied in ``pytest_sessionfinish`` by raising
``session.exitstatus`` from 0 to 1 only: pytest's own non-zero status (failures, errors, interrupts) always
wins and propagates unchanged. A whole module skipped at collection (``pytest.skip(allow_module_level=True)``,
``importorskip``) counts as a non-gpu skip: GPU tests skip per test (``skipif`` next to the ``gpu`` marker).

Loaded by ``tests/conftest.py``; a plain module so a test can load it into a pytest subprocess with ``-p``.
"""

from __future__ import annotations

import os

import pytest

ENV = "ALIGN_FAIL_ON_SKIP"
GPU_MARKER = "gpu"
# a test marked so may skip where the hardware is missing (listed)
HARDWARE_MARKERS = (GPU_MARKER, "avx512", "avx2", "cpu_bf16")  # avx512 / avx2: a name of cpu_kernel.KERNELS

_hw_skips: dict[str, list[tuple[str, str]]] = {m: [] for m in HARDWARE_MARKERS}
_other_skips: list[tuple[str, str]] = []


def missing_hardware(marker: str) -> str | None:
    """Why this machine lacks what ``marker`` needs (a skip reason), or None when it has it."""
    import torch

    if marker == GPU_MARKER:
        return None if torch.cuda.is_available() else "needs a CUDA GPU: run bash scripts/gpu_check.sh on a GPU machine"
    if marker == "cpu_bf16":
        if torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return None
        return "needs a CPU with native bf16 GEMMs (oneDNN bf16: AVX-512 BF16 / AMX); CUDA bf16 runs in gpu_check.sh"
    from align.rollout import cpu_kernel

    why = cpu_kernel.cpu_missing(marker)  # the kernel's own CPU check: x86-64 Linux, AVX-512 / AVX2 + FMA
    return None if why is None else f"the {marker} decode kernel {why}; the MKL/oneDNN path is tested instead"


def _reason(report) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # (path, lineno, "Skipped: reason")
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def _record(report, marker: str | None) -> None:
    if not report.skipped or hasattr(report, "wasxfail"):  # an xfail is reported as skipped; it is not a skip
        return
    (_other_skips if marker is None else _hw_skips[marker]).append((report.nodeid, _reason(report)))


def pytest_runtest_logreport(report) -> None:
    _record(report, next((m for m in HARDWARE_MARKERS if m in report.keywords), None))


def pytest_collectreport(report) -> None:
    _record(report, None)


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    for marker, skips in _hw_skips.items():
        if skips:
            terminalreporter.section(f"{len(skips)} {marker} test(s) skipped (not run here)")
            for nodeid, reason in skips:
                terminalreporter.line(f"{marker.upper()}-SKIPPED {nodeid}: {reason}")
    if _other_skips and os.environ.get(ENV) == "1":
        terminalreporter.section(f"{len(_other_skips)} non-gpu skip(s): a failure under {ENV}=1")
        for nodeid, reason in _other_skips:
            terminalreporter.line(f"SKIP-FAILS {nodeid}: {reason}")


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus) -> None:
    if os.environ.get(ENV) == "1" and _other_skips and session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
