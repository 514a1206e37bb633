// Precision w4a8's small-batch matmul: the GGUF's own weight blocks (Q4_0/Q4_1 nibbles, Q8_0 bytes; a scale per
// 32 weights) times activations quantized per row per 32 to int8 with one fp32 scale (llama.cpp's Q8_1 rule),
// as integer dot products per block (AVX2: maddubs + madd, 32 products in two instructions) summed in fp32.
// One stream reads 4.5-5 bits per weight instead of bf16's 16, and multiplies without widening to floats.
//
// Per block b of row r and output n:  sum_i w_i a_i = d_n,b * s_r,b * sum_i q_i qa_i  +  m_n,b * s_r,b * sum_i qa_i
// (Q4_1: w = d q + m, q in 0..15; Q4_0 is m = -8 d; Q8_0: w = d q, q in -127..127, no m term).
// Two builds of the loop, chosen at load from the CPU (`avx2`: AVX2 + FMA; `generic`); kvserve_paged::quant_isa
// reports or forces one (tests run both against the same reference).
#include <ATen/Parallel.h>
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

#if defined(__x86_64__) && defined(__GNUC__)
#define KVS_QX86 1
#include <immintrin.h>
#endif

namespace {

constexpr int64_t QK = 32;  // weights (and activations) per scale
constexpr int64_t ROW_TILE = 4;  // activation rows sharing one read of a weight block

// Activations [R, K] as int8 codes per block of 32 (round to nearest of x / s, s = max|x| / 127), with s and
// s * sum(codes) per block (the Q4 zero term's factor).
struct QuantActs {
  std::vector<int8_t> q;
  std::vector<float> s, ssum;
};

QuantActs quantize_acts(const float* x, int64_t R, int64_t K) {
  const int64_t KB = K / QK;
  QuantActs a{std::vector<int8_t>(R * K), std::vector<float>(R * KB), std::vector<float>(R * KB)};
  for (int64_t rb = 0; rb < R * KB; ++rb) {
    const float* xb = x + rb * QK;
    float amax = 0.f;
    for (int64_t i = 0; i < QK; ++i) amax = std::max(amax, std::fabs(xb[i]));
    const float s = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
    int32_t sum = 0;
    for (int64_t i = 0; i < QK; ++i) {
      const int32_t v = static_cast<int32_t>(std::nearbyint(xb[i] * inv));
      a.q[rb * QK + i] = static_cast<int8_t>(v);
      sum += v;
    }
    a.s[rb] = s;
    a.ssum[rb] = s * static_cast<float>(sum);
  }
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
  const int64_t KP = (KB + 1) / 2;
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
  const int64_t KP = (KB + 1) / 2;
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

#endif  // KVS_QX86

enum class QIsa { generic, avx2 };

QIsa best_isa() {
#ifdef KVS_QX86
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return QIsa::avx2;
#endif
  return QIsa::generic;
}

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
  const QuantActs a = quantize_acts(x.data_ptr<float>(), R, K);
  const uint8_t* wp = static_cast<const uint8_t*>(w.data_ptr());
  const float* dp = d.data_ptr<float>();
  const float* mp = m ? m->data_ptr<float>() : nullptr;
  float* o = out.data_ptr<float>();
  const QIsa isa = g_isa;
  PairActs pairs;
  if (Q4 && isa == QIsa::avx2) pairs = pair_acts(a, R, KB);
  at::parallel_for(0, N, 16, [&](int64_t lo, int64_t hi) {
#ifdef KVS_QX86
    if (isa == QIsa::avx2) return rows_avx2<Q4>(wp, dp, mp, N, KB, a, &pairs, R, o, lo, hi);
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

// "" reports the build in use; "avx2" or "generic" forces one (refusing an ISA this CPU lacks); returns the one in use.
std::string quant_isa(const std::string& name) {
  if (name == "generic") g_isa = QIsa::generic;
  else if (name == "avx2") {
    TORCH_CHECK(best_isa() == QIsa::avx2, "quant_isa: this CPU lacks AVX2 + FMA");
    g_isa = QIsa::avx2;
  } else if (name == "best") g_isa = best_isa();
  else TORCH_CHECK(name.empty(), "quant_isa: ", name, " is not avx2, generic, best or empty");
  return g_isa == QIsa::avx2 ? "avx2" : "generic";
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvserve_paged, m) {
  m.def("w4a8_linear(Tensor x, Tensor nibbles, Tensor d, Tensor m) -> Tensor", &w4a8_linear);
  m.def("w8a8_linear(Tensor x, Tensor q, Tensor d) -> Tensor", &w8a8_linear);
  m.def("quant_isa(str name) -> str", &quant_isa);
}
