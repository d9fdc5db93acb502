"""The CPU sampler's draw for one decode step, fused into one C++ op beside the decode GEMM (``align.rollout.cpu_kernel``
builds it into the same library, so the same build-once contract and fallback hold).

Why: ``native.sample_next`` without top-k / top-p / min-p / a repetition penalty is ``log_softmax``, ``exp``,
``cumsum`` and ``searchsorted`` over the (R, V) logits, three full passes with their temporaries, each a parallel
region: on the 31M shape (16 rows, V 8192) ~1.4 ms of a ~21 ms decode step on one thread and 3-4 ms on two
under load (every region wakes the sleeping sibling thread). ``sample_rows`` does it in one op, serially for up to
2^17 logits (rows in parallel above), in three vectorised passes per row: the maximum, the exps (stored) with
their sums per 64-token block (on ``cpu_decode``'s 16-float vectors where the compiler has them; a partial last
block and the scalar build use the same polynomial, the same floats), then a walk over the blocks and within the one
that holds the draw: 180 us against 420 us for the torch ops on one thread (16 x 8192 logits).

Numerics: the same inverse-CDF draw as ``sample_next``: with ``s = logits / T``, ``m = max(s)`` and
``e = exp(s - m)``, the token is the first whose running sum of ``e`` exceeds ``u * sum(e)`` (zero-mass tokens are
never chosen), and its logprob is ``(s - m) - log(sum(e))``, ``log_softmax``'s formula. The exp is Cephes' polynomial
(within 2 ulp; 0 below -87, where torch's gives denormals no fp32 sum resolves) and the sums are by blocks, so the
logprobs agree with torch's to fp32 rounding and the token differs only where ``u * sum`` falls within that rounding
of a boundary (``tests/test_cpu_sample.py`` holds both to the torch path).
"""

from __future__ import annotations

import torch

SOURCE = r"""
// Cephes expf for x <= 0, branch-free so a loop over it vectorises (no fast-math): 0 below -87.
inline float exp_neg(float x) {
  const bool under = x < -87.0f;
  x = under ? -87.0f : x;
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  x = x - n * 0.693359375f - n * -2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * x + 1.3981999507e-3f;
  y = y * x + 8.3334519073e-3f;
  y = y * x + 4.1665795894e-2f;
  y = y * x + 1.6666665459e-1f;
  y = y * x + 5.0000001201e-1f;
  y = y * (x * x) + x + 1.0f;
  return under ? 0.0f : y * std::bit_cast<float>((int32_t(n) + 127) << 23);
}

// logits (R, V) float32, u (R,) uniforms in [0, 1): per row the token of the inverse-CDF draw of
// softmax(logits / T) and its logprob. Returns (tokens (R,) int64, logprobs (R,) float32).
std::tuple<at::Tensor, at::Tensor> sample_rows(const at::Tensor& logits, const at::Tensor& u, double temperature) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() && logits.scalar_type() == at::kFloat && logits.size(1) > 0,
              "align_cpu::sample_rows wants contiguous float32 logits (R, V)");
  const int64_t R = logits.size(0), V = logits.size(1);
  TORCH_CHECK(u.dim() == 1 && u.size(0) == R && u.is_contiguous() && u.scalar_type() == at::kFloat,
              "align_cpu::sample_rows wants u (R,) float32");
  TORCH_CHECK(temperature > 0.0, "align_cpu::sample_rows wants temperature > 0");
  const float T = float(temperature);
  constexpr int64_t kBlock = 64;
  const int64_t nb = (V + kBlock - 1) / kBlock;
  at::Tensor tok = at::empty({R}, logits.options().dtype(at::kLong));
  at::Tensor lp = at::empty({R}, logits.options());
  const float* xp = logits.data_ptr<float>();
  const float* up = u.data_ptr<float>();
  int64_t* tp = tok.data_ptr<int64_t>();
  float* lpp = lp.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 17) / V);  // serial up to 2^17 logits
  at::parallel_for(0, R, grain, [&](int64_t r0, int64_t r1) {
    std::vector<float> e(V), bsum(nb);
    for (int64_t r = r0; r < r1; ++r) {
      const float* x = xp + r * V;
      float m = -std::numeric_limits<float>::infinity();
      int64_t j0 = 0;  // the first logit the scalar loops below take (the vector ones do whole blocks)
#ifdef ALIGN_VEC16
      V16 vm = vsplat(m);
      for (; j0 + 16 <= V; j0 += 16) {
        const V16 v = vload(x + j0) / T;
        vm = v > vm ? v : vm;
      }
      for (int l = 0; l < 16; ++l) m = std::max(m, vm[l]);
#endif
      for (int64_t j = j0; j < V; ++j) m = std::max(m, x[j] / T);
      float total = 0.0f;
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t j1 = std::min(V, (b + 1) * kBlock);
        float bs = 0.0f;
        int64_t j = b * kBlock;
#ifdef ALIGN_VEC16
        if (j1 - j == kBlock) {  // a whole block: four vectors, the same floats as exp_neg's
          V16 acc{};
          for (; j < j1; j += 16) {
            const V16 v = vexp_neg(vload(x + j) / T - m);
            vstore(e.data() + j, v);
            acc += v;
          }
          bs = hsum(acc);
        }
#endif
        for (; j < j1; ++j) {
          e[j] = exp_neg(x[j] / T - m);
          bs += e[j];
        }
        bsum[b] = bs;
        total += bs;
      }
      const float target = up[r] * total;
      float c = 0.0f;
      int64_t b = 0;
      while (b < nb - 1 && c + bsum[b] <= target) c += bsum[b++];
      int64_t pick = -1, last = -1;
      for (int64_t j = b * kBlock; j < std::min(V, (b + 1) * kBlock); ++j) {
        if (e[j] <= 0.0f) continue;
        last = j;
        c += e[j];
        if (c > target) {
          pick = j;
          break;
        }
      }
      if (pick < 0) pick = last;  // the block's sum rounded above its running sum: its last token with mass
      for (int64_t j = b * kBlock - 1; pick < 0 && j >= 0; --j) {
        if (e[j] > 0.0f) pick = j;  // a zero-mass last block: the last token with mass before it
      }
      if (pick < 0) pick = V - 1;  // no token with mass at all: never an index outside the row
      tp[r] = pick;
      lpp[r] = (x[pick] / T - m) - std::log(total);
    }
  });
  return {tok, lp};
}
"""

SCHEMA = "sample_rows(Tensor logits, Tensor u, float temperature) -> (Tensor, Tensor)"


def usable(logits: torch.Tensor) -> bool:
    """Whether ``sample_rows`` draws from these logits (where the kernel's library loads): fp32 (R, V) on the CPU."""
    return logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2
