// A fresh prompt's causal self-attention in bf16 dot products (kvserve_paged::prefill_attention_bf16), for a bf16
// pool on a CPU with AVX512-BF16 where it times faster than torch's SDPA at start (inference.attention.
// fresh_bf16_kind). GEMM-shaped: per KV head the keys are packed once, transposed into bf16 pairs (16 keys a vector),
// and the values interleaved in pairs of tokens; each task is 16 queries x the query heads sharing that KV head, in
// tiles of kRows rows whose scores over a block of 32 keys are two vectors of vdpbf16ps sums (no reduction per dot
// product). The rounding is torch's bf16 SDPA's: q (scaled), K and V rounded to bf16, each block's softmax weights
// rounded to bf16 before they weigh V (their sum is taken of the rounded weights); scores, maxima, sums and outputs
// in fp32 (online softmax over blocks of 32 keys).
//
// prefill_attention_fp32: the same tiling in fp32 FMAs (AVX-512F), for an AVX-512 CPU without bf16 dot products (an
// Ice Lake Xeon, where torch's fp32 SDPA is the alternative) or wherever it times faster: keys packed per block of 32
// with the keys in lanes, scores of kRows rows two vectors each, exact fp32 (only the order of the sums differs from
// SDPA's), the softmax weights never rounded.
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

// A prompt's q [T, H, D] and k, v [T, KVH, D] (fp32), each token's row `*s` elements after the last: views into
// the fused projection's output are read in place
struct Prompt {
  const float *q, *k, *v;
  int64_t qs, ks, vs, T, H, KVH;
  const float* q_at(int64_t t, int64_t h, int64_t D) const { return q + t * qs + h * D; }
  const float* k_at(int64_t t, int64_t kvh, int64_t D) const { return k + t * ks + kvh * D; }
  const float* v_at(int64_t t, int64_t kvh, int64_t D) const { return v + t * vs + kvh * D; }
};

#ifdef KVS_PX86
bool cpu_has_bf16_dot() {
  static const bool ok = [] {
    __builtin_cpu_init();
    return kvs::best_simd() == 2 && __builtin_cpu_supports("avx512bf16");
  }();
  return ok;
}

constexpr int kKeys = 32;     // keys a block: two score vectors a row
constexpr int kQueries = 16;  // queries a task
constexpr int kRows = 8;      // rows (query, head) a tile: its scores in registers

// the lanes of a 16-key half (keys 16 h .. 16 h + 15 of a block) a query `seen` keys into the block attends
inline __mmask16 half_mask(int64_t seen, int h) {
  const int64_t n = std::clamp<int64_t>(seen - 16 * h, 0, 16);
  return n == 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1);
}

// A prompt's work as tasks (kvh, query block of kQueries, tile of kRows rows: row r is query r / G of the block,
// head kvh * G + r % G), on the kernels' threads, the longest (last query blocks) first: tile(kvh, qb, r0, n) does
// rows [r0, r0 + n) of (kvh, qb)
template <typename F>
void for_each_tile(int64_t T, int64_t G, int64_t KVH, F&& tile) {
  const int64_t qblocks = kvs::cdiv(T, kQueries), tiles = kvs::cdiv(kQueries * G, kRows);
  kvs::parallel_chunks(KVH * qblocks * tiles, [&](int64_t at) {
    const int64_t t = at % tiles, kvh = (at / tiles) % KVH, qb = qblocks - 1 - at / (tiles * KVH);
    const int64_t rows = std::min<int64_t>(kQueries, T - qb * kQueries) * G, r0 = t * kRows;
    if (r0 < rows) tile(kvh, qb, r0, static_cast<int>(std::min<int64_t>(kRows, rows - r0)));
  });
}

// a tile's kRows rows as (query, head); rows past n repeat the last (computed, never written)
inline void tile_rows(int64_t G, int64_t kvh, int64_t qb, int64_t r0, int n, int64_t* query, int64_t* head) {
  for (int r = 0; r < kRows; ++r) {
    const int64_t rr = r0 + std::min(r, n - 1);
    query[r] = qb * kQueries + rr / G;
    head[r] = kvh * G + rr % G;
  }
}

#pragma GCC push_options
#pragma GCC target("avx512f,avx512dq,avx512vl,avx512bw,avx512bf16,avx2,fma,bmi2")

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
void pack_head(Packed<D>& pk, const Prompt& in, int64_t kvh) {
  constexpr int P = Packed<D>::kPairs;
  const __m512 one = _mm512_set1_ps(1.f);
  alignas(64) uint32_t rows[kKeys][P];
  for (int64_t b = 0; b < pk.blocks; ++b) {
    for (int t = 0; t < kKeys; ++t) {
      const int64_t tok = b * kKeys + t;
      for (int c = 0; c < P / 16; ++c) {
        const __m512i w = tok < pk.T ? bf16_pairs(in.k_at(tok, kvh, D) + 32 * c, one) : _mm512_setzero_si512();
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
        const float va = a < pk.T ? in.v_at(a, kvh, D)[d] : 0.f;
        const float vb = a + 1 < pk.T ? in.v_at(a + 1, kvh, D)[d] : 0.f;
        out[d] = static_cast<uint32_t>(c10::BFloat16(va).x) | (static_cast<uint32_t>(c10::BFloat16(vb).x) << 16);
      }
    }
  }
}

// Rows [r0, r0 + n) of task (kvh, qb) (row r: query qb * 16 + r / G, head kvh * G + r % G) over their causal keys
template <int D>
void attend_tile(const Packed<D>& pk, float* out, int64_t kvh, int64_t qb, int64_t r0, int n) {
  constexpr int P = Packed<D>::kPairs, C = Packed<D>::kChunks;
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  int64_t query[kRows], head[kRows];
  tile_rows(pk.G, kvh, qb, r0, n, query, head);
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
void prefill_bf16(float* out, const Prompt& in, float scale) {
  const int64_t T = in.T, H = in.H, KVH = in.KVH;
  constexpr int P = Packed<D>::kPairs;
  Packed<D> pk;
  pk.T = T, pk.H = H, pk.KVH = KVH, pk.G = H / KVH, pk.blocks = kvs::cdiv(T, kKeys);
  pk.q.resize(static_cast<size_t>(T * H * P));
  pk.kt.resize(static_cast<size_t>(KVH * pk.blocks * P * kKeys));
  pk.vt.resize(static_cast<size_t>(KVH * pk.blocks * (kKeys / 2) * D));
  const __m512 sc = _mm512_set1_ps(scale);
  kvs::parallel_chunks(KVH + 1, [&](int64_t c) {
    if (c < KVH) return pack_head<D>(pk, in, c);
    for (int64_t row = 0; row < T * H; ++row)
      for (int j = 0; j < P / 16; ++j)
        _mm512_storeu_si512(pk.q.data() + row * P + 16 * j, bf16_pairs(in.q_at(row / H, row % H, D) + 32 * j, sc));
  });
  for_each_tile(T, pk.G, KVH, [&](int64_t kvh, int64_t qb, int64_t r0, int n) {
    attend_tile<D>(pk, out, kvh, qb, r0, n);
  });
}

#pragma GCC pop_options

bool cpu_has_avx512() {
  static const bool ok = kvs::best_simd() == 2;
  return ok;
}

#pragma GCC push_options
#pragma GCC target("avx512f,avx512dq,avx512vl,avx512bw,avx2,fma,bmi2")

template <int D>
struct PackedF32 {
  int64_t T, H, KVH, G, blocks;
  Prompt in;               // q read as given (the scale is applied to the scores)
  std::vector<float> kt;   // [KVH, blocks, D, 32]: dim j of key t of a block, keys in lanes (two vectors)
  std::vector<float> vr;   // [KVH, blocks * 32, D]: each KV head's value rows, zeros past T
};

template <int D>
void pack_head_f32(PackedF32<D>& pk, int64_t kvh) {
  for (int64_t b = 0; b < pk.blocks; ++b) {
    float* kt = pk.kt.data() + (kvh * pk.blocks + b) * D * kKeys;
    float* vr = pk.vr.data() + (kvh * pk.blocks + b) * kKeys * D;
    for (int t = 0; t < kKeys; ++t) {
      const int64_t tok = b * kKeys + t;
      if (tok >= pk.T) break;  // the rest stay zero (the vectors were zero-filled)
      const float *ks = pk.in.k_at(tok, kvh, D), *vs = pk.in.v_at(tok, kvh, D);
      std::copy(vs, vs + D, vr + t * D);
      for (int d = 0; d < D; ++d) kt[d * kKeys + t] = ks[d];
    }
  }
}

// Rows [r0, r0 + n) of task (kvh, qb), as attend_tile, in fp32: scores by broadcast-FMAs over head_dim (keys in
// lanes), the block's weights times V rows in groups of RG rows whose C output vectors each stay in registers
template <int D>
void attend_tile_f32(const PackedF32<D>& pk, float* out, int64_t kvh, int64_t qb, int64_t r0, int n, float scale) {
  constexpr int C = D / 16, RG = C >= 16 ? 1 : 16 / C;
  static_assert(kRows % RG == 0, "a tile's rows split into whole PV groups");
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  int64_t query[kRows], head[kRows];
  for (int r = 0; r < kRows; ++r) {  // tile_rows in place: through it this kernel ran 1.4x slower (Ice Lake)
    const int64_t rr = r0 + std::min(r, n - 1);
    query[r] = qb * kQueries + rr / pk.G;
    head[r] = kvh * pk.G + rr % pk.G;
  }
  const float* qp[kRows];
  for (int r = 0; r < kRows; ++r) qp[r] = pk.in.q_at(query[r], head[r], D);
  alignas(64) float mx[16], m_new[16], alpha[16];  // the tile's rows in the first kRows lanes
  float sm[kRows];
  alignas(64) float acc[kRows][D];
  alignas(64) float pw[kRows][kKeys];  // each row's block weights
  for (int r = 0; r < 16; ++r) mx[r] = m_new[r] = kNegInf;
  for (int r = 0; r < kRows; ++r) {
    sm[r] = 0.f;
    for (int d = 0; d < D; ++d) acc[r][d] = 0.f;
  }
  const __m512 sc = _mm512_set1_ps(scale);
  const int64_t last = query[kRows - 1] / kKeys;
  for (int64_t b = 0; b <= last; ++b) {
    const float* kt = pk.kt.data() + (kvh * pk.blocks + b) * D * kKeys;
    __m512 s[kRows][2];
    for (int r = 0; r < kRows; ++r) s[r][0] = s[r][1] = _mm512_setzero_ps();
    for (int j = 0; j < D; ++j) {
      const __m512 k0 = _mm512_loadu_ps(kt + j * kKeys), k1 = _mm512_loadu_ps(kt + j * kKeys + 16);
      for (int r = 0; r < kRows; ++r) {
        const __m512 qj = _mm512_set1_ps(qp[r][j]);
        s[r][0] = _mm512_fmadd_ps(qj, k0, s[r][0]);
        s[r][1] = _mm512_fmadd_ps(qj, k1, s[r][1]);
      }
    }
    for (int r = 0; r < kRows; ++r) {
      const int64_t seen = query[r] - b * kKeys + 1;  // keys of this block row r attends: at least 1 (b <= its block)
      for (int h = 0; h < 2; ++h)
        s[r][h] = _mm512_mask_mul_ps(_mm512_set1_ps(kNegInf), half_mask(seen, h), s[r][h], sc);
      m_new[r] = std::max(mx[r], _mm512_reduce_max_ps(_mm512_max_ps(s[r][0], s[r][1])));
    }
    // every row's rescale at once (-inf - finite: e^-87 ~ 0 times a zero state)
    _mm512_store_ps(alpha, kvs::exp512_nonpositive(_mm512_sub_ps(_mm512_load_ps(mx), _mm512_load_ps(m_new))));
    for (int r = 0; r < kRows; ++r) {
      const __m512 mr = _mm512_set1_ps(m_new[r]);
      const int64_t seen = query[r] - b * kKeys + 1;
      const __m512 p0 = _mm512_maskz_mov_ps(half_mask(seen, 0), kvs::exp512_nonpositive(_mm512_sub_ps(s[r][0], mr)));
      const __m512 p1 = _mm512_maskz_mov_ps(half_mask(seen, 1), kvs::exp512_nonpositive(_mm512_sub_ps(s[r][1], mr)));
      sm[r] = sm[r] * alpha[r] + _mm512_reduce_add_ps(_mm512_add_ps(p0, p1));
      _mm512_store_ps(pw[r], p0);
      _mm512_store_ps(pw[r] + 16, p1);
      mx[r] = m_new[r];
    }
    // keys past the tile's last query weigh 0 for every row: not read
    const int keys = static_cast<int>(std::min<int64_t>(kKeys, query[kRows - 1] - b * kKeys + 1));
    const float* vr = pk.vr.data() + (kvh * pk.blocks + b) * kKeys * D;
    for (int g = 0; g < kRows; g += RG) {
      __m512 o[RG][C];
      for (int i = 0; i < RG; ++i) {
        const __m512 av = _mm512_set1_ps(alpha[g + i]);  // the running output rescaled to this block's max
        for (int c = 0; c < C; ++c) o[i][c] = _mm512_mul_ps(_mm512_load_ps(acc[g + i] + 16 * c), av);
      }
      for (int t = 0; t < keys; ++t) {
        __m512 vc[C];
        for (int c = 0; c < C; ++c) vc[c] = _mm512_loadu_ps(vr + t * D + 16 * c);
        for (int i = 0; i < RG; ++i) {
          const __m512 w = _mm512_set1_ps(pw[g + i][t]);
          for (int c = 0; c < C; ++c) o[i][c] = _mm512_fmadd_ps(w, vc[c], o[i][c]);
        }
      }
      for (int i = 0; i < RG; ++i)
        for (int c = 0; c < C; ++c) _mm512_store_ps(acc[g + i] + 16 * c, o[i][c]);
    }
  }
  for (int r = 0; r < n; ++r) {
    float* dst = out + (query[r] * pk.H + head[r]) * D;
    const float inv = 1.f / sm[r];
    for (int d = 0; d < D; ++d) dst[d] = acc[r][d] * inv;
  }
}

template <int D>
void prefill_f32(float* out, const Prompt& in, float scale) {
  const int64_t T = in.T, H = in.H, KVH = in.KVH;
  PackedF32<D> pk;
  pk.T = T, pk.H = H, pk.KVH = KVH, pk.G = H / KVH, pk.blocks = kvs::cdiv(T, kKeys), pk.in = in;
  pk.kt.assign(static_cast<size_t>(KVH * pk.blocks * D * kKeys), 0.f);
  pk.vr.assign(static_cast<size_t>(KVH * pk.blocks * kKeys * D), 0.f);
  kvs::parallel_chunks(KVH, [&](int64_t c) { pack_head_f32<D>(pk, c); });
  for_each_tile(T, pk.G, KVH, [&](int64_t kvh, int64_t qb, int64_t r0, int n) {
    attend_tile_f32<D>(pk, out, kvh, qb, r0, n, scale);
  });
}

#pragma GCC pop_options
#else
bool cpu_has_bf16_dot() { return false; }
bool cpu_has_avx512() { return false; }
#endif  // KVS_PX86

// out [T, H, D] contiguous; q [T, H, D], k, v [T, KVH, D], fp32, each row's heads contiguous, rows any stride apart
// (this chunk's own K/V, the whole prompt so far: causal, T == keys)
Prompt check_prefill_args(const char* op, const at::Tensor& out, const at::Tensor& q, const at::Tensor& k,
                          const at::Tensor& v) {
  for (const auto* t : {&out, &q, &k, &v})
    TORCH_CHECK(t->dim() == 3 && t->scalar_type() == at::kFloat && t->device().is_cpu() && t->stride(2) == 1 &&
                    t->stride(1) == t->size(2) && t->stride(0) >= t->size(1) * t->size(2), op,
                " takes fp32 CPU tensors [T, heads, head_dim], each row's heads contiguous");
  TORCH_CHECK(out.is_contiguous(), op, ": out must be contiguous");
  TORCH_CHECK(out.sizes() == q.sizes() && k.sizes() == v.sizes() && k.size(0) == q.size(0) &&
                  k.size(2) == q.size(2) && k.size(1) > 0 && q.size(1) % k.size(1) == 0,
              "q, out [T, H, D]; k, v [T, KVH, D] with H a multiple of KVH");
  return Prompt{q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), q.stride(0), k.stride(0),
                v.stride(0), q.size(0), q.size(1), k.size(1)};
}

// Kernel<D>::run(out, prompt, scale) for head_dim 32, 64 or 128
template <template <int> class Kernel>
void run_prefill(const char* op, const at::Tensor& out, const at::Tensor& q, const at::Tensor& k,
                 const at::Tensor& v, double scale) {
  const Prompt in = check_prefill_args(op, out, q, k, v);
  const float s = static_cast<float>(scale);
  float* o = out.data_ptr<float>();
  switch (q.size(2)) {
    case 32: return Kernel<32>::run(o, in, s);
    case 64: return Kernel<64>::run(o, in, s);
    case 128: return Kernel<128>::run(o, in, s);
    default: break;
  }
  TORCH_CHECK(false, op, " takes head_dim 32, 64 or 128, not ", q.size(2));
}

#ifdef KVS_PX86
template <int D>
struct Bf16Kernel {
  static void run(float* o, const Prompt& in, float s) { prefill_bf16<D>(o, in, s); }
};
template <int D>
struct F32Kernel {
  static void run(float* o, const Prompt& in, float s) { prefill_f32<D>(o, in, s); }
};
#else
template <int D>
struct Bf16Kernel {
  static void run(float*, const Prompt&, float) {}
};
template <int D>
using F32Kernel = Bf16Kernel<D>;
#endif

void prefill_attention_bf16(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            double scale) {
  TORCH_CHECK(cpu_has_bf16_dot(), "prefill_attention_bf16 needs AVX512-BF16 (and AVX-512 not capped away)");
  run_prefill<Bf16Kernel>("prefill_attention_bf16", out, q, k, v, scale);
}

void prefill_attention_fp32(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            double scale) {
  TORCH_CHECK(cpu_has_avx512(), "prefill_attention_fp32 needs AVX-512 (not capped away by ATEN_CPU_CAPABILITY)");
  run_prefill<F32Kernel>("prefill_attention_fp32", out, q, k, v, scale);
}

bool prefill_bf16_available() { return cpu_has_bf16_dot(); }
bool prefill_fp32_available() { return cpu_has_avx512(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvserve_paged, m) {
  m.def("prefill_attention_bf16(Tensor(a!) out, Tensor q, Tensor k, Tensor v, float scale) -> ()");
  m.def("prefill_bf16_available() -> bool", &prefill_bf16_available);
  m.def("prefill_attention_fp32(Tensor(a!) out, Tensor q, Tensor k, Tensor v, float scale) -> ()");
  m.def("prefill_fp32_available() -> bool", &prefill_fp32_available);
}

TORCH_LIBRARY_IMPL(kvserve_paged, CPU, m) {
  m.impl("prefill_attention_bf16", &prefill_attention_bf16);
  m.impl("prefill_attention_fp32", &prefill_attention_fp32);
}
