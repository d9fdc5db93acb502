"""Which prepacked GEMM layout streams decode-sized fp32 GEMMs faster: MKL's packed sgemm or oneDNN's?

    .venv/bin/python benchmarks/bench_packing.py

For the weight shapes of the two ``bench_sampler.py`` models at their decode row counts, each layout runs
a chain of distinct copies of the weight (~400 MB in all, so every call streams its weight from memory as
in a real decode step), best of 5, interleaved. ``align.rollout.native.MKL_MAX_BYTES`` (MKL below it,
oneDNN above) comes from this table.
"""

from __future__ import annotations

import time

import torch

CASES = [  # (rows, out_features, in_features): 31M shape at 16 rows, Qwen2.5-0.5B shape at 8 rows
    (16, 768, 512), (16, 512, 512), (16, 2816, 512), (16, 512, 1408), (16, 8192, 512),
    (8, 1152, 896), (8, 896, 896), (8, 9728, 896), (8, 896, 4864), (8, 151936, 896),
]


def best_of(fn, reps: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    if not torch.backends.mkl.is_available():
        raise SystemExit("this torch build has no MKL: only the oneDNN layout is available")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'rows':>4} {'weight':>12} {'MB':>7} {'oneDNN GB/s':>12} {'MKL GB/s':>9} {'MKL/oneDNN time':>16}")
    for m, n, k in CASES:
        copies = max(1, int(400e6 // (n * k * 4)))
        weights = [torch.randn(n, k) for _ in range(copies)]
        bias, x, sizes = torch.randn(n), torch.randn(m, k), torch.empty(()).expand(n, k)
        onednn = [torch.ops.mkldnn._reorder_linear_weight(w, m) for w in weights]
        mkl = [torch.ops.mkl._mkl_reorder_linear_weight(w, m) for w in weights]
        del weights
        t_dnn = t_mkl = float("inf")
        for _ in range(3):
            t_dnn = min(t_dnn, best_of(lambda: [torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "") for w in onednn]))
            t_mkl = min(t_mkl, best_of(lambda: [torch.ops.mkl._mkl_linear(x, w, sizes, bias, m) for w in mkl]))
        gb = n * k * 4 * copies / 1e9
        print(f"{m:>4} {f'{n}x{k}':>12} {n * k * 4 / 1e6:>7.1f} {gb / t_dnn:>12.1f} {gb / t_mkl:>9.1f} {t_mkl / t_dnn:>16.2f}",
              flush=True)
        del onednn, mkl


if __name__ == "__main__":
    main()
