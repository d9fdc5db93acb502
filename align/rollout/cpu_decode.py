"""The CPU decode step's attention for one new token per row, fused into one C++ op beside the decode GEMM
(``align.rollout.cpu_kernel`` builds both into one library, so the same build-once contract and fallback hold).

Why: at decode the attention of one token is ~15 small torch ops per layer (split the fused q|k|v, RoPE on q and k,
two cache writes, the cache slices, the masked SDPA call, the transposes), each a dispatch and an allocation; on the
31M shape they, RMSNorm and Python took ~35% of a step. ``decode_attention`` does RoPE on q and k, writes k and v
into the layer's cache slot and attends each query head over its kv head's valid slots, in one parallel pass over
the (row, kv head) pairs.

Numerics: the HF reference's (``align.attention``): rotate-half RoPE from the model's cos / sign-folded sin tables,
scale ``1/sqrt(D)``, a softmax over the valid slots (max-subtracted, fp32); the float order differs from SDPA's, so
results agree to fp32 rounding (``tests/test_cpu_decode.py`` holds it to the torch path). Plain C++ that the compiler
vectorises (``omp simd``), built under each kernel's flags: the AVX-512 and the AVX2 library each carry it.

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
  at::parallel_for(0, B * K, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> q(D), p(length + 1);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / K, g = i % K;
      const float* row = qp + b * ld;
      const float* c = cp + b * D;
      const float* s = sp + b * D;
      const float* kb = kp + (b * K + g) * S * D;  // (S, D)
      const float* vb = vp + (b * K + g) * S * D;
      rope(row + (H + g) * D, c, s, D, kp + ((b * K + g) * S + length) * D);
      std::copy(row + (H + K + g) * D, row + (H + K + g + 1) * D, vp + ((b * K + g) * S + length) * D);
      const bool* okb = ok + b * lv;
      int64_t first = 0;  // the row's first valid slot: its left padding (a longer row's length) is never read
      while (first < length && !okb[first]) ++first;
      for (int64_t h = g * G; h < (g + 1) * G; ++h) {
        rope(row + h * D, c, s, D, q.data());
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
        float* o = op + b * H * D + h * D;
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
