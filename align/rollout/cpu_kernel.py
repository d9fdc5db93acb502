"""An AVX-512 fp32 GEMM for decode-sized row counts (1-16 rows), compiled on first use with the system's C++ compiler.

Why: at decode a CPU streams every weight once per token, and the library GEMMs torch reaches (MKL packed,
oneDNN blocked) stream at 58-72% of a plain memory read on the benchmark machine. This kernel keeps the weights
in (N/16, K, 16) blocks, so each thread reads one or two linear streams with software prefetch, and keeps the
1-16 rows' partial sums in registers (``benchmarks/bench_packing.py --step`` measures it against the others).

Optional by construction: ``load()`` returns None, and the sampler keeps the MKL/oneDNN layouts, when the CPU
lacks AVX-512, there is no C++ compiler, the build fails (a warning says why), or ``ALIGN_CPU_KERNEL=0``.
The shared library is built once per source and torch version into ``$XDG_CACHE_HOME/align`` (``~/.cache``),
under an exclusive ``flock`` (released by the OS if the builder dies, so a killed build never blocks the
next) and renamed into place only when complete. Only stdlib and torch are imported (the firewall).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import torch

SOURCE = r"""
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <vector>

namespace {

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

constexpr int64_t kPrefetch = 64;  // k steps ahead (4 KiB per stream); prefetches never fault

// y[m, c] = sum_k x[m, k] W[c, k] (+ bias[c]) for the NBK 16-column blocks starting at column n0.
template <int M, int NBK>
inline void blocks(const float* __restrict w, int64_t K, const float* __restrict xt, float* __restrict y,
                   int64_t N, int64_t n0, const float* __restrict bias) {
  __m512 acc[NBK][M];
  for (int j = 0; j < NBK; ++j)
    for (int m = 0; m < M; ++m) acc[j][m] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m512 v[NBK];
    for (int j = 0; j < NBK; ++j) {
      const float* p = w + (j * K + k) * 16;
      _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetch * 16), _MM_HINT_T0);
      v[j] = _mm512_loadu_ps(p);
    }
    const float* xk = xt + k * M;
    for (int m = 0; m < M; ++m) {
      __m512 xb = _mm512_set1_ps(xk[m]);
      for (int j = 0; j < NBK; ++j) acc[j][m] = _mm512_fmadd_ps(xb, v[j], acc[j][m]);
    }
  }
  for (int j = 0; j < NBK; ++j) {  // straight from the registers; the last block of N % 16 columns is masked
    const int64_t c0 = n0 + j * 16;
    const __mmask16 mask = N - c0 >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (N - c0)) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + c0) : _mm512_setzero_ps();
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

at::Tensor linear(const at::Tensor& x, const at::Tensor& wp, int64_t N, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "align_cpu::linear wants 2-D float32 input");
  TORCH_CHECK(wp.dim() == 3 && wp.size(2) == 16 && wp.size(1) == x.size(1) && wp.is_contiguous()
              && wp.scalar_type() == at::kFloat, "align_cpu::linear wants a weight from align_cpu::pack");
  TORCH_CHECK(N > (wp.size(0) - 1) * 16 && N <= wp.size(0) * 16, "align_cpu::linear: N does not match the weight");
  const int64_t M = x.size(0), K = x.size(1), NB = wp.size(0);
  TORCH_CHECK(M >= 1 && M <= 16, "align_cpu::linear handles 1 to 16 rows, got ", M);
  at::Tensor xt = x.t().contiguous();
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
  switch (M) {
#define ALIGN_CASE(R) case R: run<R>(w, NB, K, N, xp, bp, yp); break;
    ALIGN_CASE(1) ALIGN_CASE(2) ALIGN_CASE(3) ALIGN_CASE(4) ALIGN_CASE(5) ALIGN_CASE(6) ALIGN_CASE(7) ALIGN_CASE(8)
    ALIGN_CASE(9) ALIGN_CASE(10) ALIGN_CASE(11) ALIGN_CASE(12) ALIGN_CASE(13) ALIGN_CASE(14) ALIGN_CASE(15)
    ALIGN_CASE(16)
#undef ALIGN_CASE
  }
  return y;
}

}  // namespace

TORCH_LIBRARY(align_cpu, m) {
  m.def("pack(Tensor[] ws) -> Tensor", &pack);
  m.def("linear(Tensor x, Tensor wp, int n, Tensor? bias) -> Tensor", &linear);
}
"""

MAX_ROWS = 16
_state: dict[str, object] = {}  # "ops" once loaded, "error" once failed: one attempt per process


def _cpu_supported() -> str | None:
    """None when this machine can run the kernel, else why not."""
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"needs Linux on x86-64 (this is {sys.platform}/{platform.machine()})"
    if torch.backends.cpu.get_cpu_capability() not in ("AVX512",):
        return f"needs AVX-512 (torch reports {torch.backends.cpu.get_cpu_capability()})"
    return None


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++"):
        if name and (path := shutil.which(name)):
            return path
    return None


def _build(cxx: str) -> Path:
    torch_dir = Path(torch.__file__).resolve().parent
    flags = [
        "-O3",
        "-std=c++20",
        "-shared",
        "-fPIC",
        "-mavx512f",
        "-mfma",
        "-fopenmp",
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
        f"-I{torch_dir / 'include'}",
        f"-I{torch_dir / 'include' / 'torch' / 'csrc' / 'api' / 'include'}",
    ]
    libs = [f"-L{torch_dir / 'lib'}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{torch_dir / 'lib'}"]
    key = hashlib.sha256("\0".join([SOURCE, torch.__version__, str(torch_dir), *flags]).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "align"
    cache.mkdir(parents=True, exist_ok=True)
    lib = cache / f"align_cpu_{key}.so"
    if lib.exists():
        return lib
    with open(cache / f"align_cpu_{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building the same key
        if lib.exists():
            return lib
        for stale in cache.glob(f"align_cpu_{key}.*.*"):  # left by a builder that was killed (we hold the lock)
            if stale.suffix in (".cpp", ".tmp"):
                stale.unlink(missing_ok=True)
        src = cache / f"align_cpu_{key}.{os.getpid()}.cpp"
        tmp = cache / f"align_cpu_{key}.{os.getpid()}.so.tmp"
        try:
            src.write_text(SOURCE)
            proc = subprocess.run(
                [cxx, *flags, str(src), "-o", str(tmp), *libs], capture_output=True, text=True, timeout=600, check=False
            )
            if proc.returncode != 0:
                tail = " | ".join(proc.stderr.strip().splitlines()[-3:])
                raise RuntimeError(f"{cxx} exited with {proc.returncode}" + (f": {tail}" if tail else ""))
            os.replace(tmp, lib)
        finally:
            src.unlink(missing_ok=True)
            tmp.unlink(missing_ok=True)
    return lib


def _reason_not_to_build() -> str | None:
    if os.environ.get("ALIGN_CPU_KERNEL", "1") == "0":
        return "disabled by ALIGN_CPU_KERNEL=0"
    if (why := _cpu_supported()) is not None:
        return why
    return None if _compiler() else "no C++ compiler found (set CXX, or install g++)"


def load():
    """``torch.ops.align_cpu`` (``pack([w, ...])``, ``linear(x, wp, n, bias)``), or None where it cannot run here."""
    if "ops" in _state or "error" in _state:
        return _state.get("ops")
    why = _reason_not_to_build()
    if why is None:
        lib = None
        try:
            lib = _build(_compiler())
            torch.ops.load_library(str(lib))
            _state["ops"] = torch.ops.align_cpu
            return _state["ops"]
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:  # costs speed, never correctness
            why = f"build failed: {e}"
            if lib is not None and lib.exists():  # built but unloadable (e.g. damaged): the next process rebuilds
                lib.unlink(missing_ok=True)
                why = f"{lib} did not load ({e}); removed it, the next run rebuilds"
            warnings.warn(
                f"align: the AVX-512 decode GEMM is unavailable ({why}); sampling uses MKL/oneDNN", stacklevel=2
            )
    _state["error"] = why
    return None


def unavailable_reason() -> str | None:
    """Why ``load()`` returned None (after calling it), else None."""
    load()
    return _state.get("error")  # type: ignore[return-value]
