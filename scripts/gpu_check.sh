#!/usr/bin/env bash
# The GPU check (issue 13), one command on a CUDA machine:   bash scripts/gpu_check.sh
#   1. the tests marked `gpu` (tests/test_gpu.py; they skip without CUDA) and the Triton kernel tests on the GPU
#   2. a 3-step align.train run of the Qwen2.5-0.5B shape (random weights) in bf16-mixed: peak memory, step time
#   3. one forward + backward, plain logits vs the fused lm_head, at 8 x 512 tokens: memory beyond weights + grads
#      (without and with gradient checkpointing: the 24 layers' activations are the same in both paths)
#   4. packed vs padded rows;  5. native sampler decode tok/s, Qwen2.5-0.5B shape, bf16, batch 1 / 4 / 16:
#      CUDA-graph decode vs the eager loop vs transformers.generate (benchmarks/bench_graph_decode.py)
#   6. one GPU shared with the vLLM worker (--colocate: vLLM sleep mode around each update; tests/test_colocate.py,
#      skipped by name unless .venv-rollout holds a CUDA build of vLLM)
#   7. partial rollouts at seed 003's real lengths (median 3.2k, p90 14k, cap 16k): steps/s and generator idle with
#      and without --partial-rollouts, the token-lag histogram (benchmarks/bench_partial.py --scale 100)
# Needs a python3 with torch (CUDA), triton, transformers and pytest; installs nothing, downloads nothing, writes
# only under $TMPDIR. PYTHON=/path/to/python picks another interpreter. Takes ~7 minutes on one GPU (<= 12), plus
# step 6 (<= 7) where .venv-rollout has a CUDA vLLM, plus step 7 (<= 8).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=.
PY="${PYTHON:-python3}"

"$PY" - <<'PYEOF'
import sys

try:
    import torch
except ImportError:
    sys.exit(f"gpu_check: {sys.executable} has no torch; set PYTHON= to an interpreter with torch (CUDA), triton, pytest")

if not torch.cuda.is_available():
    sys.exit(f"gpu_check: CUDA is not available to {sys.executable} (torch {torch.__version__}); run it on a GPU machine")
print(f"gpu_check: {torch.cuda.get_device_name(0)} | torch {torch.__version__} | CUDA {torch.version.cuda}")
PYEOF

echo "== 1/7 tests: pytest -m gpu tests/test_gpu.py, then tests/test_kernels.py on the GPU"
timeout 240 "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py
timeout 120 "$PY" -m pytest -q -p no:cacheprovider tests/test_kernels.py

echo "== 2/7 3-step training, Qwen2.5-0.5B shape, bf16-mixed (8 prompts x G 4, 64 + 128 tokens)"
timeout 180 "$PY" benchmarks/bench_train_step.py --train --device cuda --precision bf16-mixed --steps 3 --batch 32 \
    --group 4 --prompt-tokens 64 --max-tokens 128

echo "== 3/7 one step, plain vs fused, Qwen2.5-0.5B shape, 8 x 512 tokens, bf16-mixed"
timeout 150 "$PY" benchmarks/bench_train_step.py --device cuda --precision bf16-mixed --batch 8 --seq 512 --reps 3
timeout 150 "$PY" benchmarks/bench_train_step.py --device cuda --precision bf16-mixed --batch 8 --seq 512 --reps 3 \
    --gradient-checkpointing
echo "== 4/7 one step, packed vs padded rows (--pack-sequences), both shapes and cases, bf16-mixed"
timeout 400 "$PY" benchmarks/bench_shared_prefix.py --device cuda --precision bf16-mixed --reps 3
echo "== 5/7 native sampler decode, Qwen2.5-0.5B shape, bf16: CUDA graph vs eager vs transformers.generate"
timeout 300 "$PY" benchmarks/bench_graph_decode.py --batch 1 4 16 --new 128 --repeats 3
echo "== 6/7 one GPU shared with the vLLM worker: --colocate (skips without a CUDA vLLM in .venv-rollout)"
timeout 420 "$PY" -m pytest -q -p no:cacheprovider -rs -m gpu tests/test_colocate.py
echo "== 7/7 partial rollouts at real lengths (cap 16k), native sampler on the GPU, K = 1"
timeout 480 "$PY" benchmarks/bench_partial.py --device cuda --scale 100 --steps 8 --repeats 1
echo "gpu_check: done"
