"""No silent skips: with ALIGN_FAIL_ON_SKIP=1 (set by scripts/test.sh) any skipped test fails the run.

The one exception is a test marked ``gpu`` (hardware this machine lacks): it may skip, and every such skip is
listed at the end of the run, so nothing passes for coverage it did not get. Skips are recorded from the test
reports (setup, call and collection), and the verdict is applied in ``pytest_sessionfinish`` by raising
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

_gpu_skips: list[tuple[str, str]] = []
_other_skips: list[tuple[str, str]] = []


def _reason(report) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # (path, lineno, "Skipped: reason")
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def _record(report, is_gpu: bool) -> None:
    if not report.skipped or hasattr(report, "wasxfail"):  # an xfail is reported as skipped; it is not a skip
        return
    (_gpu_skips if is_gpu else _other_skips).append((report.nodeid, _reason(report)))


def pytest_runtest_logreport(report) -> None:
    _record(report, GPU_MARKER in report.keywords)


def pytest_collectreport(report) -> None:
    _record(report, False)


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    if _gpu_skips:
        terminalreporter.section(f"{len(_gpu_skips)} gpu test(s) skipped (not run here)")
        for nodeid, reason in _gpu_skips:
            terminalreporter.line(f"GPU-SKIPPED {nodeid}: {reason}")
    if _other_skips and os.environ.get(ENV) == "1":
        terminalreporter.section(f"{len(_other_skips)} non-gpu skip(s): a failure under {ENV}=1")
        for nodeid, reason in _other_skips:
            terminalreporter.line(f"SKIP-FAILS {nodeid}: {reason}")


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus) -> None:
    if os.environ.get(ENV) == "1" and _other_skips and session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
