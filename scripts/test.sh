#!/usr/bin/env bash
# The whole test suite: builds both venvs (core .venv and .venv-rollout with the CPU build of vLLM), runs ruff,
# then pytest. Any skipped test fails the run, except tests marked `gpu` / `avx512` / `avx2` / `cpu_bf16`, which are listed (tests/skip_policy.py).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
if [ -f scripts/setup_rollout_venv.sh ]; then
    bash scripts/setup_rollout_venv.sh
    export ALIGN_REQUIRE_ROLLOUT=1   # rollout tests fail, never skip, when the venv is missing
fi
.venv/bin/ruff check .
.venv/bin/ruff format --check .
if ! command -v rsvg-convert >/dev/null; then   # renders plot.svg in tests/test_plot.py
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        apt-get install -y -q librsvg2-bin >/dev/null || { apt-get update -q >/dev/null && apt-get install -y -q librsvg2-bin >/dev/null; }
    else
        echo "rsvg-convert is missing: install librsvg2-bin (apt-get install librsvg2-bin)" >&2
        exit 1
    fi
fi
# build the native CPU kernels (the decode GEMMs, align.fused_cpu) once, before any test's time bound runs: minutes on
# a loaded machine, cached under ~/.cache/align; a kernel that cannot build here only warns (the torch path runs)
.venv/bin/python -c "from align import fused_cpu; from align.rollout import cpu_kernel as k
fused_cpu.load(); [k.load(n) for n in ('avx512', 'avx2') if k.cpu_missing(n) is None]"
export TRITON_INTERPRET=${TRITON_INTERPRET:-1}   # run Triton kernels for real on the CPU
export ALIGN_FAIL_ON_SKIP=1   # a skip is a failure unless the test is marked gpu
exec .venv/bin/python -m pytest -q --durations=30 "$@"   # the 30 slowest: where the suite's time goes
