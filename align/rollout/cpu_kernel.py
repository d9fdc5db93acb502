"""fp32 GEMMs for decode-sized row counts (1-16 rows), AVX-512 or AVX2 + FMA, compiled on first use with the system's
C++ compiler.

Why: at decode a CPU streams every weight once per token, and the library GEMMs torch reaches (MKL packed,
oneDNN blocked) stream at 58-72% of a plain memory read on the benchmark machine. These kernels keep the weights
in (N/16, K, 16) blocks, so each thread reads one or two linear streams with software prefetch, and keep the
rows' partial sums in registers (``benchmarks/bench_packing.py --step`` measures them against the others).

One packed-weight contract, two GEMMs (``KERNELS``, best first; ``choose()`` is the one place that picks, from
torch's CPU capability probe, and the choice is logged once per process): ``avx512`` keeps 1-16 rows x 16 or 32
columns in its 32 zmm registers; ``avx2`` has 16 ymm registers, so it walks a 16-column block in passes of at most
6 rows (12 accumulators), the first streaming the block from memory, the others re-reading it from L2. Each
library also carries the fused decode attention of ``align.rollout.cpu_decode`` (plain C++, built under its flags).

Optional by construction: ``load()`` returns None, and the sampler keeps the MKL/oneDNN layouts (said once in the
log), when the CPU has neither AVX-512 nor AVX2 + FMA, there is no C++ compiler, the build fails (a warning says
why), or ``ALIGN_CPU_KERNEL=0`` (``ALIGN_CPU_KERNEL=avx2`` runs the AVX2 kernel on an AVX-512 machine).
A shared library is built once per kernel, source and torch version into ``$XDG_CACHE_HOME/align`` (``~/.cache``),
under an exclusive ``flock`` (released by the OS if the builder dies, so a killed build never blocks the
next) and renamed into place only when complete. Only stdlib and torch are imported (the firewall).
"""

from __future__ import annotations

import logging
import os
import platform
import sys
from dataclasses import dataclass

import torch

from align import cxx
from align.rollout import cpu_decode, cpu_sample

HEADER = r"""
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <vector>

namespace {

"""

PACK_AND_LINEAR = r"""
// Weights W_i (N_i, K), taken as their row concatenation W (N = sum N_i, K) without making it,
// -> (NB = ceil(N / 16), K, 16): step k of block b is one 64-byte vector of outputs 16b..16b+15 (zeros past N).
// Blocks in parallel; each reads its 16 rows front to back and writes its (K, 16) block (L1/L2-sized) in place.
at::Tensor pack(at::TensorList ws) {
  TORCH_CHECK(!ws.empty(), "align_cpu::pack wants at least one weight");
  const int64_t K = ws[0].dim() == 2 ? ws[0].size(1) : -1;
  std::vector<at::Tensor> cs;
  int64_t N = 0;
  for (const auto& w : ws) {
    TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.size(1) == K,
                "align_cpu::pack wants 2-D float32 weights with one input size");
    cs.push_back(w.contiguous());
    N += w.size(0);
  }
  const int64_t NB = (N + 15) / 16;
  std::vector<const float*> rows(NB * 16, nullptr);  // row r of W, or null for the zero padding
  int64_t r = 0;
  for (const auto& c : cs)
    for (int64_t i = 0; i < c.size(0); ++i) rows[r++] = c.data_ptr<float>() + i * K;
  at::Tensor out = at::empty({NB, K, 16}, cs[0].options());
  float* o = out.data_ptr<float>();
  at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      float* ob = o + b * K * 16;
      for (int j = 0; j < 16; ++j) {
        const float* src = rows[b * 16 + j];
        if (src) for (int64_t k = 0; k < K; ++k) ob[k * 16 + j] = src[k];
        else for (int64_t k = 0; k < K; ++k) ob[k * 16 + j] = 0.0f;
      }
    }
  });
  return out;
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& wp, int64_t N, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "align_cpu::linear wants 2-D float32 input");
  TORCH_CHECK(wp.dim() == 3 && wp.size(2) == 16 && wp.size(1) == x.size(1) && wp.is_contiguous()
              && wp.scalar_type() == at::kFloat, "align_cpu::linear wants a weight from align_cpu::pack");
  TORCH_CHECK(N > (wp.size(0) - 1) * 16 && N <= wp.size(0) * 16, "align_cpu::linear: N does not match the weight");
  const int64_t M = x.size(0), K = x.size(1), NB = wp.size(0);
  TORCH_CHECK(M >= 1 && M <= 16, "align_cpu::linear handles 1 to 16 rows, got ", M);
  at::Tensor xt = at::empty({K, M}, x.options());  // x transposed by a plain loop: no torch op (and no thread wake)
  {
    const float* src = x.data_ptr<float>();
    float* dst = xt.data_ptr<float>();
    const int64_t s0 = x.stride(0), s1 = x.stride(1);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t k = 0; k < K; ++k) dst[k * M + m] = src[m * s0 + k * s1];
  }
  at::Tensor y = at::empty({M, N}, x.options());
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->contiguous();
    TORCH_CHECK(b.scalar_type() == at::kFloat && b.numel() == N, "align_cpu::linear: bias must be float32 of size N");
  }
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  const float* w = wp.data_ptr<float>();
  const float* xp = xt.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  run_rows(M, w, NB, K, N, xp, bp, yp);
  return y;
}

}  // namespace
"""

AVX512_GEMM = r"""
constexpr int64_t kPrefetch = 64;  // k steps ahead (4 KiB per stream); prefetches never fault

// y[m, c] = sum_k x[m, k] W[c, k] (+ bias[c]) for the NBK 16-column blocks starting at column n0.
template <int M, int NBK>
inline void blocks(const float* __restrict w, int64_t K, const float* __restrict xt, float* __restrict y,
                   int64_t N, int64_t n0, const float* __restrict bias) {
  __m512 acc[NBK][M];  // fully unrolled loops (the pragmas) keep it in registers, never on the stack
#pragma GCC unroll 16
  for (int j = 0; j < NBK; ++j)
#pragma GCC unroll 16
    for (int m = 0; m < M; ++m) acc[j][m] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m512 v[NBK];
#pragma GCC unroll 16
    for (int j = 0; j < NBK; ++j) {
      const float* p = w + (j * K + k) * 16;
      _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetch * 16), _MM_HINT_T0);
      v[j] = _mm512_loadu_ps(p);
    }
    const float* xk = xt + k * M;
#pragma GCC unroll 16
    for (int m = 0; m < M; ++m) {
      __m512 xb = _mm512_set1_ps(xk[m]);
#pragma GCC unroll 16
      for (int j = 0; j < NBK; ++j) acc[j][m] = _mm512_fmadd_ps(xb, v[j], acc[j][m]);
    }
  }
#pragma GCC unroll 16
  for (int j = 0; j < NBK; ++j) {  // straight from the registers; the last block of N % 16 columns is masked
    const int64_t c0 = n0 + j * 16;
    const __mmask16 mask = N - c0 >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (N - c0)) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + c0) : _mm512_setzero_ps();
#pragma GCC unroll 16
    for (int m = 0; m < M; ++m) _mm512_mask_storeu_ps(y + m * N + c0, mask, _mm512_add_ps(acc[j][m], b));
  }
}

template <int M>
void run(const float* wp, int64_t NB, int64_t K, int64_t N, const float* xt, const float* bias, float* y) {
  constexpr int NBK = M <= 8 ? 2 : 1;  // two blocks at a time while the accumulators fit in 32 registers
  const int64_t groups = (NB + NBK - 1) / NBK;
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t b = g * NBK;
      if (b + NBK <= NB) blocks<M, NBK>(wp + b * K * 16, K, xt, y, N, b * 16, bias);
      else blocks<M, 1>(wp + b * K * 16, K, xt, y, N, b * 16, bias);
    }
  });
}

void run_rows(int64_t M, const float* w, int64_t NB, int64_t K, int64_t N, const float* xt, const float* bias,
              float* y) {
  switch (M) {
#define ALIGN_CASE(R) case R: run<R>(w, NB, K, N, xt, bias, y); break;
    ALIGN_CASE(1) ALIGN_CASE(2) ALIGN_CASE(3) ALIGN_CASE(4) ALIGN_CASE(5) ALIGN_CASE(6) ALIGN_CASE(7) ALIGN_CASE(8)
    ALIGN_CASE(9) ALIGN_CASE(10) ALIGN_CASE(11) ALIGN_CASE(12) ALIGN_CASE(13) ALIGN_CASE(14) ALIGN_CASE(15)
    ALIGN_CASE(16)
#undef ALIGN_CASE
  }
}
"""

AVX2_GEMM = r"""
constexpr int64_t kPrefetch = 64;  // k steps ahead (4 KiB): the next tile, while the passes work on this one
constexpr int64_t kTile = 64;  // k steps per tile (4 KiB of the block): L1-resident across a tile's passes
constexpr int kMaxPassRows = 6;  // 6 rows x 2 halves = 12 accumulators + 2 weight vectors + 1 broadcast <= 16 registers

// acc[m0 + m] += sum_{k0 <= k < k1} x[m0 + m, k] W[c, k] for M rows and the 16 columns of one block, as two 8-float
// halves. The first pass over a tile reads it from memory and prefetches the next tile; the other passes (more rows
// than fit the registers) re-read it from L1, so the block streams from memory in one go.
template <int M, bool PREFETCH>
inline void pass(const float* __restrict w, int64_t k0, int64_t k1, const float* __restrict xt, int64_t ldx,
                 int64_t m0, float* __restrict acc) {
  __m256 lo[M], hi[M];  // fully unrolled loops (the pragmas) keep them in registers, never on the stack
#pragma GCC unroll 16
  for (int m = 0; m < M; ++m) {
    lo[m] = _mm256_load_ps(acc + (m0 + m) * 16);
    hi[m] = _mm256_load_ps(acc + (m0 + m) * 16 + 8);
  }
  for (int64_t k = k0; k < k1; ++k) {
    const float* p = w + k * 16;
    if (PREFETCH) _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetch * 16), _MM_HINT_T0);
    const __m256 a = _mm256_loadu_ps(p), b = _mm256_loadu_ps(p + 8);
    const float* xk = xt + k * ldx + m0;
#pragma GCC unroll 16
    for (int m = 0; m < M; ++m) {
      const __m256 xb = _mm256_broadcast_ss(xk + m);
      lo[m] = _mm256_fmadd_ps(xb, a, lo[m]);
      hi[m] = _mm256_fmadd_ps(xb, b, hi[m]);
    }
  }
#pragma GCC unroll 16
  for (int m = 0; m < M; ++m) {
    _mm256_store_ps(acc + (m0 + m) * 16, lo[m]);
    _mm256_store_ps(acc + (m0 + m) * 16 + 8, hi[m]);
  }
}

template <bool PREFETCH>
inline void pass_rows(int64_t rows, const float* w, int64_t k0, int64_t k1, const float* xt, int64_t ldx, int64_t m0,
                      float* acc) {
  switch (rows) {
#define ALIGN_CASE(R) case R: pass<R, PREFETCH>(w, k0, k1, xt, ldx, m0, acc); break;
    ALIGN_CASE(1) ALIGN_CASE(2) ALIGN_CASE(3) ALIGN_CASE(4) ALIGN_CASE(5) ALIGN_CASE(6)
#undef ALIGN_CASE
  }
}

// y[m, n0 : n0 + 16] = acc[m] (+ bias); the last block of N % 16 columns is masked (masked-off lanes never fault).
inline void store_block(const float* acc, int64_t M, float* y, int64_t N, int64_t n0, const float* bias) {
  const int cols = int(std::min<int64_t>(16, N - n0));
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i mlo = _mm256_cmpgt_epi32(_mm256_set1_epi32(cols), lane);
  const __m256i mhi = _mm256_cmpgt_epi32(_mm256_set1_epi32(cols - 8), lane);
  const __m256 blo = bias ? _mm256_maskload_ps(bias + n0, mlo) : _mm256_setzero_ps();
  const __m256 bhi = bias ? _mm256_maskload_ps(bias + n0 + 8, mhi) : _mm256_setzero_ps();
  for (int64_t m = 0; m < M; ++m) {
    _mm256_maskstore_ps(y + m * N + n0, mlo, _mm256_add_ps(_mm256_load_ps(acc + m * 16), blo));
    _mm256_maskstore_ps(y + m * N + n0 + 8, mhi, _mm256_add_ps(_mm256_load_ps(acc + m * 16 + 8), bhi));
  }
}

// Blocks in parallel; each block in tiles of kTile k steps, each tile's M rows in ceil(M / 6) passes of near-equal
// size (16 rows: 6 + 5 + 5), the partial sums in a (16, 16) buffer between tiles.
void run_rows(int64_t M, const float* w, int64_t NB, int64_t K, int64_t N, const float* xt, const float* bias,
              float* y) {
  const int64_t passes = (M + kMaxPassRows - 1) / kMaxPassRows;
  at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
    alignas(32) float acc[16 * 16];
    for (int64_t b = b0; b < b1; ++b) {
      const float* wb = w + b * K * 16;
      std::fill(acc, acc + M * 16, 0.0f);
      for (int64_t k0 = 0; k0 < K; k0 += kTile) {
        const int64_t k1 = std::min(K, k0 + kTile);
        int64_t m0 = 0;
        for (int64_t p = 0; p < passes; ++p) {
          const int64_t rows = (M - m0) / (passes - p);
          if (p == 0) pass_rows<true>(rows, wb, k0, k1, xt, M, m0, acc);
          else pass_rows<false>(rows, wb, k0, k1, xt, M, m0, acc);
          m0 += rows;
        }
      }
      store_block(acc, M, y, N, b * 16, bias);
    }
  });
}
"""


REGISTER = r"""
TORCH_LIBRARY(@NS@, m) {
  m.def("pack(Tensor[] ws) -> Tensor", &pack);
  m.def("linear(Tensor x, Tensor wp, int n, Tensor? bias) -> Tensor", &linear);
  m.def("@DECODE@", &decode_attention);
  m.def("@SAMPLE@", &sample_rows);
}
"""


@dataclass(frozen=True)
class Kernel:
    """One decode GEMM: the torch CPU capability it needs at least, that need in words, its compiler flags and the
    C++ of its ``run_rows`` (the rest of the source, the packing and the op registration, is shared)."""

    capability: str
    needs: str
    flags: tuple[str, ...]
    gemm: str

    def source(self, name: str) -> str:
        register = REGISTER.replace("@NS@", f"align_cpu_{name}").replace("@DECODE@", cpu_decode.SCHEMA)
        register = register.replace("@SAMPLE@", cpu_sample.SCHEMA)
        return HEADER + self.gemm + cpu_decode.SOURCE + cpu_sample.SOURCE + PACK_AND_LINEAR + register


# The decode GEMMs, best first; ``choose()`` takes the first this CPU runs. Both read the same packed weights.
KERNELS = {
    "avx512": Kernel("AVX512", "AVX-512", ("-mavx512f", "-mfma"), AVX512_GEMM),
    "avx2": Kernel("AVX2", "AVX2 and FMA", ("-mavx2", "-mfma"), AVX2_GEMM),
}
_LEVEL = {"AVX2": 1, "AVX512": 2}  # torch's x86 levels: AVX2 is AVX2 + FMA, AVX512 (F/BW/VL/DQ) includes both
MAX_ROWS = 16
_state: dict[str, dict[str, object]] = {}  # per kernel: "ops" once loaded, "error" once failed: one try per process
_said: list[str] = []  # the choice, logged once per process

log = logging.getLogger(__name__)


def cpu_missing(name: str) -> str | None:
    """None when this machine can run kernel ``name``, else why not (what it needs, what torch reports)."""
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"needs Linux on x86-64 (this is {sys.platform}/{platform.machine()})"
    cap = torch.backends.cpu.get_cpu_capability()
    if _LEVEL.get(cap, 0) < _LEVEL[KERNELS[name].capability]:
        return f"needs {KERNELS[name].needs} (torch reports {cap})"
    return None


def choose() -> tuple[str | None, str]:
    """The one place that decides: (the kernel this process uses, or None for the torch path; why).

    ``ALIGN_CPU_KERNEL``: unset or ``1`` the best kernel this CPU runs, ``0`` none, a name of ``KERNELS`` that one
    (where the CPU runs it: ``avx2`` on an AVX-512 machine measures the AVX2 kernel there)."""
    want = os.environ.get("ALIGN_CPU_KERNEL", "1")
    if want == "0":
        return None, "disabled by ALIGN_CPU_KERNEL=0"
    if want != "1" and want not in KERNELS:
        raise ValueError(
            f"ALIGN_CPU_KERNEL={want!r}: use 1 (the best this CPU runs), 0 (none) or one of {list(KERNELS)}"
        )
    names = list(KERNELS) if want == "1" else [want]
    reasons = []
    for name in names:
        if (why := cpu_missing(name)) is None:
            return name, "the best this CPU runs" if want == "1" else f"ALIGN_CPU_KERNEL={want}"
        reasons.append(why)
    return None, reasons[-1]


def _try(name: str) -> tuple[object | None, str]:
    """Build and load kernel ``name`` (the CPU runs it): (its ops, how) or (None, why not)."""
    flags = ["-O3", "-std=c++20", "-shared", "-fPIC", *KERNELS[name].flags, "-fopenmp", "-ffp-contract=off"]
    source = KERNELS[name].source(name)
    what, fallback = f"the {name} decode GEMM is", "sampling uses MKL/oneDNN"
    return cxx.load(f"align_cpu_{name}", source, flags, [source], f"align_cpu_{name}", what, fallback)


def load(name: str | None = None):
    """``torch.ops.align_cpu_<name>`` (``pack([w, ...])``, ``linear(x, wp, n, bias)``), or None where it cannot run
    here. ``name=None``: the kernel ``choose()`` picks, the choice logged once per process (a test or a benchmark
    names one to run it beside the other)."""
    chosen, why = choose() if name is None else (name, "")
    if chosen is not None and chosen not in _state:
        if name is not None and (missing := cpu_missing(name)) is not None:
            _state[chosen] = {"error": missing}
        else:
            ops, error = _try(chosen)
            _state[chosen] = {"ops": ops} if ops is not None else {"error": error}
    state = _state.get(chosen, {}) if chosen is not None else {"error": why}
    if name is None and not _said:
        _said.append(chosen or "")
        if state.get("ops") is not None:
            log.info("CPU decode GEMM: %s (%s; torch reports %s)", chosen, why, torch.backends.cpu.get_cpu_capability())
        else:
            log.info("CPU decode GEMM: none, the MKL/oneDNN path (%s)", state["error"])
    return state.get("ops")


def unavailable_reason(name: str | None = None) -> str | None:
    """Why ``load(name)`` returned None (after calling it), else None."""
    if load(name) is not None:
        return None
    chosen, why = choose() if name is None else (name, "")
    return why if chosen is None else _state[chosen]["error"]  # type: ignore[return-value]


def describe() -> str:
    """One line for benchmarks and logs: the CPU's features and the decode GEMM this process runs."""
    flags = next((line.split(":", 1)[1].split() for line in cxx.cpu_lines() if line.startswith("flags")), [])
    have = [f for f in ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "amx_tile") if f in flags]
    ops = load()
    kernel = ops.name.removeprefix("align_cpu_") if ops is not None else f"none, MKL/oneDNN ({unavailable_reason()})"
    cap = torch.backends.cpu.get_cpu_capability()
    return f"CPU: {' '.join(have) or 'no AVX2/AVX-512 flags'} (torch capability {cap}); decode GEMM: {kernel}"
