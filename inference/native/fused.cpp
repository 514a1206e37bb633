// A decoder layer's elementwise work fused into single passes: RMSNorm (kvserve_paged::rms_norm), RoPE with the K/V
// pool write (::rope_store) and SiLU(gate) * up (::silu_mul); and the greedy rows' argmax (::argmax_rows). At one
// decode row torch runs RMSNorm as ~8 ops (~20-30 us on these CPUs; this: ~5 us), RoPE as slice/neg/cat/mul/add and
// the write as two index_puts. fp32 math, written in fp32 or (for a bf16 matmul's input) straight in bf16, rounded to
// nearest even as Tensor.to(torch.bfloat16) does, which saves that cast. SiLU * up is one AVX-512 pass (torch: silu,
// then mul, and a temporary; a plain loop's scalar exp lost to torch's vectorized one, 12.4 vs 9.7 us at one row):
// 1.4x torch's two at a 500-token prefill's [500, 1536] on an Ice Lake Xeon (363 vs 502 us), 0.45 against ~1 ms a
// layer inside a prefill; without AVX-512, torch's own two ops.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/silu.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "arith.h"
#include "cap.h"
#include "expo.h"
#include "pool.h"

#if defined(__x86_64__) && defined(__GNUC__)
#define KVS_FX86 1
#include <immintrin.h>
#endif

namespace {

template <typename Out>
void rms_rows(const float* x, const float* w, Out* out, int64_t rows, int64_t h, float eps) {
  const int64_t chunks = std::min<int64_t>(kvs::cdiv(rows, 16), 8 * kvs::threads());
  kvs::parallel_chunks(chunks, [&](int64_t c) {
    int64_t lo, hi;
    kvs::chunk_range(rows, chunks, c, &lo, &hi);
    for (int64_t r = lo; r < hi; ++r) {
      const float* xr = x + r * h;
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < h; ++i) ss += xr[i] * xr[i];
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(h) + eps);
      Out* o = out + r * h;
      for (int64_t i = 0; i < h; ++i) o[i] = static_cast<Out>(xr[i] * inv * w[i]);
    }
  });
}

// x: fp32 [rows, h] contiguous; w: fp32 [h]. Returns x * rsqrt(mean(x^2) + eps) * w in fp32, or bf16 if to_bf16.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps, bool to_bf16) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "rms_norm: x must be a contiguous fp32 CPU matrix");
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.is_contiguous() && w.numel() == x.size(1),
              "rms_norm: w must be fp32 [", x.size(1), "]");
  at::Tensor out = at::empty(x.sizes(), x.options().dtype(to_bf16 ? at::kBFloat16 : at::kFloat));
  const float e = static_cast<float>(eps);
  if (to_bf16)
    rms_rows(x.data_ptr<float>(), w.data_ptr<float>(), out.data_ptr<c10::BFloat16>(), x.size(0), x.size(1), e);
  else
    rms_rows(x.data_ptr<float>(), w.data_ptr<float>(), out.data_ptr<float>(), x.size(0), x.size(1), e);
  return out;
}

// A K or V row of n values into the pool: as is, rounded to bf16 (nearest even, as Tensor.to(torch.bfloat16)), or
// as int8 codes and their fp32 scale after them (inference.kv_cache.quantize_rows, the same operations: scale =
// max |x| / 127, code = x / scale rounded to nearest even; a row of zeros is all zero bytes; a NaN, a NaN scale).
inline void kv_store(float* dst, const float* src, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void kv_store(c10::BFloat16* dst, const float* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = c10::BFloat16(src[i]);
}
inline void kv_store(int8_t* dst, const float* src, int64_t n) {
  constexpr float kRound = 12582912.f;  // 1.5 x 2^23: adding and taking it away rounds |y| < 2^22 to nearest even
  float amax = 0.f;
  int nan = 0;
#pragma omp simd reduction(max : amax) reduction(| : nan)
  for (int64_t i = 0; i < n; ++i) {  // two vectorized reductions: max |x| and whether any x is NaN
    const float a = std::fabs(src[i]);
    amax = std::max(amax, a);
    nan |= a != a;
  }
  // a NaN makes the scale NaN (and the codes 0): the row reads back as NaN
  const float scale = nan ? std::numeric_limits<float>::quiet_NaN() : amax / 127.f;
  if (scale > 0.f) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
      const float y = (src[i] / scale + kRound) - kRound;  // not folded: no -ffast-math
      dst[i] = static_cast<int8_t>(std::clamp(y, -127.f, 127.f));
    }
  } else {
    std::memset(dst, 0, n);
  }
  std::memcpy(dst + n, &scale, sizeof scale);
}

// RoPE (rotate-half, fp32) of a step's fused q|k|v projection and the K/V write into the page pool, one pass:
// qkv [T, (H + 2 KVH) * D] fp32; cos, sin [T, D]; pool [P + 1, L, 2, S, KVH, D] fp32 or bf16, or [.., D + 4] int8
// (inference/kv_cache.py);
// pages, offsets [T] int64 (each token's slot, checked by the block manager before the step). Returns q|k
// rotated, [T, H + KVH, D]; v stays the view of qkv the caller takes.
at::Tensor rope_store(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor pool,
                      int64_t layer, const at::Tensor& pages, const at::Tensor& offsets, int64_t heads,
                      int64_t kv_heads) {
  TORCH_CHECK(qkv.device().is_cpu() && qkv.scalar_type() == at::kFloat && qkv.dim() == 2 && qkv.is_contiguous(),
              "rope_store: qkv must be a contiguous fp32 CPU matrix");
  const bool int8 = pool.scalar_type() == at::kChar;
  TORCH_CHECK((pool.scalar_type() == at::kFloat || pool.scalar_type() == at::kBFloat16 || int8) && pool.dim() == 6 &&
                  pool.is_contiguous(),
              "rope_store: pool must be the contiguous fp32, bf16 or int8 page pool");
  TORCH_CHECK(heads > 0 && kv_heads > 0 && qkv.size(1) % (heads + 2 * kv_heads) == 0, "rope_store: qkv [T, ",
              qkv.size(1), "] is not ", heads, " + 2 x ", kv_heads, " heads");
  const int64_t T = qkv.size(0), D = qkv.size(1) / (heads + 2 * kv_heads), half = D / 2, S = pool.size(3);
  const int64_t P = pool.size(0), Dr = pool.size(5);  // a pool row: head_dim values (int8: then a 4-byte scale)
  TORCH_CHECK(pool.size(4) == kv_heads && Dr == D + (int8 ? 4 : 0) && D % 2 == 0,
              "rope_store: qkv [T, ", qkv.size(1), "] does not match ", heads, " + 2 x ", kv_heads, " heads of the "
              "pool's rows of ", Dr);
  TORCH_CHECK(layer >= 0 && layer < pool.size(1), "rope_store: layer ", layer, " out of range");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.numel() == T * D && sin.numel() == T * D,
              "rope_store: cos and sin must be contiguous fp32 [T, D]");
  TORCH_CHECK(pages.scalar_type() == at::kLong && offsets.scalar_type() == at::kLong && pages.numel() == T &&
                  offsets.numel() == T && pages.is_contiguous() && offsets.is_contiguous(),
              "rope_store: pages and offsets must be contiguous int64 [T]");
  const int64_t* pg = pages.data_ptr<int64_t>();
  const int64_t* of = offsets.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)  // outside the pool, or the null page (row P - 1, always zero): a bug upstream
    TORCH_CHECK(pg[t] >= 0 && pg[t] < P - 1 && of[t] >= 0 && of[t] < S, "rope_store: slot (", pg[t], ", ", of[t],
                ") is not a page of the pool");
  const int64_t rotated = heads + kv_heads;
  at::Tensor out = at::empty({T, rotated, D}, qkv.options());
  const float* src = qkv.data_ptr<float>();
  const float* c = cos.data_ptr<float>();
  const float* s = sin.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const int64_t row = qkv.size(1), kv_stride = S * kv_heads * Dr;  // K -> V: one [S, KVH, row] block further
  const int64_t page_stride = pool.stride(0), layer_off = layer * pool.stride(1);
  const int64_t chunks = std::min<int64_t>(kvs::cdiv(T, 8), 8 * kvs::threads());
  auto run = [&](auto* data) {
    kvs::parallel_chunks(chunks, [&](int64_t chunk) {
      int64_t lo, hi;
      kvs::chunk_range(T, chunks, chunk, &lo, &hi);
      for (int64_t t = lo; t < hi; ++t) {
        const float* x = src + t * row;
        const float* ct = c + t * D;
        const float* st = s + t * D;
        auto* k_slot = data + pg[t] * page_stride + layer_off + of[t] * kv_heads * Dr;
        for (int64_t h = 0; h < rotated; ++h) {
          const float* xh = x + h * D;
          float* oh = o + (t * rotated + h) * D;
          for (int64_t i = 0; i < half; ++i) oh[i] = xh[i] * ct[i] + (-xh[i + half]) * st[i];
          for (int64_t i = half; i < D; ++i) oh[i] = xh[i] * ct[i] + xh[i - half] * st[i];
          if (h >= heads) kv_store(k_slot + (h - heads) * Dr, oh, D);
        }
        for (int64_t h = 0; h < kv_heads; ++h)  // v, as projected
          kv_store(k_slot + kv_stride + h * Dr, x + (rotated + h) * D, D);
      }
    });
  };
  if (pool.scalar_type() == at::kBFloat16)
    run(pool.data_ptr<c10::BFloat16>());
  else if (int8)
    run(pool.data_ptr<int8_t>());
  else
    run(pool.data_ptr<float>());
  return out;
}

// The first index of a row's largest value, as torch.argmax: a NaN counts as the largest (its first index wins), an
// all -inf row gives 0. One pass keeping each lane's first largest and its index (strictly greater replaces, so a
// lane keeps its earliest), then the smallest index among the lanes holding the max; a NaN seen means a rescan
// for the first one. Torch's argmax at 32 rows of a 49k vocabulary: ~10x slower here (as fast as amax: bandwidth).
int64_t first_nan(const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if (x[i] != x[i]) return i;
  return -1;
}

int64_t row_argmax_generic(const float* x, int64_t n) {
  int64_t r = 0;
  float m = x[0];
  for (int64_t i = 0; i < n; ++i) {
    if (x[i] != x[i]) return i;
    if (x[i] > m) m = x[i], r = i;
  }
  return r;
}

#if KVS_FX86
__attribute__((target("avx512f,avx512dq,avx512bw,avx512vl"))) int64_t row_argmax_avx512(const float* x, int64_t n) {
  __m512 best = _mm512_set1_ps(-INFINITY);
  __m512i at = _mm512_setzero_si512(), idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i step = _mm512_set1_epi32(16);
  __mmask16 nan = 0;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    const __mmask16 gt = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    best = _mm512_mask_mov_ps(best, gt, v);
    at = _mm512_mask_mov_epi32(at, gt, idx);
    idx = _mm512_add_epi32(idx, step);
  }
  float m = _mm512_reduce_max_ps(best);
  int64_t r = _mm512_mask_reduce_min_epi32(_mm512_cmp_ps_mask(best, _mm512_set1_ps(m), _CMP_EQ_OQ), at);
  for (; i < n; ++i) {
    if (x[i] != x[i]) nan = 1;
    if (x[i] > m) m = x[i], r = i;
  }
  return nan ? first_nan(x, n) : r;
}

__attribute__((target("avx2,fma"))) int64_t row_argmax_avx2(const float* x, int64_t n) {
  __m256 best = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
  __m256i at = _mm256_setzero_si256(), idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i step = _mm256_set1_epi32(8);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    const __m256 gt = _mm256_cmp_ps(v, best, _CMP_GT_OQ);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    best = _mm256_blendv_ps(best, v, gt);
    at = _mm256_blendv_epi8(at, idx, _mm256_castps_si256(gt));
    idx = _mm256_add_epi32(idx, step);
  }
  alignas(32) float bv[8];
  alignas(32) int32_t bi[8];
  _mm256_store_ps(bv, best);
  _mm256_store_si256(reinterpret_cast<__m256i*>(bi), at);
  float m = bv[0];
  int64_t r = bi[0];
  for (int k = 1; k < 8; ++k)
    if (bv[k] > m || (bv[k] == m && bi[k] < r)) m = bv[k], r = bi[k];
  bool any_nan = _mm256_movemask_ps(nan) != 0;
  for (; i < n; ++i) {
    if (x[i] != x[i]) any_nan = true;
    if (x[i] > m) m = x[i], r = i;
  }
  return any_nan ? first_nan(x, n) : r;
}
#endif  // KVS_FX86

// x: fp32 [rows, n] contiguous, n > 0. Returns int64 [rows]: each row's argmax (row_argmax), rows across the pool.
at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous() &&
                  x.size(1) > 0 && x.size(1) <= INT32_MAX,
              "argmax_rows: x must be a contiguous fp32 CPU matrix of 1 to 2^31 - 1 columns");
  static const auto pick = [] {
#if KVS_FX86
    if (const int simd = kvs::best_simd()) return simd == 2 ? &row_argmax_avx512 : &row_argmax_avx2;
#endif
    return &row_argmax_generic;
  }();
  const int64_t rows = x.size(0), n = x.size(1);
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  if (rows == 0) return out;
  const float* src = x.data_ptr<float>();
  int64_t* dst = out.data_ptr<int64_t>();
  const int64_t chunks = std::min<int64_t>(rows, 4 * kvs::threads());
  kvs::parallel_chunks(chunks, [&](int64_t c) {
    int64_t lo, hi;
    kvs::chunk_range(rows, chunks, c, &lo, &hi);
    for (int64_t r = lo; r < hi; ++r) dst[r] = pick(src + r * n, n);
  });
  return out;
}

#ifdef KVS_FX86
// rows [lo, hi) of silu_mul: sigmoid(x) from t = e^-|x| (kvs::exp512_nonpositive, relative error < 1e-7) as
// 1 / (1 + t) for x >= 0 and t / (1 + t) below, so nothing overflows; a NaN stays NaN
__attribute__((target("avx512f,avx512dq"))) void silu_mul_rows_avx512(const float* src, float* dst, int64_t lo,
                                                                      int64_t hi, int64_t inter) {
  const __m512 one = _mm512_set1_ps(1.f), zero = _mm512_setzero_ps();
  for (int64_t r = lo; r < hi; ++r) {
    const float* g = src + r * 2 * inter;
    const float* u = g + inter;
    float* o = dst + r * inter;
    for (int64_t i = 0; i < inter; i += 16) {
      const __mmask16 m = inter - i >= 16 ? static_cast<__mmask16>(0xFFFF)
                                          : static_cast<__mmask16>((1u << (inter - i)) - 1);
      const __m512 x = _mm512_maskz_loadu_ps(m, g + i), up = _mm512_maskz_loadu_ps(m, u + i);
      const __m512 t = kvs::exp512_nonpositive(_mm512_sub_ps(zero, _mm512_abs_ps(x)));
      const __mmask16 pos = _mm512_cmp_ps_mask(x, zero, _CMP_GE_OQ);
      const __m512 sig = _mm512_div_ps(_mm512_mask_blend_ps(pos, t, one), _mm512_add_ps(one, t));
      _mm512_mask_storeu_ps(o + i, m, _mm512_mul_ps(_mm512_mul_ps(x, sig), up));
    }
  }
}
#endif

// gate_up [T, 2 I] fp32 contiguous (a fused gate|up projection) -> SiLU(gate) * up [T, I], one pass over the rows
at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.device().is_cpu() && gate_up.scalar_type() == at::kFloat && gate_up.dim() == 2 &&
                  gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "silu_mul: gate_up must be a contiguous fp32 CPU matrix [T, 2 I]");
  const int64_t T = gate_up.size(0), inter = gate_up.size(1) / 2;
#ifdef KVS_FX86
  if (kvs::best_simd() == 2) {
    at::Tensor out = at::empty({T, inter}, gate_up.options());
    const float* src = gate_up.data_ptr<float>();
    float* dst = out.data_ptr<float>();
    const int64_t chunks = std::min<int64_t>(T, 4 * kvs::threads());
    kvs::parallel_chunks(chunks, [&](int64_t c) {
      int64_t lo, hi;
      kvs::chunk_range(T, chunks, c, &lo, &hi);
      silu_mul_rows_avx512(src, dst, lo, hi, inter);
    });
    return out;
  }
#endif
  return at::silu(gate_up.narrow(1, 0, inter)).mul_(gate_up.narrow(1, inter, inter));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvserve_paged, m) {
  m.def("silu_mul(Tensor gate_up) -> Tensor", &silu_mul);
  m.def("argmax_rows(Tensor x) -> Tensor", &argmax_rows);
  m.def("rms_norm(Tensor x, Tensor w, float eps, bool to_bf16) -> Tensor", &rms_norm);
  m.def("rope_store(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) pool, int layer, Tensor pages, Tensor offsets, "
        "int heads, int kv_heads) -> Tensor", &rope_store);
}
