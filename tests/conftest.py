"""Shared test setup: run Triton kernels for real on the CPU when there is no GPU.

TRITON_INTERPRET must be set before triton is first imported, so this runs before any test module is collected.
"""

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# One intra-op thread per test process: the suite shares 2 cores with vLLM worker subprocesses, and
# oversubscribed OpenMP threads made small-model steps ~7x slower here (measured: 0.18 s vs 1.29 s). The variable
# gives the same to every subprocess a test starts (CLI runs, torchrun ranks, lean_gen's in-process vLLM).
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")

# scripts/test.sh sets ALIGN_FAIL_ON_SKIP=1: a skip fails the run unless the test is marked with hardware this machine
# lacks (`gpu`, `avx512`, `avx2`, `cpu_bf16`: listed).
from skip_policy import (  # noqa: F401  (hooks re-exported for pytest)
    HARDWARE_MARKERS,
    missing_hardware,
    pytest_collectreport,
    pytest_runtest_logreport,
    pytest_sessionfinish,
    pytest_terminal_summary,
)

# The end-to-end files: real training runs through the CLI (kill -9, signals, resume), torchrun, vLLM, Ray and
# lean_gen. Every test in them is marked ``e2e`` (per file: seed-named test paths keep the suite flat), so the quick
# loop is ``pytest -m "not e2e and not rollout"``. tests/test_test_layout.py checks that each name here exists.
E2E_FILES = [
    "test_deadlines_spool.py",
    "test_dist.py",
    "test_eval_fleet.py",
    "test_eval_train.py",
    "test_fleet.py",
    "test_fleet_eval_train.py",
    "test_lean_gen_cli.py",
    "test_lean_gen_e2e.py",
    "test_lora_vllm.py",
    "test_pipeline_spool.py",
    "test_spool_worker.py",
    "test_train.py",
    "test_train_lora.py",
    "test_train_spool.py",
]
E2E_MARKER = "e2e"


def pytest_configure(config):
    config.addinivalue_line(
        "markers", f"{E2E_MARKER}: an end-to-end file (tests/conftest.py E2E_FILES); the quick loop leaves it out"
    )


def pytest_collection_modifyitems(config, items):
    """Tests in an ``E2E_FILES`` file get the ``e2e`` marker. Tests marked ``gpu`` skip, by name, where CUDA is absent
    (``bash scripts/gpu_check.sh`` runs them on a GPU); tests marked ``avx512`` / ``avx2`` where the CPU lacks
    AVX-512 / AVX2 + FMA (the MKL/oneDNN path is tested everywhere)."""
    e2e = set(E2E_FILES)
    for item in items:
        if item.path.name in e2e:
            item.add_marker(E2E_MARKER)
    for marker in HARDWARE_MARKERS:
        if (why := missing_hardware(marker)) is None:
            continue
        skip = pytest.mark.skip(reason=why)
        for item in items:
            if marker in item.keywords:
                item.add_marker(skip)


# The built-in reverse task's warm-started models, built once per session (a 60-step warm start took ~45 s on the
# loaded 2-core CI machine, and five modules built their own). Tests only read them: runs write under --out.


@pytest.fixture(scope="session")
def builtin_model(tmp_path_factory) -> str:
    """The reverse task's model after a 60-step supervised warm start (has align_tokenizer.json: CLI --model)."""
    from align.tasks import reverse

    return str(reverse.warm_start(tmp_path_factory.mktemp("ws60") / "m", steps=60, log=None))


@pytest.fixture(scope="session")
def builtin_model_30(tmp_path_factory) -> str:
    """The same after 30 steps: the base the eval-fleet runs train from."""
    from align.tasks import reverse

    return str(reverse.warm_start(tmp_path_factory.mktemp("ws30") / "m", steps=30, log=None))


@pytest.fixture(scope="session")
def prover(tmp_path_factory) -> str:
    """The tiny prover of the --env lean tests (tests/helpers_lean.make_prover), shared by the native-sampler and the
    vLLM-worker runs. Tests only read it."""
    from helpers_lean import make_prover

    return make_prover(tmp_path_factory.mktemp("prover"))


# The char task's random-weight model (tests/helpers_train.py) and the reverse task's (``reverse_model``), one per
# module as each module used to build its own (building takes ~0.02 s). Tests only read them (a run writes under its
# --out; copy the dir to change it), and the teardown fails the module's last test if anything under the dir changed.


def _read_only(path: str | Path) -> Iterator:
    from helpers_train import tree_digest

    before = tree_digest(path)
    yield path
    assert tree_digest(path) == before, f"a test wrote into the shared model {path}: copy it to change it"


def _read_only_char_model(tmp_path_factory, layers: int) -> Iterator[str]:
    from helpers_train import build_char_model

    yield from _read_only(build_char_model(tmp_path_factory.mktemp(f"char{layers}l") / "m", layers=layers))


@pytest.fixture(scope="module")
def char_model(tmp_path_factory) -> Iterator[str]:
    """The char task's model with 1 decoder layer (helpers_train.build_char_model), read-only."""
    yield from _read_only_char_model(tmp_path_factory, 1)


@pytest.fixture(scope="module")
def char_model_2l(tmp_path_factory) -> Iterator[str]:
    """The same with 2 decoder layers (two FSDP layer units plus the root, for tests/test_dist.py), read-only."""
    yield from _read_only_char_model(tmp_path_factory, 2)


@pytest.fixture(scope="module")
def reverse_model(tmp_path_factory) -> Iterator[Path]:
    """The built-in reverse task's model at full depth with random weights (seed 0, no warm start), saved as an HF
    directory: the base the vLLM-worker runs train from. One per module, read-only like ``char_model``."""
    from align.model import Transformer, save_pretrained
    from align.tasks import reverse

    model = Transformer(reverse.model_config(reverse.tokenizer())).init_weights(seed=0)
    yield from _read_only(save_pretrained(model, tmp_path_factory.mktemp("reverse") / "base"))
