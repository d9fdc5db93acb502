"""Shared test setup: run Triton kernels for real on the CPU when there is no GPU.

TRITON_INTERPRET must be set before triton is first imported, so this runs before any test module is collected.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# One intra-op thread per test process: the suite shares 2 cores with vLLM worker subprocesses, and
# oversubscribed OpenMP threads made small-model steps ~7x slower here (measured: 0.18 s vs 1.29 s).
torch.set_num_threads(1)

# scripts/test.sh sets ALIGN_FAIL_ON_SKIP=1: a skip fails the run unless the test is marked `gpu` or `avx512` (listed).
from skip_policy import (  # noqa: F401  (hooks re-exported for pytest)
    HARDWARE_MARKERS,
    missing_hardware,
    pytest_collectreport,
    pytest_runtest_logreport,
    pytest_sessionfinish,
    pytest_terminal_summary,
)


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` skip, by name, where CUDA is absent (``bash scripts/gpu_check.sh`` runs them on a GPU);
    tests marked ``avx512`` where the CPU lacks AVX-512 (the MKL/oneDNN path is tested everywhere)."""
    import pytest

    for marker in HARDWARE_MARKERS:
        if (why := missing_hardware(marker)) is None:
            continue
        skip = pytest.mark.skip(reason=why)
        for item in items:
            if marker in item.keywords:
                item.add_marker(skip)
