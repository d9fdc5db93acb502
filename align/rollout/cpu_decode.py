"""The CPU decode step's attention for one new token per row, fused into one C++ op beside the decode GEMM
(``align.rollout.cpu_kernel`` builds both into one library, so the same build-once contract and fallback hold).

Why: at decode the attention of one token is ~15 small torch ops per layer (split the fused q|k|v, RoPE on q and k,
two cache writes, the cache slices, the masked SDPA call, the transposes), each a dispatch and an allocation; on the
31M shape they, RMSNorm and Python took ~35% of a step. ``decode_attention`` does RoPE on q and k, writes k and v
into the layer's cache slot and attends each query head over its kv head's valid slots, in one parallel pass over
the (row, kv head) pairs.

Numerics: the HF reference's (``align.attention``): rotate-half RoPE from the model's cos / sign-folded sin tables,
scale ``1/sqrt(D)``, a softmax over the valid slots (max-subtracted, fp32); the float order differs from SDPA's, so
results agree to fp32 rounding (``tests/test_cpu_decode.py`` holds it to the torch path). Plain C++ built under each
kernel's flags (the AVX-512 and the AVX2 library each carry it): for D = 16, 32, 64 or 128 on 16-float generic
vectors (one zmm, or two ymm), the G query heads of a kv head together (each key row read once for all G), the exp
a Cephes polynomial (within 2 ulp; 0 below -87); any other D a scalar loop (``omp simd``) with ``std::exp``. On the
31M shape's step (16 rows, 64 slots) the vector path is ~2x faster than the scalar one, ~6% of the sampler's time.

Used by ``align.rollout.native.packed_weights`` where the kernel loads, for fp32 models without q/k norms or a
sliding window; anything else (a prefill, the CUDA graph's static cache, bf16) returns None and the model runs its
own attention.
"""

from __future__ import annotations

import torch

SOURCE = r"""
// One new token per row. qkv (B, (H + 2K) D): the fused projection; cos / sin (B, D): the RoPE tables of the
// token's position (sin sign-folded: rope(x) = x * cos + swap_halves(x) * sin); kc / vc (L, B, K, S, D): the cache,
// slot `length` of layer `layer` written here; valid (B, S): the slots each row attends to (slot `length` set by the
// caller). Returns (B, H D): each query head's attention over its kv head's valid slots 0..length.
inline void rope(const float* x, const float* c, const float* s, int64_t D, float* out) {
  const int64_t half = D / 2;
#pragma omp simd
  for (int64_t d = 0; d < half; ++d) out[d] = x[d] * c[d] + x[d + half] * s[d];
#pragma omp simd
  for (int64_t d = half; d < D; ++d) out[d] = x[d] * c[d] + x[d - half] * s[d];
}

#if defined(__has_builtin)
#if __has_builtin(__builtin_shufflevector) && __has_builtin(__builtin_convertvector)
#define ALIGN_VEC16 1
#endif
#endif

#ifdef ALIGN_VEC16
// 16 floats as one generic vector: one zmm under AVX-512, two ymm under AVX2 (the compiler lowers it).
typedef float V16 __attribute__((vector_size(64)));
typedef int32_t I16 __attribute__((vector_size(64)));
inline V16 vload(const float* p) { V16 v; __builtin_memcpy(&v, p, sizeof v); return v; }
inline void vstore(float* p, V16 v) { __builtin_memcpy(p, &v, sizeof v); }
inline V16 vsplat(float x) { return V16{} + x; }
inline float hsum(V16 v) {  // a pairwise tree over the 16 lanes
  v += __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  v += __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  return v[0];
}
// exp for x <= 0 (scores minus their maximum), Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, a degree-6 polynomial
// of r, scaled by 2^n through the exponent bits; within 2 ulp of std::exp down to -87 (below: 0, as expf's
// denormals are below any fp32 sum's rounding of the 1 the maximum contributes).
inline V16 vexp_neg(V16 x) {
  const V16 lo = vsplat(-87.0f);
  const I16 under = x < lo;
  x = x < lo ? lo : x;
  V16 fx = x * 1.44269504088896341f + 0.5f;
  const I16 ti = __builtin_convertvector(fx, I16);  // toward zero; floor for the negatives below
  V16 n = __builtin_convertvector(ti, V16);
  n = n > fx ? n - 1.0f : n;
  x = x - n * 0.693359375f - n * -2.12194440e-4f;
  const V16 z = x * x;
  V16 y = ((((1.9875691500e-4f * x + 1.3981999507e-3f) * x + 8.3334519073e-3f) * x + 4.1665795894e-2f) * x
           + 1.6666665459e-1f) * x + 5.0000001201e-1f;
  y = y * z + x + 1.0f;
  const I16 e = (__builtin_convertvector(n, I16) + 127) << 23;
  V16 scale;
  __builtin_memcpy(&scale, &e, sizeof scale);
  y = y * scale;
  return under ? V16{} : y;
}

// The G query heads of one kv head over its n valid slots idx[0..n), D = 16 C: scores (a dot per head and slot,
// each key row read once for the G heads), a softmax per head, then the weighted values (each head's D outputs
// in C vector accumulators, normalised once at the end). qs (G, D) roped queries; p a (G, n16) scratch.
template <int C>
void attend_heads(const float* qs, int64_t G, const float* kb, const float* vb, const int32_t* idx, int64_t n,
                  float scale, float* p, int64_t n16, float* out) {
  constexpr int64_t D = 16 * C;
  for (int64_t j = 0; j < n; ++j) {
    V16 k[C];
    for (int c = 0; c < C; ++c) k[c] = vload(kb + idx[j] * D + 16 * c);
    for (int64_t h = 0; h < G; ++h) {
      V16 acc = vload(qs + h * D) * k[0];
      for (int c = 1; c < C; ++c) acc += vload(qs + h * D + 16 * c) * k[c];
      p[h * n16 + j] = hsum(acc) * scale;
    }
  }
  const int64_t nv = (n + 15) / 16 * 16;  // this row's valid slots in whole vectors (n16: the longest row's)
  for (int64_t h = 0; h < G; ++h) {
    float* ph = p + h * n16;
    float top = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < n; ++j) top = std::max(top, ph[j]);
    for (int64_t j = n; j < nv; ++j) ph[j] = top;  // the tail block's lanes, zeroed after the exp
    V16 total{};
    for (int64_t j = 0; j < nv; j += 16) {
      V16 e = vexp_neg(vload(ph + j) - top);
      if (j + 16 > n) {
        for (int64_t l = n - j; l < 16; ++l) e[l] = 0.0f;
      }
      vstore(ph + j, e);
      total += e;
    }
    const float inv = 1.0f / hsum(total);
    V16 o[C] = {};
    for (int64_t j = 0; j < n; ++j) {
      const V16 w = vsplat(ph[j]);
      const float* vt = vb + idx[j] * D;
      for (int c = 0; c < C; ++c) o[c] += w * vload(vt + 16 * c);
    }
    for (int c = 0; c < C; ++c) vstore(out + h * D + 16 * c, o[c] * inv);
  }
}
#endif

// The scalar path (any D): one query head at a time, over the slots first..length.
void attend_scalar(const float* qs, int64_t G, const float* kb, const float* vb, const bool* okb, int64_t first,
                   int64_t length, int64_t D, float scale, float* p, float* out) {
  for (int64_t h = 0; h < G; ++h) {
    const float* q = qs + h * D;
    float top = -std::numeric_limits<float>::infinity();
    for (int64_t t = first; t <= length; ++t) {
      if (!okb[t]) continue;
      const float* kt = kb + t * D;
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < D; ++d) dot += q[d] * kt[d];
      p[t] = dot * scale;
      top = std::max(top, p[t]);
    }
    float total = 0.0f;
    for (int64_t t = first; t <= length; ++t) {
      p[t] = okb[t] ? std::exp(p[t] - top) : 0.0f;
      total += p[t];
    }
    float* o = out + h * D;
    std::fill(o, o + D, 0.0f);
    const float inv = 1.0f / total;
    for (int64_t t = first; t <= length; ++t) {
      if (!okb[t]) continue;
      const float w = p[t] * inv;
      const float* vt = vb + t * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) o[d] += w * vt[d];
    }
  }
}

at::Tensor decode_attention(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor kc,
                            at::Tensor vc, const at::Tensor& valid, int64_t layer, int64_t length, int64_t H) {
  TORCH_CHECK(kc.dim() == 5 && kc.is_contiguous() && vc.is_contiguous() && kc.sizes() == vc.sizes()
              && kc.scalar_type() == at::kFloat && vc.scalar_type() == at::kFloat,
              "align_cpu::decode_attention wants contiguous float32 (L, B, K, S, D) caches");
  const int64_t B = kc.size(1), K = kc.size(2), S = kc.size(3), D = kc.size(4);
  TORCH_CHECK(layer >= 0 && layer < kc.size(0) && length >= 0 && length < S && H % K == 0 && D % 2 == 0,
              "align_cpu::decode_attention: layer, length or heads out of range");
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(0) == B && qkv.size(1) == (H + 2 * K) * D && qkv.stride(1) == 1
              && qkv.scalar_type() == at::kFloat, "align_cpu::decode_attention wants qkv (B, (H + 2K) D) float32");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == B * D && sin.numel() == B * D
              && cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
              "align_cpu::decode_attention wants cos / sin of B x D float32");
  TORCH_CHECK(valid.dim() == 2 && valid.size(0) == B && valid.size(1) == S && valid.stride(1) == 1
              && valid.scalar_type() == at::kBool, "align_cpu::decode_attention wants valid (B, S) bool");
  const int64_t G = H / K, ld = qkv.stride(0), lv = valid.stride(0);
  const float scale = 1.0f / std::sqrt(float(D));
  at::Tensor out = at::empty({B, H * D}, qkv.options());
  const float* qp = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const bool* ok = valid.data_ptr<bool>();
  float* kp = kc.data_ptr<float>() + layer * B * K * S * D;
  float* vp = vc.data_ptr<float>() + layer * B * K * S * D;
  float* op = out.data_ptr<float>();
  const int64_t n16 = (length + 16) / 16 * 16;  // the slots 0..length, rounded up to whole vectors
  at::parallel_for(0, B * K, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> qs(G * D), p(G * n16);
    std::vector<int32_t> idx(length + 1);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / K, g = i % K;
      const float* row = qp + b * ld;
      const float* c = cp + b * D;
      const float* s = sp + b * D;
      const float* kb = kp + (b * K + g) * S * D;  // (S, D)
      const float* vb = vp + (b * K + g) * S * D;
      rope(row + (H + g) * D, c, s, D, kp + ((b * K + g) * S + length) * D);
      std::copy(row + (H + K + g) * D, row + (H + K + g + 1) * D, vp + ((b * K + g) * S + length) * D);
      for (int64_t h = 0; h < G; ++h) rope(row + (g * G + h) * D, c, s, D, qs.data() + h * D);
      const bool* okb = ok + b * lv;
      int64_t first = 0;  // the row's first valid slot: its left padding (a longer row's length) is never read
      while (first < length && !okb[first]) ++first;
      float* o = op + b * H * D + g * G * D;
#ifdef ALIGN_VEC16
      int64_t n = 0;
      for (int64_t t = first; t <= length; ++t) {
        if (okb[t]) idx[n++] = int32_t(t);
      }
      switch (D) {
        case 16: attend_heads<1>(qs.data(), G, kb, vb, idx.data(), n, scale, p.data(), n16, o); continue;
        case 32: attend_heads<2>(qs.data(), G, kb, vb, idx.data(), n, scale, p.data(), n16, o); continue;
        case 64: attend_heads<4>(qs.data(), G, kb, vb, idx.data(), n, scale, p.data(), n16, o); continue;
        case 128: attend_heads<8>(qs.data(), G, kb, vb, idx.data(), n, scale, p.data(), n16, o); continue;
        default: break;
      }
#endif
      attend_scalar(qs.data(), G, kb, vb, okb, first, length, D, scale, p.data(), o);
    }
  });
  return out;
}
"""

SCHEMA = (
    "decode_attention(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k, Tensor(b!) v, Tensor valid, int layer, "
    "int length, int heads) -> Tensor"
)


class FusedAttention:
    """``Attention.forward`` for one new token per row (``align.model.Attention`` calls it first while sampling on a
    CPU): the packed q|k|v GEMM, ``decode_attention``, the packed o_proj. Returns None where it does not apply (more
    than one new token, no cache or the static one, other dtypes): the model's own path runs."""

    def __init__(self, attn: torch.nn.Module, ops):
        self.attn, self.ops, self.heads = attn, ops, attn.H

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer: int, cache) -> torch.Tensor | None:
        B, T, _ = x.shape
        if T != 1 or cache is None or cache.slot is not None or x.dtype != torch.float32:
            return None
        if cache.k.dtype != torch.float32 or cos.dtype != torch.float32:
            return None
        qkv = self.attn.qkv(x).view(B, -1)  # (B, (H + 2K) D)
        out = self.ops.decode_attention(qkv, cos, sin, cache.k, cache.v, cache.valid, layer, cache.length, self.heads)
        return self.attn.o_proj(out.view(B, 1, -1))


def fusable(attn: torch.nn.Module, cfg) -> bool:
    """Whether ``FusedAttention`` computes this layer's attention: no q/k norms (Qwen3) and no sliding window."""
    return not attn.qk_norm and not cfg.sliding_window
