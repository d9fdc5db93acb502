"""Fused fp32 CPU kernels for the training forward + backward: RMSNorm, RoPE and the experts' SwiGLU, one memory pass
each way instead of the ~5-10 elementwise passes (and temporaries) of their torch composites. Compiled on first use with
the system's C++ compiler, the way ``align.rollout.cpu_kernel`` builds its decode GEMM.

Why: on a CPU a Qwen3-MoE forward + backward spends ~40% of its time outside the GEMMs and flash attention, in
memory-bound elementwise kernels (``benchmarks/bench_moe.py``, docs/performance.md "Mixture of experts").

- ``rms_norm(x, w, eps)`` (rows of the last dim): y = x r w, r = rsqrt(mean(x^2) + eps) (r by torch's own ops,
  so the forward is F.rms_norm's floats; (x r) w in one pass); backward
  dx = r (g - xhat mean(g xhat)), g = dy w, xhat = x r, dw = sum over rows of dy xhat (per-thread partial sums).
- ``swiglu_fwd(h, ws)``: h (M, 2F) the gate|up GEMM's output, ws (M,) a per-row weight: silu(gate) * up * ws;
  ``swiglu_bwd(h, ws, ga)``: from ga (M, F), d loss / d (the weighted activation), in one pass: the weighted
  activation again (the down GEMM's weight gradient reads it), d loss / d ws (M,) = <ga, silu(gate) * up>, and
  d loss / d h (M, 2F) = (d gate | d up) (``align.moe.GroupedExperts``).
- ``rope(x, cos, sin, backward)``: rotate-half RoPE over (B*T, H, D) rows (``align.attention.apply_rope``), torch's
  floats (no FMA contraction: ``-ffp-contract=off``); its backward dx = dy cos + swap(dy sin).
- ``gmm_rows(a, b, offs)``, ``gmm_wgrad(a, b, offs)``: the experts' grouped GEMMs by oneDNN, the GEMM library torch
  ships (``at::native::mkldnn_matmul``, declared here: torch ships no header for it): each expert group's rows times
  its weight, and each group's weight gradient, one call for all groups (``align.moe.GroupedExperts``, both ways).
  They run where ``align.cpu_linear`` puts the dense layers on oneDNN (AMD CPUs, where MKL's sgemm takes its AVX2
  path: ~95 GFLOP/s on one Zen 5 core, oneDNN ~200). oneDNN builds one primitive per shape, so rows and reductions go
  in chunks of 512, then a multiple of 16, the last < 16 rows by torch's GEMM: a bounded set of shapes that its
  primitive cache keeps.

The sigmoid's exp is Cephes' expf (a degree-6 polynomial after reduction by ln 2, ~1 ulp) written so the compiler
vectorises it without fast-math (which would link crtfastmath and flush denormals for the whole process). So the
SwiGLU's floats (and every backward's, by their order of operations) differ from torch's in the last bits;
tests/test_fused_cpu.py holds each kernel to its torch composite.

Optional by construction: ``load()`` returns None and the callers keep their torch composites (said once in the log)
when there is no C++ compiler, the build fails (a warning says why), the platform is not Linux, or
``ALIGN_FUSED_CPU=0``. Built by ``align.cxx`` once per source, torch version and CPU (``-march=native``) into ``$XDG_CACHE_HOME/align`` under an exclusive
``flock``, renamed into place only when complete. Only stdlib and torch are imported (the firewall).
"""

from __future__ import annotations

import logging
import os
import platform
import sys

import torch

from align import cxx

SOURCE = r"""
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstdint>
#include <algorithm>
#include <bit>
#include <tuple>
#include <vector>

// oneDNN's fp32 GEMM, the one torch ships (exported by libtorch_cpu; not in its installed headers): on CPUs where
// MKL's sgemm takes its AVX2 path (AMD) it runs ~2x faster. ALIGN_DNNL is defined only where torch has oneDNN.
#ifdef ALIGN_DNNL
namespace at::native {
TORCH_API void mkldnn_matmul(const at::Tensor& a, const at::Tensor& b, const at::Tensor& out, float beta, float alpha);
}
#endif

namespace {

inline float exp_(float x) {  // Cephes expf, branch-free so loops over it vectorise
  x = x < -87.3f ? -87.3f : (x > 88.3f ? 88.3f : x);
  float n = std::floor(x * 1.44269504088896341f + 0.5f);
  float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  return p * std::bit_cast<float>((static_cast<int32_t>(n) + 127) << 23);
}

void check(const at::Tensor& t, int64_t dim, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous() && t.dim() == dim,
              "align_fused: ", what, " must be a contiguous ", dim, "-D float32 CPU tensor");
}

at::Tensor rms_apply(const at::Tensor& x, const at::Tensor& r, const at::Tensor& w) {  // (x r) w, rows of x
  check(x, 2, "x"); check(r, 1, "r"); check(w, 1, "weight");
  const int64_t R = x.size(0), E = x.size(1);
  TORCH_CHECK(w.size(0) == E && r.size(0) == R, "align_fused: rms_apply wants x (R, E), r (R,), w (E,)");
  at::Tensor y = at::empty_like(x);
  const float *xp = x.data_ptr<float>(), *rp = r.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, R, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t i = r0; i < r1; ++i) {
      const float* a = xp + i * E;
      float* o = yp + i * E;
      const float q = rp[i];
#pragma omp simd
      for (int64_t j = 0; j < E; ++j) o[j] = (a[j] * q) * wp[j];
    }
  });
  return y;
}

std::tuple<at::Tensor, at::Tensor> rms_bwd(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& w,
                                           const at::Tensor& r, bool need_dw) {
  check(dy, 2, "dy"); check(x, 2, "x"); check(w, 1, "weight"); check(r, 1, "r");
  const int64_t R = x.size(0), E = x.size(1);
  const int64_t T = at::get_num_threads();
  at::Tensor dx = at::empty_like(x), part = at::zeros({T, need_dw ? E : 1}, x.options());
  const float *gp = dy.data_ptr<float>(), *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>(),
              *rp = r.data_ptr<float>();
  float *dp = dx.data_ptr<float>(), *pp = part.data_ptr<float>();
  at::parallel_for(0, R, 16, [&](int64_t r0, int64_t r1) {
    float* acc = pp + at::get_thread_num() * (need_dw ? E : 1);
    for (int64_t i = r0; i < r1; ++i) {
      const float *g = gp + i * E, *a = xp + i * E;
      float* o = dp + i * E;
      const float q = rp[i];
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t j = 0; j < E; ++j) dot += g[j] * wp[j] * (a[j] * q);
      dot /= E;
#pragma omp simd
      for (int64_t j = 0; j < E; ++j) o[j] = q * (g[j] * wp[j] - (a[j] * q) * dot);
      if (need_dw) {
#pragma omp simd
        for (int64_t j = 0; j < E; ++j) acc[j] += g[j] * (a[j] * q);
      }
    }
  });
  return {dx, need_dw ? part.sum(0) : at::Tensor()};
}

at::Tensor swiglu_fwd(const at::Tensor& h, const at::Tensor& ws) {
  check(h, 2, "h"); check(ws, 1, "ws");
  const int64_t M = h.size(0), F = h.size(1) / 2;
  TORCH_CHECK(h.size(1) == 2 * F && ws.size(0) == M, "align_fused: h (M, 2F) and ws (M,)");
  at::Tensor out = at::empty({M, F}, h.options());
  const float *hp = h.data_ptr<float>(), *wp = ws.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    std::vector<float> sig(F);  // the sigmoid in its own loop: fused into one, gcc 12's code ran ~5x slower
    float* sg = sig.data();
    for (int64_t m = m0; m < m1; ++m) {
      const float *g = hp + m * 2 * F, *u = g + F;
      float* o = op + m * F;
      const float wm = wp[m];
#pragma omp simd
      for (int64_t f = 0; f < F; ++f) sg[f] = 1.f / (1.f + exp_(-g[f]));
#pragma omp simd
      for (int64_t f = 0; f < F; ++f) o[f] = (g[f] * sg[f]) * u[f] * wm;
    }
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> swiglu_bwd(const at::Tensor& h, const at::Tensor& ws,
                                                          const at::Tensor& ga) {
  check(h, 2, "h"); check(ws, 1, "ws"); check(ga, 2, "ga");
  const int64_t M = h.size(0), F = h.size(1) / 2;
  TORCH_CHECK(ga.size(0) == M && ga.size(1) == F && ws.size(0) == M, "align_fused: ga (M, F), ws (M,)");
  at::Tensor aw = at::empty({M, F}, h.options()), gw = at::empty({M}, h.options()), gh = at::empty_like(h);
  const float *hp = h.data_ptr<float>(), *wp = ws.data_ptr<float>(), *gap = ga.data_ptr<float>();
  float *awp = aw.data_ptr<float>(), *gwp = gw.data_ptr<float>(), *ghp = gh.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const float *g = hp + m * 2 * F, *u = g + F, *d = gap + m * F;
      float *o = awp + m * F, *dg = ghp + m * 2 * F, *du = dg + F;
      const float wm = wp[m];
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t f = 0; f < F; ++f) {
        const float s = 1.f / (1.f + exp_(-g[f])), act = g[f] * s, a = act * u[f], gd = d[f] * wm;
        dot += d[f] * a;
        o[f] = a * wm;
        du[f] = gd * act;
        dg[f] = gd * u[f] * (s * (1.f + g[f] * (1.f - s)));
      }
      gwp[m] = dot;
    }
  });
  return {aw, gw, gh};
}

at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool backward) {
  check(x, 3, "x"); check(cos, 2, "cos"); check(sin, 2, "sin");
  const int64_t R = x.size(0), H = x.size(1), D = x.size(2), h = D / 2;
  TORCH_CHECK(D == 2 * h && cos.size(0) == R && cos.size(1) == D && sin.sizes() == cos.sizes(),
              "align_fused: rope wants x (R, H, D) with D even and cos / sin (R, D)");
  at::Tensor y = at::empty_like(x);
  const float *xp = x.data_ptr<float>(), *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, R, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float *c = cp + r * D, *s = sp + r * D;
      for (int64_t k = 0; k < H; ++k) {
        const float* a = xp + (r * H + k) * D;
        float* o = yp + (r * H + k) * D;
        if (!backward) {  // y = x c + swap(x) s: (x1 c1 + x2 s1 | x2 c2 + x1 s2)
#pragma omp simd
          for (int64_t j = 0; j < h; ++j) {
            o[j] = a[j] * c[j] + a[j + h] * s[j];
            o[j + h] = a[j + h] * c[j + h] + a[j] * s[j + h];
          }
        } else {  // dx = dy c + swap(dy s)
#pragma omp simd
          for (int64_t j = 0; j < h; ++j) {
            o[j] = a[j] * c[j] + a[j + h] * s[j + h];
            o[j + h] = a[j + h] * c[j + h] + a[j] * s[j];
          }
        }
      }
    }
  });
  return y;
}


constexpr int64_t CH = 512, G = 16;  // rows and reductions go in chunks of 512, then a multiple of 16 (oneDNN
                                     // caches one primitive per shape: few shapes), the last < 16 by MKL

void mm_k(const at::Tensor& a, const at::Tensor& b, at::Tensor out, bool acc) {  // out (+)= a b, <= CH rows
  // a row-major reduces over a model width (one shape); a transposed (a weight gradient) over a varying row count:
  // that one goes in chunks too
  const int64_t K = a.size(1), step = a.stride(1) == 1 ? std::max<int64_t>(K, 1) : CH;
  for (int64_t k = 0; k < K || k == 0;) {
    const int64_t left = K - k, n = left >= step ? step : (left >= G ? left / G * G : left);
    const at::Tensor ak = a.narrow(1, k, n), bk = b.narrow(0, k, n);
    const bool sum = acc || k > 0;
#ifdef ALIGN_DNNL
    if (n >= G && a.size(0) >= G) at::native::mkldnn_matmul(ak, bk, out, sum ? 1.f : 0.f, 1.f);
    else
#endif
    if (sum) out.addmm_(ak, bk);
    else at::mm_out(out, ak, bk);
    k += n;
    if (n == 0) break;
  }
}

void mm_into(const at::Tensor& a, const at::Tensor& b, at::Tensor out, bool acc) {  // out (+)= a b
  const int64_t M = a.size(0), K = a.size(1);
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && out.dim() == 2 && b.size(0) == K && out.size(0) == M &&
              out.size(1) == b.size(1) && out.is_contiguous(), "align_fused: mm wants a (M, K), b (K, N), out (M, N)");
  const int64_t step = a.stride(1) == 1 ? CH : M;  // rows vary (tokens) only in a row-major a
  for (int64_t r = 0; r < M;) {
    const int64_t left = M - r, n = left >= step ? step : (left >= G ? left / G * G : left);
    mm_k(a.narrow(0, r, n), b, out.narrow(0, r, n), acc);
    r += n;
  }
}

void check_mm(const at::Tensor& t, int64_t dim, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == dim,
              "align_fused: ", what, " must be a ", dim, "-D float32 CPU tensor");
}

std::vector<int64_t> group_ends(const at::Tensor& offs, int64_t X, int64_t M) {  // checked: 0 <= e0 <= e1 .. = M
  TORCH_CHECK(offs.device().is_cpu() && offs.dim() == 1 && offs.size(0) == X, "align_fused: offs must be (X,)");
  at::Tensor o = offs.to(at::kLong).contiguous();
  const int64_t* p = o.data_ptr<int64_t>();
  std::vector<int64_t> ends(p, p + X);
  int64_t s = 0;
  for (int64_t e : ends) {
    TORCH_CHECK(e >= s && e <= M, "align_fused: group ends must rise from 0 to at most ", M);
    s = e;
  }
  return ends;
}

at::Tensor gmm_rows(const at::Tensor& a, const at::Tensor& b, const at::Tensor& offs) {
  // out[rows of group g] = a[rows of g] @ b[g]: a (M, K), b (X, K, N) any strides, offs (X,) each group's row end.
  // Groups run in order, each rounded up to whole 16-row blocks while that stays inside a: the extra rows (the next
  // groups') are overwritten when their own group runs, so no < 16-row tail goes to MKL but the last.
  check_mm(a, 2, "a"); check_mm(b, 3, "b");
  const int64_t M = a.size(0), X = b.size(0);
  TORCH_CHECK(b.size(1) == a.size(1), "align_fused: gmm_rows shapes ", a.sizes(), " and ", b.sizes());
  at::Tensor out = at::empty({M, b.size(2)}, a.options());
  int64_t s = 0, g = 0;
  for (int64_t e : group_ends(offs, X, M)) {
    const int64_t n = std::min((e - s + G - 1) / G * G, M - s);  // s + n <= M
    if (e > s) mm_into(a.narrow(0, s, n), b.select(0, g), out.narrow(0, s, n), false);
    s = e, ++g;
  }
  if (s < M) out.narrow(0, s, M - s).zero_();  // rows after the last group (none from GroupedExperts)
  return out;
}

at::Tensor gmm_wgrad(const at::Tensor& a, const at::Tensor& b, const at::Tensor& offs) {
  // out[g] = a[rows of g]^T @ b[rows of g]: a (M, P), b (M, Q) -> (X, P, Q), zero for a group without rows
  check_mm(a, 2, "a"); check_mm(b, 2, "b");
  const int64_t M = a.size(0), X = offs.size(0);
  TORCH_CHECK(b.size(0) == M, "align_fused: gmm_wgrad shapes ", a.sizes(), " and ", b.sizes());
  at::Tensor out = at::empty({X, a.size(1), b.size(1)}, a.options());
  int64_t s = 0, g = 0;
  for (int64_t e : group_ends(offs, X, M)) {
    if (e > s) mm_into(a.narrow(0, s, e - s).t(), b.narrow(0, s, e - s), out.select(0, g), false);
    else out.select(0, g).zero_();
    s = e, ++g;
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(@NS@, m) {
  m.def("rms_apply(Tensor x, Tensor r, Tensor w) -> Tensor", &rms_apply);
  m.def("rms_bwd(Tensor dy, Tensor x, Tensor w, Tensor r, bool need_dw) -> (Tensor, Tensor)", &rms_bwd);
  m.def("swiglu_fwd(Tensor h, Tensor ws) -> Tensor", &swiglu_fwd);
  m.def("swiglu_bwd(Tensor h, Tensor ws, Tensor ga) -> (Tensor, Tensor, Tensor)", &swiglu_bwd);
  m.def("rope(Tensor x, Tensor cos, Tensor sin, bool backward) -> Tensor", &rope);
  m.def("gmm_rows(Tensor a, Tensor b, Tensor offs) -> Tensor", &gmm_rows);
  m.def("gmm_wgrad(Tensor a, Tensor b, Tensor offs) -> Tensor", &gmm_wgrad);
}
"""

FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off")
_state: dict[str, object] = {}  # "ops" once loaded, "error" once failed: one try per process
log = logging.getLogger(__name__)


def _cpu_model() -> str:
    return "".join(line for line in cxx.cpu_lines() if line.startswith(("model name", "flags")))


def _try() -> tuple[object | None, str]:
    if os.environ.get("ALIGN_FUSED_CPU", "1") == "0":
        return None, "disabled by ALIGN_FUSED_CPU=0"
    if sys.platform != "linux":
        return None, f"built on Linux only (this is {sys.platform})"
    flags = [
        *FLAGS,
        "-std=c++20",
        "-shared",
        "-fPIC",
        *(["-DALIGN_DNNL"] if torch.backends.mkldnn.is_available() else []),
    ]
    # -march=native: a cache shared across machines keys on the CPU
    key = [SOURCE, platform.processor() + _cpu_model()]
    return cxx.load("align_fused", SOURCE, flags, key, None, "the fused CPU kernels are", "using torch composites")


def load():
    """``torch.ops.align_fused_<key>`` (``rms_apply``, ``rms_bwd``, ``swiglu_fwd``, ``swiglu_bwd``, ``rope``,
    ``gmm_rows``, ``gmm_wgrad``), or None where
    they cannot be built here; tried once per process, the outcome logged once."""
    if "tried" not in _state:
        ops, why = _try()
        _state.update(tried=True, ops=ops, why=why)
        log.info("fused CPU kernels (RMSNorm, RoPE, SwiGLU): %s (%s)", "on" if ops is not None else "off", why)
    return _state["ops"]


def usable(*ts: torch.Tensor) -> bool:
    """The fused kernels apply: every tensor fp32 on the CPU, and they load here."""
    return all(t.dtype == torch.float32 and t.device.type == "cpu" for t in ts) and load() is not None


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, x as rows (R, E), r (R,)): r = rsqrt(mean(x^2) + eps) by the torch ops F.rms_norm runs (its reduction
    order, so the same floats), then (x r) w in one pass."""
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    r = torch.rsqrt(x2.pow(2).mean(-1).add_(eps))
    return load().rms_apply(x2, r, weight.contiguous()).view(x.shape), x2, r


class RMSNorm(torch.autograd.Function):
    """RMSNorm over the last dim of fp32 CPU ``x`` with weight (E,): F.rms_norm's floats forward (``_rms``), the
    backward in one pass."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        y, x2, r = _rms(x, weight, eps)
        ctx.save_for_backward(x2, weight, r)
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        x2, weight, r = ctx.saved_tensors
        dx, dw = load().rms_bwd(dy.reshape(x2.shape).contiguous(), x2, weight.contiguous(), r, ctx.needs_input_grad[1])
        return dx.view(dy.shape), dw if ctx.needs_input_grad[1] else None, None


def _rope(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor, backward: bool) -> torch.Tensor:
    """x (B, H, T, D) a view of (B, T, H, D) rows (else one copy), c / s (B*T, D) -> (B, H, T, D), same layout."""
    B, H, T, D = x.shape
    y = load().rope(x.transpose(1, 2).reshape(B * T, H, D).contiguous(), c, s, backward)
    return y.view(B, T, H, D).transpose(1, 2)


def _tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    B, _, T, D = cos.shape
    return cos[:, 0].reshape(B * T, D).contiguous(), sin[:, 0].reshape(B * T, D).contiguous()


class Rope(torch.autograd.Function):
    """Rotate-half RoPE of x (B, H, T, D), a transposed view of (B, T, H, D) rows, by cos / sign-folded sin
    (B, 1, T, D) (``align.attention.apply_rope``): one pass each way over the (B, T, H, D) rows,
    y = x c + swap(x) s and dx = dy c + swap(dy s)."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        c, s = _tables(cos, sin)
        ctx.save_for_backward(c, s)
        return _rope(x, c, s, False)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        c, s = ctx.saved_tensors
        return _rope(dy, c, s, True), None, None


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """The fused RoPE of ``align.attention.apply_rope``, or None where it does not apply (dtype, device, shapes,
    a gradient wanted for the tables)."""
    B, _, T, D = x.shape
    if cos.shape != (B, 1, T, D) or sin.shape != cos.shape or cos.requires_grad or sin.requires_grad:
        return None
    if not usable(x, cos, sin):
        return None
    if torch.is_grad_enabled() and x.requires_grad:
        return Rope.apply(x, cos, sin)
    return _rope(x, *_tables(cos, sin), False)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The fused RMSNorm (autograd or not); callers check ``usable(x, weight)`` first."""
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return RMSNorm.apply(x, weight, eps)
    return _rms(x, weight, eps)[0]
