// Precision w4a8's small-batch matmul: the GGUF's own weight blocks (Q4_0/Q4_1 nibbles, Q8_0 bytes; a scale per
// 32 weights) times activations quantized per row per 32 to int8 with one fp32 scale (llama.cpp's Q8_1 rule),
// as integer dot products per block (AVX-512 VNNI: dpbusd, 64 products per instruction; AVX2: maddubs + madd, 32
// products in two instructions) summed in fp32.
// One stream reads 4.5-5 bits per weight instead of bf16's 16, and multiplies without widening to floats.
//
// Per block b of row r and output n:  sum_i w_i a_i = d_n,b * s_r,b * sum_i q_i qa_i  +  m_n,b * s_r,b * sum_i qa_i
// (Q4_1: w = d q + m, q in 0..15; Q4_0 is m = -8 d; Q8_0: w = d q, q in -127..127, no m term).
// Three builds of the loop, chosen at load from the CPU (`avx512`: AVX-512 F/BW/VL/DQ + VNNI; `avx2`: AVX2 + FMA;
// `generic`) for the file's layout, and two interleaved layouts that inference.precision packs at load where the
// CPU runs them (x16: AVX-512 VNNI; x8: AVX2), 16 or 8 outputs per load; kvserve_paged::quant_isa
// reports or forces one (tests run each against the same reference).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "arith.h"
#include "cap.h"
#include "pool.h"

#if defined(__x86_64__) && defined(__GNUC__)
#define KVS_QX86 1
#include <immintrin.h>
#endif

namespace {

constexpr int64_t QK = 32;  // weights (and activations) per scale
constexpr int64_t ROW_TILE = 4;  // activation rows sharing one read of a weight block

// Activations [R, K] as int8 codes per block of 32 (round to nearest even of x / s, s = max|x| / 127), with s and
// s * sum(codes) per block (the Q4 zero term's factor). One buffer per calling thread, reused from call to call.
struct QuantActs {
  std::vector<int8_t> q;
  std::vector<float> s, ssum;
};

inline void quantize_block(const float* xb, int8_t* q, float* s, float* ssum) {
  float amax = 0.f;
  for (int64_t i = 0; i < QK; ++i) amax = std::max(amax, std::fabs(xb[i]));
  const float sc = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
  int32_t sum = 0;
  for (int64_t i = 0; i < QK; ++i) {
    const int32_t v = static_cast<int32_t>(std::nearbyint(xb[i] * inv));
    q[i] = static_cast<int8_t>(v);
    sum += v;
  }
  *s = sc;
  *ssum = sc * static_cast<float>(sum);
}

#ifdef KVS_QX86
// The same block, 16 lanes at a time: the same products and the same rounding (to nearest even), so the same codes.
__attribute__((target("avx512f,avx512bw"))) void quantize_block_avx512(const float* xb, int8_t* q, float* s,
                                                                      float* ssum) {
  const __m512 a = _mm512_loadu_ps(xb), b = _mm512_loadu_ps(xb + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  const float sc = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
  const __m512 iv = _mm512_set1_ps(inv);
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const __m512i qa = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(a, iv), kRound));
  const __m512i qb = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(b, iv), kRound));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(qa));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtsepi32_epi8(qb));
  *s = sc;
  *ssum = sc * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb)));
}
#endif

const QuantActs& quantize_acts(const float* x, int64_t R, int64_t K) {
  const int64_t KB = K / QK;
  thread_local QuantActs mine;
  QuantActs& a = mine;  // the caller's buffer, by reference: in the chunks below a helper's own `mine` is another
  a.q.resize(R * K);
  a.s.resize(R * KB);
  a.ssum.resize(R * KB);
#ifdef KVS_QX86
  static const bool wide = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
#else
  constexpr bool wide = false;
#endif
  // a prefill chunk's rows are many (512 x 1536 values: ~1 ms on one thread): they go to the pool
  const int64_t chunks = R * K >= (1 << 15) ? std::min<int64_t>(R, 4 * kvs::threads()) : 1;
  kvs::parallel_chunks(chunks, [&](int64_t c) {
    int64_t r0, r1;
    kvs::chunk_range(R, chunks, c, &r0, &r1);
    for (int64_t rb = r0 * KB; rb < r1 * KB; ++rb) {
#ifdef KVS_QX86
      if (wide) {
        quantize_block_avx512(x + rb * QK, a.q.data() + rb * QK, &a.s[rb], &a.ssum[rb]);
        continue;
      }
#endif
      quantize_block(x + rb * QK, a.q.data() + rb * QK, &a.s[rb], &a.ssum[rb]);
    }
  });
  return a;
}

// ---- generic: the same sums in plain C++ (any CPU; the reference the AVX2 build is tested against) ----

template <bool Q4>
void rows_generic(const uint8_t* w, const float* d, const float* m, int64_t N, int64_t KB, const QuantActs& a,
                  int64_t R, float* out, int64_t n0, int64_t n1) {
  const int64_t wb = Q4 ? QK / 2 : QK;  // bytes per block of weights
  std::vector<float> acc(R);
  int8_t q[QK];
  for (int64_t n = n0; n < n1; ++n) {
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t b = 0; b < KB; ++b) {
      const uint8_t* blk = w + (n * KB + b) * wb;
      if (Q4) {
        for (int64_t i = 0; i < QK / 2; ++i) {
          q[i] = static_cast<int8_t>(blk[i] & 0x0F);
          q[i + QK / 2] = static_cast<int8_t>(blk[i] >> 4);
        }
      } else {
        std::memcpy(q, blk, QK);
      }
      for (int64_t r = 0; r < R; ++r) {
        const int8_t* qa = a.q.data() + (r * KB + b) * QK;
        int32_t dot = 0;
        for (int64_t i = 0; i < QK; ++i) dot += static_cast<int32_t>(q[i]) * qa[i];
        acc[r] += d[n * KB + b] * a.s[r * KB + b] * static_cast<float>(dot);
        if (Q4) acc[r] += m[n * KB + b] * a.ssum[r * KB + b];
      }
    }
    for (int64_t r = 0; r < R; ++r) out[r * N + n] = acc[r];
  }
}

#ifdef KVS_QX86

__attribute__((target("avx2,fma"))) inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Q8_0: RR activation rows (1..ROW_TILE) against outputs [n0, n1); each weight block is loaded once for all RR
// rows, |q| multiplies and q's sign moves onto the activations (maddubs takes unsigned x signed bytes). Even and
// odd blocks add into separate accumulators: one row's loop is otherwise bound by the FMA's latency.
template <int RR>
__attribute__((target("avx2,fma"))) inline void block_q8_avx2(const uint8_t* w, const float* d, int64_t KB,
                                                               const int8_t* qa, const float* sa, int64_t nb,
                                                               int64_t b, __m256* acc) {
  const __m256i wq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + nb * QK));
  const __m256i wabs = _mm256_sign_epi8(wq, wq);
  const float dn = d[nb];
  for (int r = 0; r < RR; ++r) {
    const __m256i x = _mm256_sign_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qa + (r * KB + b) * QK)), wq);
    const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(wabs, x), _mm256_set1_epi16(1));
    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(dn * sa[r * KB + b]), acc[r]);
  }
}

template <int RR>
__attribute__((target("avx2,fma"))) void tile_q8_avx2(const uint8_t* w, const float* d, int64_t N, int64_t KB,
                                                       const QuantActs& a, int64_t r0, float* out, int64_t n0,
                                                       int64_t n1) {
  const int8_t* qa = a.q.data() + r0 * KB * QK;
  const float* sa = a.s.data() + r0 * KB;
  for (int64_t n = n0; n < n1; ++n) {
    __m256 even[RR], odd[RR];
    for (int r = 0; r < RR; ++r) even[r] = odd[r] = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 1 < KB; b += 2) {
      block_q8_avx2<RR>(w, d, KB, qa, sa, n * KB + b, b, even);
      block_q8_avx2<RR>(w, d, KB, qa, sa, n * KB + b + 1, b + 1, odd);
    }
    if (b < KB) block_q8_avx2<RR>(w, d, KB, qa, sa, n * KB + b, b, even);
    for (int r = 0; r < RR; ++r) out[(r0 + r) * N + n] = hsum8(_mm256_add_ps(even[r], odd[r]));
  }
}

// Q4 two blocks at a time: one 32-byte load holds blocks b and b + 1's nibbles, so the low nibbles are [b's codes
// 0..15 | b+1's 0..15] and the high ones [b's 16..31 | b+1's 16..31]; the activations are laid out in that order
// (PairActs), the two maddubs results add in int16 (at most 2 x 2 x 15 x 127 < 2^15) and one madd leaves lanes 0-3
// for block b, 4-7 for b + 1, scaled by [d_b s_b x4 | d_b+1 s_b+1 x4]. About half the instructions per block of
// the one-block loop; the zero terms (m * s * sum(qa)) are one dot product per output after the loop.
struct PairActs {
  std::vector<int8_t> q;  // [R, KP, 64]
  std::vector<float> s8;  // [R, KP, 8]: s_b x4, s_b+1 x4 (0 past the last block)
};

PairActs pair_acts(const QuantActs& a, int64_t R, int64_t KB) {
  const int64_t KP = kvs::cdiv(KB, 2);
  PairActs p{std::vector<int8_t>(R * KP * 64, 0), std::vector<float>(R * KP * 8, 0.f)};
  for (int64_t r = 0; r < R; ++r)
    for (int64_t b = 0; b < KB; ++b) {
      const int8_t* src = a.q.data() + (r * KB + b) * QK;
      int8_t* dst = p.q.data() + (r * KP + b / 2) * 64 + (b % 2) * 16;
      std::memcpy(dst, src, 16);
      std::memcpy(dst + 32, src + 16, 16);
      std::fill_n(p.s8.data() + (r * KP + b / 2) * 8 + (b % 2) * 4, 4, a.s[r * KB + b]);
    }
  return p;
}

template <int RR>
__attribute__((target("avx2,fma"))) void tile_q4_pairs_avx2(const uint8_t* w, const float* d, const float* m,
                                                             int64_t N, int64_t KB, const QuantActs& a,
                                                             const PairActs& p, int64_t r0, float* out, int64_t n0,
                                                             int64_t n1) {
  const int64_t KP = kvs::cdiv(KB, 2);
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  const int8_t* qa = p.q.data() + r0 * KP * 64;
  const float* s8 = p.s8.data() + r0 * KP * 8;
  for (int64_t n = n0; n < n1; ++n) {
    __m256 acc[RR];
    for (int r = 0; r < RR; ++r) acc[r] = _mm256_setzero_ps();
    const uint8_t* nib = w + n * KB * (QK / 2);
    const float* dn = d + n * KB;
    for (int64_t pr = 0; pr < KP; ++pr) {
      const int64_t b = 2 * pr;
      const bool both = b + 1 < KB;
      const __m256i raw = both ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(nib + b * 16))
                               : _mm256_inserti128_si256(_mm256_setzero_si256(),
                                                         _mm_loadu_si128(reinterpret_cast<const __m128i*>(nib + b * 16)), 0);
      const __m256i lo = _mm256_and_si256(raw, low);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
      const __m256 dv = _mm256_set_m128(_mm_set1_ps(both ? dn[b + 1] : 0.f), _mm_set1_ps(dn[b]));
      for (int r = 0; r < RR; ++r) {
        const int8_t* x = qa + (r * KP + pr) * 64;
        const __m256i sum16 = _mm256_add_epi16(
            _mm256_maddubs_epi16(lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))),
            _mm256_maddubs_epi16(hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 32))));
        const __m256 scale = _mm256_mul_ps(dv, _mm256_loadu_ps(s8 + (r * KP + pr) * 8));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(sum16, ones)), scale, acc[r]);
      }
    }
    const float* mn = m + n * KB;
    for (int r = 0; r < RR; ++r) {
      const float* ss = a.ssum.data() + (r0 + r) * KB;
      __m256 z = _mm256_setzero_ps();
      int64_t b = 0;
      for (; b + 8 <= KB; b += 8) z = _mm256_fmadd_ps(_mm256_loadu_ps(mn + b), _mm256_loadu_ps(ss + b), z);
      float zs = 0.f;
      for (; b < KB; ++b) zs += mn[b] * ss[b];
      out[(r0 + r) * N + n] = hsum8(_mm256_add_ps(acc[r], z)) + zs;
    }
  }
}

template <bool Q4>
void rows_avx2(const uint8_t* w, const float* d, const float* m, int64_t N, int64_t KB, const QuantActs& a,
               const PairActs* p, int64_t R, float* out, int64_t n0, int64_t n1) {
  if (Q4) {
    for (int64_t r0 = 0; r0 < R; r0 += ROW_TILE) {
      switch (std::min(ROW_TILE, R - r0)) {
        case 1: tile_q4_pairs_avx2<1>(w, d, m, N, KB, a, *p, r0, out, n0, n1); break;
        case 2: tile_q4_pairs_avx2<2>(w, d, m, N, KB, a, *p, r0, out, n0, n1); break;
        case 3: tile_q4_pairs_avx2<3>(w, d, m, N, KB, a, *p, r0, out, n0, n1); break;
        default: tile_q4_pairs_avx2<4>(w, d, m, N, KB, a, *p, r0, out, n0, n1); break;
      }
    }
    return;
  }
  for (int64_t r0 = 0; r0 < R; r0 += ROW_TILE) {
    switch (std::min(ROW_TILE, R - r0)) {
      case 1: tile_q8_avx2<1>(w, d, N, KB, a, r0, out, n0, n1); break;
      case 2: tile_q8_avx2<2>(w, d, N, KB, a, r0, out, n0, n1); break;
      case 3: tile_q8_avx2<3>(w, d, N, KB, a, r0, out, n0, n1); break;
      default: tile_q8_avx2<4>(w, d, N, KB, a, r0, out, n0, n1); break;
    }
  }
}


// ---- avx512: the x16 layout, AVX-512 VNNI (vpdpbusd: 64 unsigned x signed byte products into 16 int32 lanes) ----
// The weights are repacked at load (inference.precision: exact, the codes only move) so that one 64-byte load holds
// 16 outputs x 4 (Q8) or 8 (Q4) consecutive k: for outputs 16g..16g+15, block b, chunk c, byte 4o + j holds
//   Q4: code(16g + o, 32b + 8c + j) in its low nibble and code(16g + o, 32b + 8c + 4 + j) in its high one (c < 4);
//   Q8: code(16g + o, 32b + 4c + j) + 128, unsigned (c < 8), its zero term m = -128 d (computed, not read).
// d and m are fp16 [N / 16, KB, 16] (the file's own fp16 values). A row's four activation bytes are broadcast and
// dpbusd sums them into lane o = output 16g + o: no horizontal sums, and a block's scales apply to 16 outputs at
// once (one cvt and two fmas per block and row). A group's weights stay in L1 while every row tile reads them.
inline int32_t load4(const int8_t* p) {  // four activation codes, to broadcast
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")

// NG groups of 16 outputs (1 or 2) x RR rows. With two, each broadcast activation feeds two dpbusd: 1.10-1.23x the
// one-group tile's multiply-adds per second at 16-64 rows on a Zen 5 EPYC (one thread), where the loop is bound by
// the instructions around dpbusd, not by it.
template <int BITS, int RR, int NG>
void tile_x16(const uint8_t* w, const uint16_t* d, const uint16_t* m, int64_t KB, const QuantActs& a, int64_t r0,
              float* out, int64_t N, int64_t g) {
  constexpr int64_t GB = BITS == 4 ? 256 : 512;  // bytes per block of 16 outputs
  const int64_t K = KB * QK;
  const __m512i low = _mm512_set1_epi8(0x0F);
  const int8_t* xq = a.q.data() + r0 * K;
  const float* xs = a.s.data() + r0 * KB;
  const float* xz = a.ssum.data() + r0 * KB;
  __m512 acc[NG][RR];
  for (int j = 0; j < NG; ++j)
    for (int r = 0; r < RR; ++r) acc[j][r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < KB; ++b) {
    __m512i dot[NG][RR];
    for (int j = 0; j < NG; ++j)
      for (int r = 0; r < RR; ++r) dot[j][r] = _mm512_setzero_si512();
    if (BITS == 4) {
      for (int c = 0; c < 4; ++c) {
        __m512i lo[NG], hi[NG];
        for (int j = 0; j < NG; ++j) {
          const __m512i raw = _mm512_loadu_si512(w + ((g + j) * KB + b) * GB + 64 * c);
          lo[j] = _mm512_and_si512(raw, low);
          hi[j] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
        }
        for (int r = 0; r < RR; ++r) {
          const int8_t* x = xq + r * K + b * QK + 8 * c;
          const __m512i x0 = _mm512_set1_epi32(load4(x)), x1 = _mm512_set1_epi32(load4(x + 4));
          for (int j = 0; j < NG; ++j) {
            dot[j][r] = _mm512_dpbusd_epi32(dot[j][r], lo[j], x0);
            dot[j][r] = _mm512_dpbusd_epi32(dot[j][r], hi[j], x1);
          }
        }
      }
    } else {
      for (int c = 0; c < 8; ++c) {
        __m512i u[NG];
        for (int j = 0; j < NG; ++j) u[j] = _mm512_loadu_si512(w + ((g + j) * KB + b) * GB + 64 * c);
        for (int r = 0; r < RR; ++r) {
          const __m512i x = _mm512_set1_epi32(load4(xq + r * K + b * QK + 4 * c));
          for (int j = 0; j < NG; ++j) dot[j][r] = _mm512_dpbusd_epi32(dot[j][r], u[j], x);
        }
      }
    }
    for (int j = 0; j < NG; ++j) {
      const int64_t at = ((g + j) * KB + b) * 16;
      const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d + at)));
      const __m512 mv = BITS == 4 ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(m + at)))
                                  : _mm512_mul_ps(dv, _mm512_set1_ps(-128.f));  // Q8's m is -128 d: not read
      for (int r = 0; r < RR; ++r) {
        acc[j][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[j][r]), _mm512_mul_ps(dv, _mm512_set1_ps(xs[r * KB + b])),
                                    acc[j][r]);
        acc[j][r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xz[r * KB + b]), acc[j][r]);
      }
    }
  }
  for (int j = 0; j < NG; ++j)
    for (int r = 0; r < RR; ++r) _mm512_storeu_ps(out + (r0 + r) * N + 16 * (g + j), acc[j][r]);
}

constexpr int64_t ROW_TILE_X16 = 8;       // rows per tile of one group
constexpr int64_t ROW_TILE_X16_PAIR = 6;  // rows per tile of two groups: 12 int and 12 fp32 accumulators in 32 zmm

template <int BITS, int NG, int RT>
void rows_x16(const uint8_t* w, const uint16_t* d, const uint16_t* m, int64_t KB, const QuantActs& a, int64_t R,
              float* out, int64_t N, int64_t g) {
  for (int64_t r0 = 0; r0 < R; r0 += RT) {
    switch (std::min<int64_t>(RT, R - r0)) {
      case 1: tile_x16<BITS, 1, NG>(w, d, m, KB, a, r0, out, N, g); break;
      case 2: tile_x16<BITS, 2, NG>(w, d, m, KB, a, r0, out, N, g); break;
      case 3: tile_x16<BITS, 3, NG>(w, d, m, KB, a, r0, out, N, g); break;
      case 4: tile_x16<BITS, std::min(4, RT), NG>(w, d, m, KB, a, r0, out, N, g); break;
      case 5: tile_x16<BITS, std::min(5, RT), NG>(w, d, m, KB, a, r0, out, N, g); break;
      case 6: tile_x16<BITS, std::min(6, RT), NG>(w, d, m, KB, a, r0, out, N, g); break;
      case 7: tile_x16<BITS, std::min(7, RT), NG>(w, d, m, KB, a, r0, out, N, g); break;
      default: tile_x16<BITS, RT, NG>(w, d, m, KB, a, r0, out, N, g); break;
    }
  }
}

template <int BITS>
void groups_x16(const uint8_t* w, const uint16_t* d, const uint16_t* m, int64_t KB, const QuantActs& a, int64_t R,
                float* out, int64_t N, int64_t g0, int64_t g1) {
  int64_t g = g0;
  if (R > 1)
    for (; g + 1 < g1; g += 2) rows_x16<BITS, 2, ROW_TILE_X16_PAIR>(w, d, m, KB, a, R, out, N, g);
  for (; g < g1; ++g) rows_x16<BITS, 1, ROW_TILE_X16>(w, d, m, KB, a, R, out, N, g);
}

#pragma GCC pop_options

// ---- avx2: the x8 layout, AVX2 without VNNI (maddubs + madd: unsigned x signed byte pairs into int16, into int32) ----
// 8 outputs per 32-byte load, their chunk bytes as in x16 (byte 4o + j), d and m fp16 [N / 8, KB, 8]:
//   Q4: low nibble code(8g + o, 32b + 8c + j), high nibble code(.., 32b + 8c + 4 + j) (c < 4): unsigned as they are;
//       two chunks' maddubs pairs add in int16 (16 products of at most 15 x 127) before one madd;
//   Q8: code(8g + o, 32b + 4c + j) as the file's int8 (c < 8), no zero term: |code| times the activations carrying
//       the code's sign (maddubs pairs of at most 2 x 127 x 127 stay in int16), one madd per chunk.
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

template <int BITS, int RR>
void tile_x8(const uint8_t* w, const uint16_t* d, const uint16_t* m, int64_t KB, const QuantActs& a, int64_t r0,
             float* out, int64_t N, int64_t g) {
  constexpr int64_t GB = BITS == 4 ? 128 : 256;  // bytes per block of 8 outputs
  const int64_t K = KB * QK;
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  const uint8_t* wg = w + g * KB * GB;
  const uint16_t* dg = d + g * KB * 8;
  const uint16_t* mg = m + g * KB * 8;
  const int8_t* xq = a.q.data() + r0 * K;
  const float* xs = a.s.data() + r0 * KB;
  const float* xz = a.ssum.data() + r0 * KB;
  __m256 acc[RR];
  for (int r = 0; r < RR; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < KB; ++b) {
    __m256i dot[RR];
    for (int r = 0; r < RR; ++r) dot[r] = _mm256_setzero_si256();
    const uint8_t* wb = wg + b * GB;
    if (BITS == 4) {
      for (int c = 0; c < 4; c += 2) {
        const __m256i raw0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 32 * c));
        const __m256i raw1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 32 * c + 32));
        const __m256i lo0 = _mm256_and_si256(raw0, low), hi0 = _mm256_and_si256(_mm256_srli_epi16(raw0, 4), low);
        const __m256i lo1 = _mm256_and_si256(raw1, low), hi1 = _mm256_and_si256(_mm256_srli_epi16(raw1, 4), low);
        for (int r = 0; r < RR; ++r) {
          const int8_t* x = xq + r * K + b * QK + 8 * c;
          __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo0, _mm256_set1_epi32(load4(x))),
                                       _mm256_maddubs_epi16(hi0, _mm256_set1_epi32(load4(x + 4))));
          p = _mm256_add_epi16(p, _mm256_maddubs_epi16(lo1, _mm256_set1_epi32(load4(x + 8))));
          p = _mm256_add_epi16(p, _mm256_maddubs_epi16(hi1, _mm256_set1_epi32(load4(x + 12))));
          dot[r] = _mm256_add_epi32(dot[r], _mm256_madd_epi16(p, ones));
        }
      }
    } else {
      for (int c = 0; c < 8; ++c) {
        const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 32 * c));
        const __m256i mag = _mm256_sign_epi8(q, q);
        for (int r = 0; r < RR; ++r) {
          const __m256i x = _mm256_sign_epi8(_mm256_set1_epi32(load4(xq + r * K + b * QK + 4 * c)), q);
          dot[r] = _mm256_add_epi32(dot[r], _mm256_madd_epi16(_mm256_maddubs_epi16(mag, x), ones));
        }
      }
    }
    const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dg + b * 8)));
    for (int r = 0; r < RR; ++r)
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r]), _mm256_mul_ps(dv, _mm256_set1_ps(xs[r * KB + b])), acc[r]);
    if (BITS == 4) {
      const __m256 mv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mg + b * 8)));
      for (int r = 0; r < RR; ++r) acc[r] = _mm256_fmadd_ps(mv, _mm256_set1_ps(xz[r * KB + b]), acc[r]);
    }
  }
  for (int r = 0; r < RR; ++r) _mm256_storeu_ps(out + (r0 + r) * N + 8 * g, acc[r]);
}

constexpr int64_t ROW_TILE_X8 = 4;

template <int BITS>
void groups_x8(const uint8_t* w, const uint16_t* d, const uint16_t* m, int64_t KB, const QuantActs& a, int64_t R,
               float* out, int64_t N, int64_t g0, int64_t g1) {
  for (int64_t g = g0; g < g1; ++g)
    for (int64_t r0 = 0; r0 < R; r0 += ROW_TILE_X8) {
      switch (std::min(ROW_TILE_X8, R - r0)) {
        case 1: tile_x8<BITS, 1>(w, d, m, KB, a, r0, out, N, g); break;
        case 2: tile_x8<BITS, 2>(w, d, m, KB, a, r0, out, N, g); break;
        case 3: tile_x8<BITS, 3>(w, d, m, KB, a, r0, out, N, g); break;
        default: tile_x8<BITS, 4>(w, d, m, KB, a, r0, out, N, g); break;
      }
    }
}

#pragma GCC pop_options

#endif  // KVS_QX86

enum class QIsa { generic, avx2, avx512 };

const char* qisa_name(QIsa isa) { return isa == QIsa::avx512 ? "avx512" : isa == QIsa::avx2 ? "avx2" : "generic"; }

QIsa cpu_isa() {
#ifdef KVS_QX86
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vnni"))
    return QIsa::avx512;
  if (avx2) return QIsa::avx2;
#endif
  return QIsa::generic;
}

// the CPU's best, no wider than ATEN_CPU_CAPABILITY (cap.h)
QIsa best_isa() { return static_cast<QIsa>(std::min(static_cast<int>(cpu_isa()), kvs::capability_cap())); }

QIsa g_isa = best_isa();

template <bool Q4>
at::Tensor coded_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& d, const at::Tensor* m) {
  const char* op = Q4 ? "w4a8_linear" : "w8a8_linear";
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(), op,
              ": x must be a contiguous fp32 CPU matrix [rows, K]");
  const int64_t R = x.size(0), K = x.size(1), N = w.size(0), KB = K / QK;
  TORCH_CHECK(K % QK == 0, op, ": K = ", K, " is not a multiple of ", QK);
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.size(1) == (Q4 ? KB * QK / 2 : K) &&
                  w.scalar_type() == (Q4 ? at::kByte : at::kChar),
              op, ": weight codes must be contiguous ", Q4 ? "uint8 [N, K / 2]" : "int8 [N, K]", " for K = ", K);
  TORCH_CHECK(d.scalar_type() == at::kFloat && d.is_contiguous() && d.dim() == 2 && d.size(0) == N && d.size(1) == KB,
              op, ": scales must be contiguous fp32 [", N, ", ", KB, "]");
  if (m)
    TORCH_CHECK(m->scalar_type() == at::kFloat && m->is_contiguous() && m->sizes() == d.sizes(), op,
                ": mins must be contiguous fp32 like the scales");
  at::Tensor out = at::empty({R, N}, x.options());
  if (R == 0 || N == 0) return out;
  const QuantActs& a = quantize_acts(x.data_ptr<float>(), R, K);
  const uint8_t* wp = static_cast<const uint8_t*>(w.data_ptr());
  const float* dp = d.data_ptr<float>();
  const float* mp = m ? m->data_ptr<float>() : nullptr;
  float* o = out.data_ptr<float>();
  const QIsa isa = g_isa;
  PairActs pairs;
  if (Q4 && isa != QIsa::generic) pairs = pair_acts(a, R, KB);
  const int64_t runs = kvs::cdiv(N, 16), chunks = std::min<int64_t>(runs, 32 * kvs::threads());
  kvs::parallel_chunks(chunks, [&](int64_t c) {
    int64_t lo, hi;
    kvs::chunk_range(runs, chunks, c, &lo, &hi);
    lo *= 16, hi = std::min(N, 16 * hi);
#ifdef KVS_QX86
    if (isa != QIsa::generic) return rows_avx2<Q4>(wp, dp, mp, N, KB, a, &pairs, R, o, lo, hi);
#endif
    rows_generic<Q4>(wp, dp, mp, N, KB, a, R, o, lo, hi);
  });
  return out;
}

// x fp32 [R, K]; nibbles uint8 [N, K / 2] (a GGUF Q4 block's 16 bytes per 32 weights: byte j holds code j in its
// low nibble and code j + 16 in its high one); d, m fp32 [N, K / 32]: w = d * code + m. Returns x @ w.T, fp32.
at::Tensor w4a8_linear(const at::Tensor& x, const at::Tensor& nibbles, const at::Tensor& d, const at::Tensor& m) {
  return coded_linear<true>(x, nibbles, d, &m);
}

// x fp32 [R, K]; q int8 [N, K] (a GGUF Q8_0 block's 32 codes); d fp32 [N, K / 32]: w = d * q. Returns x @ w.T.
at::Tensor w8a8_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& d) {
  return coded_linear<false>(x, q, d, nullptr);
}

// x fp32 [R, K] times weights in an interleaved layout of W = 16 (x16, AVX-512 VNNI) or 8 (x8, AVX2) outputs per
// group: codes [N / W, K / 32, 16 W] uint8 (Q4 nibbles) or [N / W, K / 32, 32 W] (Q8: uint8 code + 128 for x16, the
// file's int8 for x8); d, m fp16 [N / W, K / 32, W] (inference.precision packs them). Returns x @ w.T, fp32 [R, N].
at::Tensor interleaved_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d, const at::Tensor& m) {
  const char* op = "interleaved_linear";
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(), op,
              ": x must be a contiguous fp32 CPU matrix [rows, K]");
  const int64_t R = x.size(0), K = x.size(1), KB = K / QK;
  TORCH_CHECK(K % QK == 0, op, ": K = ", K, " is not a multiple of ", QK);
  TORCH_CHECK(d.dim() == 3 && (d.size(2) == 16 || d.size(2) == 8), op, ": scales must be fp16 [groups, K / 32, 16 or 8]");
  const int64_t W = d.size(2);
  TORCH_CHECK(codes.dim() == 3 && codes.is_contiguous() && codes.size(1) == KB &&
                  (codes.size(2) == 16 * W || codes.size(2) == 32 * W) &&
                  codes.scalar_type() == (codes.size(2) == 32 * W && W == 8 ? at::kChar : at::kByte),
              op, ": codes must be contiguous [N / ", W, ", ", KB, ", ", 16 * W, " (Q4, uint8) or ", 32 * W,
              " (Q8, ", W == 8 ? "int8" : "uint8", ")] for K = ", K);
  const int64_t G = codes.size(0), N = W * G;
  for (const auto* t : {&d, &m})
    TORCH_CHECK(t->scalar_type() == at::kHalf && t->is_contiguous() && t->dim() == 3 && t->size(0) == G &&
                    t->size(1) == KB && t->size(2) == W,
                op, ": scales and mins must be contiguous fp16 [", G, ", ", KB, ", ", W, "]");
  TORCH_CHECK(static_cast<int>(best_isa()) >= static_cast<int>(W == 16 ? QIsa::avx512 : QIsa::avx2), op,
              ": this CPU lacks ", W == 16 ? "AVX-512 VNNI" : "AVX2", " for the x", W, " layout (pack another)");
  at::Tensor out = at::empty({R, N}, x.options());
  if (R == 0 || N == 0) return out;
  const QuantActs& a = quantize_acts(x.data_ptr<float>(), R, K);
  const auto* wp = static_cast<const uint8_t*>(codes.data_ptr());
  const auto* dp = reinterpret_cast<const uint16_t*>(d.data_ptr<at::Half>());
  const auto* mp = reinterpret_cast<const uint16_t*>(m.data_ptr<at::Half>());
  float* o = out.data_ptr<float>();
  const bool q4 = codes.size(2) == 16 * W;
  const int64_t chunks = std::min<int64_t>(G, 8 * kvs::threads());
  kvs::parallel_chunks(chunks, [&](int64_t c) {
    int64_t lo, hi;
    kvs::chunk_range(G, chunks, c, &lo, &hi);
#ifdef KVS_QX86
    if (W == 16) {
      if (q4) groups_x16<4>(wp, dp, mp, KB, a, R, o, N, lo, hi);
      else groups_x16<8>(wp, dp, mp, KB, a, R, o, N, lo, hi);
    } else {
      if (q4) groups_x8<4>(wp, dp, mp, KB, a, R, o, N, lo, hi);
      else groups_x8<8>(wp, dp, mp, KB, a, R, o, N, lo, hi);
    }
#endif
  });
  return out;
}

// "" reports the build in use; "avx512", "avx2" or "generic" forces one (refusing an ISA this CPU lacks); "best"
// the CPU's best; returns the one in use.
std::string quant_isa(const std::string& name) {
  if (name == "generic") g_isa = QIsa::generic;
  else if (name == "avx2" || name == "avx512") {
    const QIsa want = name == "avx2" ? QIsa::avx2 : QIsa::avx512;
    TORCH_CHECK(static_cast<int>(best_isa()) >= static_cast<int>(want), "quant_isa: this CPU lacks ",
                want == QIsa::avx2 ? "AVX2 + FMA" : "AVX-512 (F, BW, VL, DQ) with VNNI");
    g_isa = want;
  } else if (name == "best") g_isa = best_isa();
  else TORCH_CHECK(name.empty(), "quant_isa: ", name, " is not avx512, avx2, generic, best or empty");
  return qisa_name(g_isa);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvserve_paged, m) {
  m.def("w4a8_linear(Tensor x, Tensor nibbles, Tensor d, Tensor m) -> Tensor", &w4a8_linear);
  m.def("w8a8_linear(Tensor x, Tensor q, Tensor d) -> Tensor", &w8a8_linear);
  m.def("interleaved_linear(Tensor x, Tensor codes, Tensor d, Tensor m) -> Tensor", &interleaved_linear);
  m.def("quant_isa(str name) -> str", &quant_isa);
}
