// A fresh prompt's causal self-attention in bf16 dot products (kvserve_paged::prefill_attention_bf16), for a bf16
// pool on a CPU with AVX512-BF16 where it times faster than torch's SDPA at start (inference.attention.
// fresh_bf16_kind). GEMM-shaped: per KV head the keys are packed once, transposed into bf16 pairs (16 keys a vector),
// and the values interleaved in pairs of tokens; each task is 16 queries x the query heads sharing that KV head, in
// tiles of kRows rows whose scores over a block of 32 keys are two vectors of vdpbf16ps sums (no reduction per dot
// product). The rounding is torch's bf16 SDPA's: q (scaled), K and V rounded to bf16, each block's softmax weights
// rounded to bf16 before they weigh V (their sum is taken of the rounded weights); scores, maxima, sums and outputs
// in fp32 (online softmax over blocks of 32 keys).
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "arith.h"
#include "cap.h"
#include "expo.h"
#include "pool.h"

#if defined(__x86_64__) && defined(__GNUC__)
#define KVS_PX86 1
#include <immintrin.h>
#endif

namespace {

#ifdef KVS_PX86
bool cpu_has_bf16_dot() {
  static const bool ok = [] {
    __builtin_cpu_init();
    return kvs::best_simd() == 2 && __builtin_cpu_supports("avx512bf16");
  }();
  return ok;
}

#pragma GCC push_options
#pragma GCC target("avx512f,avx512dq,avx512vl,avx512bw,avx512bf16,avx2,fma,bmi2")

constexpr int kKeys = 32;     // keys a block: two score vectors a row
constexpr int kQueries = 16;  // queries a task
constexpr int kRows = 8;      // rows (query, head) a tile: its scores in registers

// 32 fp32 (times `mul`) as 16 dwords of bf16 pairs: dword j = (x[2j], x[2j + 1]), rounded to nearest even
inline __m512i bf16_pairs(const float* x, __m512 mul) {
  const __m512 lo = _mm512_mul_ps(_mm512_loadu_ps(x), mul), hi = _mm512_mul_ps(_mm512_loadu_ps(x + 16), mul);
  return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
}

template <int D>
struct Packed {
  static constexpr int kPairs = D / 2, kChunks = D / 16;
  int64_t T, H, KVH, G, blocks;
  std::vector<uint32_t> q;   // [T, H, kPairs] the scaled queries' bf16 pairs
  std::vector<uint32_t> kt;  // [KVH, blocks, kPairs, 32]: pair j of key t of a block, keys in lanes (2 vectors)
  std::vector<uint32_t> vt;  // [KVH, blocks * 16, D]: dim d of tokens 2p and 2p + 1 of a block, dims in lanes
};

template <int D>
void pack_head(Packed<D>& pk, const float* k, const float* v, int64_t kvh) {
  constexpr int P = Packed<D>::kPairs;
  const __m512 one = _mm512_set1_ps(1.f);
  alignas(64) uint32_t rows[kKeys][P];
  for (int64_t b = 0; b < pk.blocks; ++b) {
    for (int t = 0; t < kKeys; ++t) {
      const int64_t tok = b * kKeys + t;
      for (int c = 0; c < P / 16; ++c) {
        const __m512i w = tok < pk.T ? bf16_pairs(k + (tok * pk.KVH + kvh) * D + 32 * c, one) : _mm512_setzero_si512();
        _mm512_store_si512(rows[t] + 16 * c, w);
      }
    }
    uint32_t* dst = pk.kt.data() + ((kvh * pk.blocks + b) * P) * kKeys;
    for (int j = 0; j < P; ++j)
      for (int t = 0; t < kKeys; ++t) dst[j * kKeys + t] = rows[t][j];
    for (int p = 0; p < kKeys / 2; ++p) {
      const int64_t a = b * kKeys + 2 * p;
      uint32_t* out = pk.vt.data() + ((kvh * pk.blocks * (kKeys / 2)) + b * (kKeys / 2) + p) * D;
      for (int d = 0; d < D; ++d) {
        const float va = a < pk.T ? v[(a * pk.KVH + kvh) * D + d] : 0.f;
        const float vb = a + 1 < pk.T ? v[((a + 1) * pk.KVH + kvh) * D + d] : 0.f;
        out[d] = static_cast<uint32_t>(c10::BFloat16(va).x) | (static_cast<uint32_t>(c10::BFloat16(vb).x) << 16);
      }
    }
  }
}

// the lanes of a 16-key half (keys 16 h .. 16 h + 15 of a block) a query `seen` keys into the block attends
inline __mmask16 half_mask(int64_t seen, int h) {
  const int64_t n = std::clamp<int64_t>(seen - 16 * h, 0, 16);
  return n == 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1);
}

// Rows [r0, r0 + n) of task (kvh, qb) (row r: query qb * 16 + r / G, head kvh * G + r % G) over their causal keys
template <int D>
void attend_tile(const Packed<D>& pk, float* out, int64_t kvh, int64_t qb, int64_t r0, int n) {
  constexpr int P = Packed<D>::kPairs, C = Packed<D>::kChunks;
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  int64_t query[kRows], head[kRows];
  for (int r = 0; r < kRows; ++r) {
    const int64_t rr = r0 + std::min(r, n - 1);  // rows past n repeat the last (computed, never written)
    query[r] = qb * kQueries + rr / pk.G;
    head[r] = kvh * pk.G + rr % pk.G;
  }
  const uint32_t* qp[kRows];
  for (int r = 0; r < kRows; ++r) qp[r] = pk.q.data() + (query[r] * pk.H + head[r]) * P;
  alignas(64) float mx[16], m_new[16], alpha[16];  // the tile's rows in the first kRows lanes
  float sm[kRows];
  alignas(64) float acc[kRows][D];
  alignas(64) uint32_t pw[kRows][kKeys / 2];  // each row's block weights as bf16 pairs (tokens 2p, 2p + 1)
  for (int r = 0; r < 16; ++r) mx[r] = m_new[r] = kNegInf;
  for (int r = 0; r < kRows; ++r) {
    sm[r] = 0.f;
    for (int d = 0; d < D; ++d) acc[r][d] = 0.f;
  }
  const int64_t last = query[kRows - 1] / kKeys;
  for (int64_t b = 0; b <= last; ++b) {
    const uint32_t* kt = pk.kt.data() + ((kvh * pk.blocks + b) * P) * kKeys;
    __m512 s[kRows][2];
    for (int r = 0; r < kRows; ++r) s[r][0] = s[r][1] = _mm512_setzero_ps();
    for (int j = 0; j < P; ++j) {
      const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kt + j * kKeys);
      const __m512bh k1 = (__m512bh)_mm512_loadu_si512(kt + j * kKeys + 16);
      for (int r = 0; r < kRows; ++r) {
        const __m512bh qj = (__m512bh)_mm512_set1_epi32(static_cast<int>(qp[r][j]));
        s[r][0] = _mm512_dpbf16_ps(s[r][0], k0, qj);
        s[r][1] = _mm512_dpbf16_ps(s[r][1], k1, qj);
      }
    }
    for (int r = 0; r < kRows; ++r) {
      const int64_t seen = query[r] - b * kKeys + 1;  // keys of this block row r attends: at least 1 (b <= its block)
      for (int h = 0; h < 2; ++h)
        s[r][h] = _mm512_mask_mov_ps(_mm512_set1_ps(kNegInf), half_mask(seen, h), s[r][h]);
      m_new[r] = std::max(mx[r], _mm512_reduce_max_ps(_mm512_max_ps(s[r][0], s[r][1])));
    }
    // every row's rescale at once (-inf - finite: e^-87 ~ 0 times a zero state)
    _mm512_store_ps(alpha, kvs::exp512_nonpositive(_mm512_sub_ps(_mm512_load_ps(mx), _mm512_load_ps(m_new))));
    const uint32_t* vt = pk.vt.data() + (kvh * pk.blocks * (kKeys / 2) + b * (kKeys / 2)) * D;
    for (int r = 0; r < kRows; ++r) {
      const __m512 mr = _mm512_set1_ps(m_new[r]);
      const int64_t seen = query[r] - b * kKeys + 1;
      const __m512 p0 = _mm512_maskz_mov_ps(half_mask(seen, 0), kvs::exp512_nonpositive(_mm512_sub_ps(s[r][0], mr)));
      const __m512 p1 = _mm512_maskz_mov_ps(half_mask(seen, 1), kvs::exp512_nonpositive(_mm512_sub_ps(s[r][1], mr)));
      const __m512bh pb = _mm512_cvtne2ps_pbh(p1, p0);
      const __m512i raw = (__m512i)pb;
      const __m512 back = _mm512_add_ps(_mm512_cvtpbh_ps((__m256bh)_mm512_castsi512_si256(raw)),
                                        _mm512_cvtpbh_ps((__m256bh)_mm512_extracti64x4_epi64(raw, 1)));
      sm[r] = sm[r] * alpha[r] + _mm512_reduce_add_ps(back);
      _mm512_store_si512(pw[r], (__m512i)pb);
      mx[r] = m_new[r];
      __m512 o[C];
      const __m512 av = _mm512_set1_ps(alpha[r]);  // the running output rescaled to this block's max
      for (int c = 0; c < C; ++c) o[c] = _mm512_mul_ps(_mm512_load_ps(acc[r] + 16 * c), av);
      for (int p = 0; p < kKeys / 2; ++p) {
        const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int>(pw[r][p]));
        for (int c = 0; c < C; ++c)
          o[c] = _mm512_dpbf16_ps(o[c], w, (__m512bh)_mm512_loadu_si512(vt + p * D + 16 * c));
      }
      for (int c = 0; c < C; ++c) _mm512_store_ps(acc[r] + 16 * c, o[c]);
    }
  }
  for (int r = 0; r < n; ++r) {
    float* dst = out + (query[r] * pk.H + head[r]) * D;
    const float inv = 1.f / sm[r];
    for (int d = 0; d < D; ++d) dst[d] = acc[r][d] * inv;
  }
}

template <int D>
void prefill_bf16(float* out, const float* q, const float* k, const float* v, int64_t T, int64_t H, int64_t KVH,
                  float scale) {
  constexpr int P = Packed<D>::kPairs;
  Packed<D> pk;
  pk.T = T, pk.H = H, pk.KVH = KVH, pk.G = H / KVH, pk.blocks = kvs::cdiv(T, kKeys);
  pk.q.resize(static_cast<size_t>(T * H * P));
  pk.kt.resize(static_cast<size_t>(KVH * pk.blocks * P * kKeys));
  pk.vt.resize(static_cast<size_t>(KVH * pk.blocks * (kKeys / 2) * D));
  const __m512 sc = _mm512_set1_ps(scale);
  kvs::parallel_chunks(KVH + 1, [&](int64_t c) {
    if (c < KVH) return pack_head<D>(pk, k, v, c);
    for (int64_t row = 0; row < T * H; ++row)
      for (int j = 0; j < P / 16; ++j)
        _mm512_storeu_si512(pk.q.data() + row * P + 16 * j, bf16_pairs(q + row * D + 32 * j, sc));
  });
  // tasks (kvh, query block, tile), the longest (last query blocks) first
  const int64_t qblocks = kvs::cdiv(T, kQueries), tiles = kvs::cdiv(kQueries * pk.G, kRows);
  kvs::parallel_chunks(KVH * qblocks * tiles, [&](int64_t at) {
    const int64_t tile = at % tiles, kvh = (at / tiles) % KVH, qb = qblocks - 1 - at / (tiles * KVH);
    const int64_t rows = std::min<int64_t>(kQueries, T - qb * kQueries) * pk.G, r0 = tile * kRows;
    if (r0 < rows) attend_tile<D>(pk, out, kvh, qb, r0, static_cast<int>(std::min<int64_t>(kRows, rows - r0)));
  });
}

#pragma GCC pop_options
#else
bool cpu_has_bf16_dot() { return false; }
#endif  // KVS_PX86

// out, q [T, H, D] fp32; k, v [T, KVH, D] fp32 (this chunk's own, the whole prompt so far: causal, T == keys)
void prefill_attention_bf16(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            double scale) {
  TORCH_CHECK(cpu_has_bf16_dot(), "prefill_attention_bf16 needs AVX512-BF16 (and AVX-512 not capped away)");
  for (const auto* t : {&out, &q, &k, &v})
    TORCH_CHECK(t->dim() == 3 && t->is_contiguous() && t->scalar_type() == at::kFloat && t->device().is_cpu(),
                "prefill_attention_bf16 takes contiguous fp32 CPU tensors [T, heads, head_dim]");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), KVH = k.size(1);
  TORCH_CHECK(out.sizes() == q.sizes() && k.sizes() == v.sizes() && k.size(0) == T && k.size(2) == D &&
                  KVH > 0 && H % KVH == 0, "q, out [T, H, D]; k, v [T, KVH, D] with H a multiple of KVH");
#ifdef KVS_PX86
  const float s = static_cast<float>(scale);
  float* o = out.data_ptr<float>();
  const float *qd = q.data_ptr<float>(), *kd = k.data_ptr<float>(), *vd = v.data_ptr<float>();
  switch (D) {
    case 32: return prefill_bf16<32>(o, qd, kd, vd, T, H, KVH, s);
    case 64: return prefill_bf16<64>(o, qd, kd, vd, T, H, KVH, s);
    case 128: return prefill_bf16<128>(o, qd, kd, vd, T, H, KVH, s);
    default: break;
  }
#endif
  TORCH_CHECK(false, "prefill_attention_bf16 takes head_dim 32, 64 or 128, not ", D);
}

bool prefill_bf16_available() { return cpu_has_bf16_dot(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvserve_paged, m) {
  m.def("prefill_attention_bf16(Tensor(a!) out, Tensor q, Tensor k, Tensor v, float scale) -> ()");
  m.def("prefill_bf16_available() -> bool", &prefill_bf16_available);
}

TORCH_LIBRARY_IMPL(kvserve_paged, CPU, m) { m.impl("prefill_attention_bf16", &prefill_attention_bf16); }
