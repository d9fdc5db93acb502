#!/usr/bin/env bash
# The whole test suite: builds both venvs (core .venv and .venv-rollout with the CPU build of vLLM), then pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
if [ -f scripts/setup_rollout_venv.sh ]; then
    bash scripts/setup_rollout_venv.sh
    export ALIGN_REQUIRE_ROLLOUT=1   # rollout tests fail, never skip, when the venv is missing
fi
export TRITON_INTERPRET=${TRITON_INTERPRET:-1}   # run Triton kernels for real on the CPU
exec .venv/bin/python -m pytest -q "$@"
