// Paged attention on the CPU that reads K/V straight from the pool's pages (no gather copy).
//
// Pool layout (inference/kv_cache.py): pool[page, layer, k_or_v, offset, kv_head, row], fp32 or bf16 rows of head_dim
// values (bf16 read as the top half of an fp32: exact), or int8 rows of head_dim codes and then their fp32 scale (4
// bytes: value = code x scale; the scale is applied to a K row's dot product and to a V row's softmax weight, never
// per value). The math is fp32, except an int8 pool's q . K in the AVX-512 loop: q rounded per head to int16 (1.5e-5
// of its largest value) times the codes, summed exactly in int32 (1.06-1.13x that loop on an AMX Xeon). A bf16 pool
// reads half an fp32 pool's bytes, an int8 pool ~0.27.
// Sequence i owns query rows [query_start[i], query_start[i] + query_len[i]) of q/out and its
// context_lens[i] tokens live in pages tables[i, 0..]. Query j of sequence i attends causally to
// keys 0 .. context_lens[i] - query_len[i] + j (bottom-right aligned; a decode row sees them all).
// Query head h reads KV head h / (H / KVH) (grouped-query attention; MHA when H == KVH).
// One work item is (sequence, query): all its heads, so each page is read as one contiguous stream. An item of more
// than kPartKeys keys runs as parts of at most that many, on whichever threads are free, merged after (plan_units,
// merge_parts): one client's decode step uses every core. The cut depends on the item's keys alone, never on the
// threads or the batch, so a sequence's numbers are the same alone, in any batch and at any thread count.
//
// Three builds of the loop live in one library, picked at run time (`__builtin_cpu_supports`, or
// KVSERVE_ATTN_ISA=avx512|avx2|generic read at load, or the set_isa op): `avx512` (blocks of 16 tokens, online
// softmax, the query heads that share a KV head together, see attend_item_avx512; over an int8 pool two passes,
// every score then one softmax per head then V, attend_item_avx512_2p), `avx2` (the same scheme in blocks
// of 8, attend_item_avx2; head dims it does not take run the two-pass loop compiled for x86-64-v3) and `generic` (the
// two-pass loop, baseline x86-64). No -march flag is used, so the .so runs on any x86-64 CPU.
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <string>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "arith.h"
#include "cap.h"
#include "expo.h"
#include "pool.h"

namespace {

#if defined(__x86_64__) && defined(__GNUC__)
#define KVS_X86 1
#include <immintrin.h>
#endif

#define KVS_INLINE inline __attribute__((always_inline))

// A line of a page the loop reads next, fetched into L2 (prefetcht1), not L1: a prefetch into L1 holds one of the
// core's few L1 miss buffers (about 20) until its line arrives, which capped a core at ~8 GB/s of scattered pages on
// a Zen 4 EPYC (a plain sum streams 23 GB/s there); into L2 many more are in flight, and the loads that follow hit L2.
KVS_INLINE void prefetch_l2(const void* p) { __builtin_prefetch(p, 0, 2); }

using bf16_t = uint16_t;  // a bf16 pool's element, raw: the top 16 bits of an fp32
using i8_t = int8_t;      // an int8 pool's element: a code, or one of the 4 bytes of its row's scale

// Whether a pool's rows carry a scale after their head_dim values, and how many elements that adds to a row
template <typename KV>
constexpr bool kScaled = std::is_same<KV, i8_t>::value;
template <typename KV>
constexpr int64_t kRowExtra = kScaled<KV> ? static_cast<int64_t>(sizeof(float)) : 0;

// A row's scale (1 for an unscaled pool): the fp32 after its D codes
template <typename KV>
KVS_INLINE float row_scale(const KV* row, int64_t D) {
  if constexpr (kScaled<KV>) {
    float s;
    std::memcpy(&s, row + D, sizeof s);
    return s;
  } else {
    return 1.f;
  }
}

KVS_INLINE float kv_load(const float* p, int64_t i) { return p[i]; }
KVS_INLINE float kv_load(const i8_t* p, int64_t i) { return static_cast<float>(p[i]); }
KVS_INLINE float kv_load(const bf16_t* p, int64_t i) {
  const uint32_t bits = static_cast<uint32_t>(p[i]) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

using kvs::exp512_nonpositive;
using kvs::kExpTaylor;

// e^x for x <= 0 (scores minus their max), vectorizable: x = n ln2 + r, |r| <= ln2 / 2, e^r by its
// Taylor series to degree 7 (relative error < 1e-7 before float rounding), 2^n by building the float.
KVS_INLINE float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float t = x * 1.4426950408889634f;
  const float n = std::floor(t + 0.5f);
  const float r = (t - n) * 0.6931471805599453f;
  float p = kExpTaylor[0];
  for (int i = 1; i < 8; ++i) p = p * r + kExpTaylor[i];
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

template <int D>
struct Dim {
  static constexpr int value = D;
};

// For every query head h (kv head h / G): out[h] = softmax_t(scale * q[h] . K[t, h / G]) @ V[t, h / G]
// over the item's keys [tb, te). A token's K (and V) rows for all kv heads are contiguous in a page, so
// the page is read as one stream; the next page is prefetched while this one is used. With `state` the
// result stays unnormalized there ([H, D] sums, then H maxima and H sums: one part of a split context,
// merge_parts), else it is normalized into out.
template <typename DimT, typename KV>
KVS_INLINE void attend_item(const float* q, float* out, const KV* pool, const int32_t* table, int64_t tb, int64_t te,
                            int64_t H, int64_t KVH, int64_t d_runtime, int64_t page_stride, int64_t v_offset,
                            int64_t ps, float scale, std::vector<float>& scores, float* state) {
  const int64_t D = DimT::value > 0 ? DimT::value : d_runtime;
  const int64_t Dr = D + kRowExtra<KV>;
  const int64_t G = H / KVH, row_len = KVH * Dr, n = te - tb, first_page = tb / ps, end_page = kvs::cdiv(te, ps);
  scores.resize(static_cast<size_t>(H) * n);
  float* s = scores.data();
  float* acc = state ? state : out;
  for (int pass = 0; pass < 2; ++pass) {  // 0: scores from K; 1: weighted sum of V
    if (pass == 1) {
      for (int64_t h = 0; h < H; ++h) {
        float* sh = s + h * n;
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < n; ++t) mx = std::max(mx, sh[t]);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < n; ++t) {
          sh[t] = exp_nonpositive(sh[t] - mx);
          sum += sh[t];
        }
        if (state) {
          state[H * D + h] = mx;
          state[H * D + H + h] = sum;
        } else {
          const float inv = 1.f / sum;
#pragma omp simd
          for (int64_t t = 0; t < n; ++t) sh[t] *= inv;
        }
        float* oh = acc + h * D;
        for (int64_t d = 0; d < D; ++d) oh[d] = 0.f;
      }
    }
    const int64_t base = pass == 0 ? 0 : v_offset;
    for (int64_t pi = first_page; pi < end_page; ++pi) {
      const KV* page = pool + static_cast<int64_t>(table[pi]) * page_stride + base;
      // the next page's rows, one row ahead of their use: pages are scattered, so the hardware
      // prefetcher cannot see the jump from one to the next
      const char* next = pi + 1 < end_page
          ? reinterpret_cast<const char*>(pool + static_cast<int64_t>(table[pi + 1]) * page_stride + base) : nullptr;
      const int64_t row_bytes = row_len * static_cast<int64_t>(sizeof(KV));
      const int64_t t0 = pi * ps - tb, o0 = std::max<int64_t>(0, -t0), m = std::min(ps, n - t0);
      for (int64_t o = o0; o < m; ++o) {
        if (next) {
          for (int64_t b = 0; b < row_bytes; b += 64) prefetch_l2(next + o * row_bytes + b);
        }
        const KV* rowp = page + o * row_len;
        for (int64_t kvh = 0; kvh < KVH; ++kvh) {
          const KV* x = rowp + kvh * Dr;
          const float xs = row_scale(x, D);
          for (int64_t g = 0; g < G; ++g) {
            const int64_t h = kvh * G + g;
            if (pass == 0) {
              const float* qh = q + h * D;
              float dot = 0.f;
#pragma omp simd reduction(+ : dot)
              for (int64_t d = 0; d < D; ++d) dot += qh[d] * kv_load(x, d);
              s[h * n + t0 + o] = dot * xs * scale;
            } else {
              const float p = s[h * n + t0 + o] * xs;
              float* oh = acc + h * D;
#pragma omp simd
              for (int64_t d = 0; d < D; ++d) oh[d] += p * kv_load(x, d);
            }
          }
        }
      }
    }
  }
}

// An item whose keys were cut into parts (each attend_item'd with a state): out[h] = the parts' sums, each
// weighed by e^(its max - the overall max), over their sums weighed alike (the online softmax's merge).
inline void merge_parts(float* out, const float* states, int64_t parts, int64_t H, int64_t D) {
  const int64_t stride = H * (D + 2);
  for (int64_t h = 0; h < H; ++h) {
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t k = 0; k < parts; ++k) mx = std::max(mx, states[k * stride + H * D + h]);
    float total = 0.f;
    float* oh = out + h * D;
    for (int64_t d = 0; d < D; ++d) oh[d] = 0.f;
    for (int64_t k = 0; k < parts; ++k) {
      const float w = std::exp(states[k * stride + H * D + h] - mx);
      total += w * states[k * stride + H * D + H + h];
      const float* acc = states + k * stride + h * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) oh[d] += w * acc[d];
    }
    const float inv = 1.f / total;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) oh[d] *= inv;
  }
}

// One unit of work: keys [tb, te) of one (sequence, query) item; `part` >= 0 writes that part's state (a split item)
struct Unit {
  int64_t item, tb, te, part;
};

template <typename KV>
struct Problem {
  const float* q;
  float* out;
  const KV* pool;  // already offset to (page 0, layer, K)
  const int32_t* tables;
  const int32_t* context_lens;
  const int32_t* query_start;
  const int32_t* query_len;
  const int64_t* item_seq;  // work item -> sequence
  const int64_t* item_first;  // work item -> first query index inside its sequence
  int64_t table_width, H, KVH, D, ps, page_stride, v_offset, q_row_stride, out_row_stride;
  float scale;
  float* states;  // [parts, H * (D + 2)]: the split items' partial results (Unit::part)
};

template <typename KV>
KVS_INLINE float* unit_state(const Problem<KV>& p, const Unit& u) {
  return u.part < 0 ? nullptr : p.states + u.part * p.H * (p.D + 2);
}

template <typename DimT, typename KV>
KVS_INLINE void run_unit_body(const Problem<KV>& p, const Unit& u) {
  thread_local std::vector<float> scores;
  const int64_t i = p.item_seq[u.item], row = p.query_start[i] + p.item_first[u.item];
  attend_item<DimT, KV>(p.q + row * p.q_row_stride, p.out + row * p.out_row_stride, p.pool, p.tables + i * p.table_width,
                        u.tb, u.te, p.H, p.KVH, p.D, p.page_stride, p.v_offset, p.ps, p.scale, scores,
                        unit_state(p, u));
}

template <typename DimT, typename KV>
void run_unit_generic(const Problem<KV>& p, const Unit& u) {
  run_unit_body<DimT, KV>(p, u);
}

// Where value d of a row sits when each 16 values are read as their 8 even then their 8 odd ones (the AVX2 loop's
// bf16 rows: a dword's low half is the even value, its high half the odd one)
KVS_INLINE int64_t pair_order(int64_t d) { return (d & ~int64_t{15}) + (d & 1) * 8 + (d & 15) / 2; }

// The blocked loops' running state for one item's H heads, in L1: acc [H, W] the unnormalized output (W: head_dim
// rounded up to the loop's vector width), mx [H] the running maxima, sm [H] the running sums.
struct HeadStates {
  float *acc, *mx, *sm;
  int64_t H, W;
  HeadStates(std::vector<float>& buf, int64_t heads, int64_t width) : H(heads), W(width) {
    buf.assign(static_cast<size_t>(H * (W + 2)), 0.f);
    acc = buf.data();
    mx = acc + H * W;
    sm = mx + H;
    std::fill(mx, mx + H, -std::numeric_limits<float>::infinity());
  }
  // into out [H, D] normalized; or into a part's state unnormalized, with its maxima and sums (merge_parts).
  // `pairs`: acc holds each 16 values as their 8 even then their 8 odd ones (pair_order), put back in order here.
  void finish(float* out, float* part, int64_t D, bool pairs = false) const {
    float* dst = part ? part : out;
    for (int64_t h = 0; h < H; ++h) {
      const float inv = part ? 1.f : 1.f / sm[h];
      for (int64_t d = 0; d < D; ++d) dst[h * D + d] = acc[h * W + (pairs ? pair_order(d) : d)] * inv;
      if (part) {
        part[H * D + h] = mx[h];
        part[H * D + H + h] = sm[h];
      }
    }
  }
};

// Keys [tb, te) of one item as blocks of B token rows, page by page (no division per row). While a block is worked
// on, the lines (K and V rows) of the block A ahead are prefetched a share at a time (prefetch_upto): pages are
// scattered, so the hardware prefetcher cannot see the jump from one to the next, and a burst of all the lines at
// once filled the miss buffers and stalled the loads. In memory order (each token's K row, then its V row), not the
// order the loops read them (KV head by KV head): that order, tried, was 1.1-1.5x slower out of cache. A = 1 where
// the loop is bound by the lines a core keeps in flight (fp32 and bf16 rows: two ahead measured no faster); the
// int8 loop, bound by its own work, reads a block's ~100 lines in ~600 ns, and one block ahead left the share
// prefetched last arriving late: two ahead, 1.13x out of cache (Zen 4). With A > 1 the first A blocks' lines are
// prefetched at once as the item starts.
// The int8 pool's AVX-512 loop: 2 (attend_item_avx512_2p, the default) or 1 (the online loop, as fp32 and bf16 rows
// run it), the set_int8_passes op: python -m bench.attention times both
std::atomic<int> g_int8_passes{2};

enum class Lines { kv, k, v };  // which rows of a block RowBlocks prefetches: K and V, K only, V only

template <typename KV, int B, int A = 1, Lines L = Lines::kv>
class RowBlocks {
 public:
  const KV* rows[B];  // this block's rows; past its end rows[0] again (a valid row, its lanes masked out)
  int m = 0;          // rows in this block

  // `steps`: how many prefetch_upto calls a block's work makes (done = 1 .. steps)
  RowBlocks(const KV* pool, const int32_t* table, int64_t tb, int64_t te, int64_t page_stride, int64_t row_len,
            int64_t ps, int64_t v_offset, int64_t steps)
      : pool_(pool), table_(table), page_stride_(page_stride), row_len_(row_len), ps_(ps), v_offset_(v_offset),
        left_(te - tb), page_(tb / ps), off_(tb % ps), row_bytes_(row_len * static_cast<int64_t>(sizeof(KV))),
        steps_(steps) {
    for (int a = 0; a < A; ++a) {
      fill(a);
      if constexpr (A > 1) {
        aim(a);
        prefetch_upto(steps_);
      }
    }
  }

  // moves to the next block; false past the last
  KVS_INLINE bool next() {
    const int slot = head_;
    if (mn_[slot] == 0) return false;
    m = mn_[slot];
    for (int t = 0; t < m; ++t) rows[t] = ring_[slot][t];
    for (int t = m; t < B; ++t) rows[t] = rows[0];
    fill(slot);  // the slot now holds the block A ahead, whose lines this block's work prefetches
    aim(slot);
    head_ = slot + 1 == A ? 0 : slot + 1;
    return true;
  }

  // prefetches the aimed block's lines up to the fraction done / steps of them: a fixed-point share, no division
  // per call (a 64-bit division each, 8 to 24 per block)
  KVS_INLINE void prefetch_upto(int64_t done) {
    for (const int64_t stop = std::min(lines_, (share_ * done) >> 20); line_ < stop; ++line_) {
      prefetch_l2(pf_row_ + pf_b_);
      if ((pf_b_ += 64) >= row_bytes_) {  // next line: K row, then V row, then the next token's
        pf_b_ = 0;
        pf_row_ = (pf_r_ += kStride) >= 2 * pf_m_ ? pf_row_
            : reinterpret_cast<const char*>(pf_rows_[pf_r_ >> 1] + ((pf_r_ & 1) ? v_offset_ : 0));
      }
    }
  }

 private:
  // the item's next B rows (fewer at its end, none past it) into a slot of the ring
  KVS_INLINE void fill(int slot) {
    const int n = static_cast<int>(std::min<int64_t>(B, left_));
    left_ -= n;
    mn_[slot] = n;
    for (int t = 0; t < n; ++t) {
      ring_[slot][t] = pool_ + static_cast<int64_t>(table_[page_]) * page_stride_ + off_ * row_len_;
      if (++off_ == ps_) off_ = 0, ++page_;
    }
  }
  // the block in `slot` is the one prefetch_upto fetches
  KVS_INLINE void aim(int slot) {
    pf_rows_ = ring_[slot];
    pf_m_ = mn_[slot];
    lines_ = 2 / kStride * pf_m_ * kvs::cdiv(row_bytes_, 64);
    share_ = kvs::cdiv(lines_ << 20, steps_);
    line_ = pf_b_ = 0;
    pf_r_ = L == Lines::v ? 1 : 0;
    pf_row_ = pf_m_ ? reinterpret_cast<const char*>(pf_rows_[0] + (L == Lines::v ? v_offset_ : 0)) : nullptr;
  }

  const KV* pool_;
  const int32_t* table_;
  int64_t page_stride_, row_len_, ps_, v_offset_, left_, page_, off_, row_bytes_, steps_, share_ = 0;
  const KV* ring_[A][B];  // the next A blocks' rows
  int mn_[A] = {};
  const KV* const* pf_rows_ = nullptr;
  static constexpr int kStride = L == Lines::kv ? 1 : 2;  // K row then V row (pf_r_ even, odd), or one of them
  int head_ = 0, pf_m_ = 0, pf_r_ = 0;
  int64_t lines_ = 0, line_ = 0, pf_b_ = 0;
  const char* pf_row_ = nullptr;
};

#ifdef KVS_X86
// head dims the blocked AVX2 loop does not take (not a multiple of 8, or over 128): the two-pass loop for AVX2
template <typename DimT, typename KV>
__attribute__((target("arch=x86-64-v3"))) void run_unit_avx2_two_pass(const Problem<KV>& p, const Unit& u) {
  run_unit_body<DimT, KV>(p, u);
}

#pragma GCC push_options
#pragma GCC target("avx2,fma,bmi2")

// e^x for x <= 0 on 8 lanes: the scalar exp_nonpositive's reduction and polynomial, 2^n built as a float.
KVS_INLINE __m256 exp256_nonpositive(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.4426950408889634f));
  const __m256 n = _mm256_floor_ps(_mm256_add_ps(t, _mm256_set1_ps(0.5f)));
  const __m256 r = _mm256_mul_ps(_mm256_sub_ps(t, n), _mm256_set1_ps(0.6931471805599453f));
  __m256 q = _mm256_set1_ps(kExpTaylor[0]);
  for (int i = 1; i < 8; ++i) q = _mm256_fmadd_ps(q, r, _mm256_set1_ps(kExpTaylor[i]));
  const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(q, _mm256_castsi256_ps(two_n));
}

// 8 K or V values of one row as fp32 lanes
KVS_INLINE __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
KVS_INLINE __m256 load8(const bf16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
KVS_INLINE __m256 load8(const i8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// Two tokens' 8-lane partial sums -> per 128-bit half [a0+a2, b0+b2, a1+a3, b1+b3] (reduce8's first level)
KVS_INLINE __m256 sum_pairs(__m256 a, __m256 b) {
  return _mm256_add_ps(_mm256_unpacklo_ps(a, b), _mm256_unpackhi_ps(a, b));
}

// Two sum_pairs -> per 128-bit half the four tokens' sums of that half's lanes, in token order
KVS_INLINE __m256 sum_quads(__m256 x, __m256 y) {
  return _mm256_add_ps(_mm256_shuffle_ps(x, y, _MM_SHUFFLE(1, 0, 1, 0)), _mm256_shuffle_ps(x, y, _MM_SHUFFLE(3, 2, 3, 2)));
}

KVS_INLINE float hmax8(__m256 v) {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
}

KVS_INLINE float hsum8(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}

// The AVX-512 loop's scheme on 8 lanes: keys in blocks of 8 tokens; for each query head the 8 scores as one vector
// (FMAs over head_dim per token, two chains, then a transpose-and-add tree: 7 adds and 14 shuffles per 8 dot
// products, no reduction per product), an online-softmax update of the head's running max / sum / output, then the
// block's V rows weighted in. NC = head_dim / 8 (head_dim a multiple of 8, at most 128). A bf16 row with head_dim a
// multiple of 16 is read 16 values per load as two fp32 vectors, the even values (each dword shifted up) and the odd
// ones (masked): no widening shuffle. The dot product does not care about the order if q is read alike, so q (scaled,
// once per item) and the running output are kept in that order and put back in order at the end.
template <int NC, typename KV>
KVS_INLINE void attend_item_avx2(const float* q, float* out, const KV* pool, const int32_t* table, int64_t tb,
                                 int64_t te, int64_t H, int64_t KVH, int64_t page_stride, int64_t v_offset, int64_t ps,
                                 float scale, std::vector<float>& state, std::vector<float>& qbuf, float* part) {
  constexpr int64_t D = 8 * NC, Dr = D + kRowExtra<KV>;
  constexpr bool kPairs = std::is_same<KV, bf16_t>::value && NC % 2 == 0;
  const int64_t G = H / KVH, row_len = KVH * Dr;
  HeadStates st(state, H, D);
  float *acc = st.acc, *mx = st.mx, *sm = st.sm;
  qbuf.resize(static_cast<size_t>(H * D));
  for (int64_t h = 0; h < H; ++h) {
    for (int64_t d = 0; d < D; ++d) qbuf[h * D + (kPairs ? pair_order(d) : d)] = q[h * D + d] * scale;
  }
  // chunks c and c + 1 of a row: 16 values (kPairs: evens, odds), else 8 and 8
  auto load_two = [](const KV* x, int c, __m256& lo, __m256& hi) {
    if constexpr (kPairs) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 8 * c));
      lo = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
      hi = _mm256_castsi256_ps(_mm256_and_si256(raw, _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u))));
    } else {
      lo = load8(x + 8 * c);
      hi = load8(x + 8 * c + 8);
    }
  };
  RowBlocks<KV, 8> blk(pool, table, tb, te, page_stride, row_len, ps, v_offset, H);
  const KV* const* rows = blk.rows;
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  while (blk.next()) {
    const int m = blk.m;
    const __m256 valid = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(m), lane));
    for (int64_t kvh = 0; kvh < KVH; ++kvh) {
      alignas(32) float ks[8], vs[8];  // the block's K and V row scales (an int8 pool)
      if constexpr (kScaled<KV>) {
        for (int t = 0; t < 8; ++t) {
          ks[t] = row_scale(rows[t] + kvh * Dr, D);
          vs[t] = row_scale(rows[t] + v_offset + kvh * Dr, D);
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        const int64_t h = kvh * G + g;
        blk.prefetch_upto(h + 1);
        __m256 qv[NC];
        for (int c = 0; c < NC; ++c) qv[c] = _mm256_loadu_ps(qbuf.data() + h * D + 8 * c);
        auto dot = [&](int t) {  // token t's 8 partial sums, in two chains of FMAs
          const KV* k = rows[t] + kvh * Dr;
          if constexpr (NC == 1) return _mm256_mul_ps(qv[0], load8(k));
          __m256 a = _mm256_setzero_ps(), b = _mm256_setzero_ps(), lo, hi;
          for (int c = 0; c + 1 < NC; c += 2) {
            load_two(k, c, lo, hi);
            a = _mm256_fmadd_ps(qv[c], lo, a);
            b = _mm256_fmadd_ps(qv[c + 1], hi, b);
          }
          if constexpr (NC % 2 == 1) a = _mm256_fmadd_ps(qv[NC - 1], load8(k + 8 * (NC - 1)), a);
          return _mm256_add_ps(a, b);
        };
        // reduced as they come, so few partial sums are live at once
        const __m256 w0 = sum_quads(sum_pairs(dot(0), dot(1)), sum_pairs(dot(2), dot(3)));
        const __m256 w1 = sum_quads(sum_pairs(dot(4), dot(5)), sum_pairs(dot(6), dot(7)));
        __m256 sums = _mm256_add_ps(_mm256_permute2f128_ps(w0, w1, 0x20), _mm256_permute2f128_ps(w0, w1, 0x31));
        if constexpr (kScaled<KV>) sums = _mm256_mul_ps(sums, _mm256_load_ps(ks));
        // lanes past the block's end hold token 0's score again: no new max, and their weights are zeroed
        const float m_old = mx[h];
        const float m_new = std::max(m_old, hmax8(sums));
        const __m256 pv = _mm256_and_ps(valid, exp256_nonpositive(_mm256_sub_ps(sums, _mm256_set1_ps(m_new))));
        const float alpha = m_old == -std::numeric_limits<float>::infinity()
            ? 0.f : _mm256_cvtss_f32(exp256_nonpositive(_mm256_set1_ps(m_old - m_new)));
        mx[h] = m_new;
        sm[h] = sm[h] * alpha + hsum8(pv);
        alignas(32) float pw[8];  // the weights V rows are taken with (times their scales)
        _mm256_store_ps(pw, kScaled<KV> ? _mm256_mul_ps(pv, _mm256_load_ps(vs)) : pv);
        float* oh = acc + h * D;
        __m256 o[NC];
        const __m256 av = _mm256_set1_ps(alpha);
        for (int c = 0; c < NC; ++c) o[c] = _mm256_mul_ps(_mm256_loadu_ps(oh + 8 * c), av);
        for (int t = 0; t < m; ++t) {
          const __m256 w = _mm256_set1_ps(pw[t]);
          const KV* v = rows[t] + v_offset + kvh * Dr;
          __m256 lo, hi;
          for (int c = 0; c + 1 < NC; c += 2) {
            load_two(v, c, lo, hi);
            o[c] = _mm256_fmadd_ps(w, lo, o[c]);
            o[c + 1] = _mm256_fmadd_ps(w, hi, o[c + 1]);
          }
          if constexpr (NC % 2 == 1) o[NC - 1] = _mm256_fmadd_ps(w, load8(v + 8 * (NC - 1)), o[NC - 1]);
        }
        for (int c = 0; c < NC; ++c) _mm256_storeu_ps(oh + 8 * c, o[c]);
      }
    }
  }
  st.finish(out, part, D, kPairs);
}

template <int NC, typename KV>
void run_unit_avx2(const Problem<KV>& p, const Unit& u) {
  thread_local std::vector<float> state, qbuf;
  const int64_t i = p.item_seq[u.item], row = p.query_start[i] + p.item_first[u.item];
  attend_item_avx2<NC, KV>(p.q + row * p.q_row_stride, p.out + row * p.out_row_stride, p.pool,
                           p.tables + i * p.table_width, u.tb, u.te, p.H, p.KVH, p.page_stride, p.v_offset, p.ps,
                           p.scale, state, qbuf, unit_state(p, u));
}

#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512dq,avx512vl,avx512bw,avx2,fma,bmi2")

// 16 (or fewer, masked) K or V values of one row as fp32 lanes; kFull: all 16, unmasked loads
template <bool kFull>
KVS_INLINE __m512 load16(const float* p, __mmask16 m) {
  return kFull ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(m, p);
}
template <bool kFull>
KVS_INLINE __m512 load16(const bf16_t* p, __mmask16 m) {
  const __m256i raw = kFull ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)) : _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
template <bool kFull>
KVS_INLINE __m512 load16(const i8_t* p, __mmask16 m) {
  const __m128i raw = kFull ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)) : _mm_maskz_loadu_epi8(m, p);
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(raw));
}

// The transpose-and-add tree that turns 16 vectors of partial sums (a[t]: token t's products, 16 lanes) into one
// vector of their 16 sums, lane t token t's (15 adds, 30 shuffles per 16 dot products, no per-product reduction),
// in three steps so that it can run as the tokens come: pair16 (tokens 2i, 2i + 1), quad16 (two pairs: tokens
// 4j .. 4j + 3, each 128-bit lane's sum) and tree16 (four quads). In-lane shuffles first (24), crossing 128-bit
// lanes only in the last two levels (6).
KVS_INLINE __m512 pair16(__m512 a, __m512 b) {  // per 128-bit lane: [t0 s02, t1 s02, t0 s13, t1 s13]
  return _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
}
KVS_INLINE __m512 quad16(__m512 x, __m512 y) {
  return _mm512_add_ps(_mm512_shuffle_ps(x, y, _MM_SHUFFLE(1, 0, 1, 0)), _mm512_shuffle_ps(x, y, _MM_SHUFFLE(3, 2, 3, 2)));
}
KVS_INLINE __m512 tree16(const __m512* r2) {
  const __m512 r3a = _mm512_add_ps(_mm512_shuffle_f32x4(r2[0], r2[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm512_shuffle_f32x4(r2[0], r2[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 r3b = _mm512_add_ps(_mm512_shuffle_f32x4(r2[2], r2[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm512_shuffle_f32x4(r2[2], r2[3], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(r3a, r3b, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(r3a, r3b, _MM_SHUFFLE(3, 1, 3, 1)));
}

// The same tree over int32 partial sums (the int8 pool's q . K, exact until the one conversion to fp32)
KVS_INLINE __m512i pair16(__m512i a, __m512i b) {
  return _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
}
KVS_INLINE __m512i quad16(__m512i x, __m512i y) {
  const __m512 fx = _mm512_castsi512_ps(x), fy = _mm512_castsi512_ps(y);
  return _mm512_add_epi32(_mm512_castps_si512(_mm512_shuffle_ps(fx, fy, _MM_SHUFFLE(1, 0, 1, 0))),
                          _mm512_castps_si512(_mm512_shuffle_ps(fx, fy, _MM_SHUFFLE(3, 2, 3, 2))));
}
KVS_INLINE __m512i tree16(const __m512i* r2) {
  const __m512i r3a = _mm512_add_epi32(_mm512_shuffle_i32x4(r2[0], r2[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                       _mm512_shuffle_i32x4(r2[0], r2[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512i r3b = _mm512_add_epi32(_mm512_shuffle_i32x4(r2[2], r2[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                       _mm512_shuffle_i32x4(r2[2], r2[3], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_epi32(_mm512_shuffle_i32x4(r3a, r3b, _MM_SHUFFLE(2, 0, 2, 0)),
                          _mm512_shuffle_i32x4(r3a, r3b, _MM_SHUFFLE(3, 1, 3, 1)));
}

// A block's 16 tokens through the tree as they come, for GG heads: row_dots(t, a) writes token t's partial sums for
// each head into a[0 .. GG) (Vec: fp32 or int32 lanes); r2 ends as each head's four quads (tree16 finishes them).
// The next block's lines are prefetched a share per four tokens.
template <int GG, typename Vec, typename RowDots, typename Prefetch>
KVS_INLINE void block_quads(Vec (&r2)[GG][4], RowDots&& row_dots, Prefetch&& prefetch) {
  for (int j = 0; j < 4; ++j) {
    prefetch(j);
    Vec r1[GG][2];
    for (int pr = 0; pr < 2; ++pr) {
      Vec a[2][GG];
      row_dots(4 * j + 2 * pr, a[0]);
      row_dots(4 * j + 2 * pr + 1, a[1]);
      for (int g = 0; g < GG; ++g) r1[g][pr] = pair16(a[0][g], a[1][g]);
    }
    for (int g = 0; g < GG; ++g) r2[g][j] = quad16(r1[g][0], r1[g][1]);
  }
}

// 32 (or fewer, masked) int8 codes of a row as int16 lanes
template <bool kFull>
KVS_INLINE __m512i load32_i16(const i8_t* p, __mmask32 m) {
  return _mm512_cvtepi8_epi16(kFull ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))
                                    : _mm256_maskz_loadu_epi8(m, p));
}

// The query heads as int16 for an int8 pool's q . K: per head its scaled q over its largest |value| / 32767 (a
// relative rounding of 1.5e-5 of that value, ~130x finer than bf16's), NW chunks of 32 a head, zero-padded, 64-byte
// aligned; qsc[h] the factor back. The products of int16 q and int8 codes are exact in int32 (|sum| < 2^31 up to
// head_dim 256), so the only rounding before the softmax is q's.
KVS_INLINE void quantize_heads_i16(const float* qs, int64_t H, int64_t NC, std::vector<int16_t>& buf, int16_t*& q16,
                                   float* qsc) {
  const int64_t NW = (NC + 1) / 2;
  buf.resize(static_cast<size_t>(H * 32 * NW + 32));
  q16 = reinterpret_cast<int16_t*>((reinterpret_cast<uintptr_t>(buf.data()) + 63) & ~uintptr_t{63});
  for (int64_t h = 0; h < H; ++h) {
    const float* qh = qs + h * 16 * NC;  // 64-byte aligned, zero-padded to 16 * NC
    __m512 m = _mm512_setzero_ps();
    for (int64_t c = 0; c < NC; ++c) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_load_ps(qh + 16 * c)));
    const float top = _mm512_reduce_max_ps(m);
    const __m512 inv = _mm512_set1_ps(top > 0.f ? 32767.f / top : 0.f);
    qsc[h] = top / 32767.f;
    int16_t* dst = q16 + h * 32 * NW;
    for (int64_t c = 0; c < 2 * NW; ++c) {  // rounded to nearest even (MXCSR's default), at most 32767 in size
      const __m512 x = c < NC ? _mm512_mul_ps(_mm512_load_ps(qh + 16 * c), inv) : _mm512_setzero_ps();
      _mm256_store_si256(reinterpret_cast<__m256i*>(dst + 16 * c), _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(x)));
    }
  }
}

// The block's 16 scores for each of the GG query heads h0 .. h0 + GG - 1 that share KV head kvh (times the K rows'
// scales for an int8 pool): each K row loaded (a bf16 row widened) once for all of them, FMAs over head_dim per
// token, the tree as the tokens come.
template <int GG, int NC, bool kFull, typename KV, typename Prefetch>
KVS_INLINE void block_dots(const float* qs, const int16_t* q16, const float* qsc, int64_t h0, int64_t kvh, int64_t D,
                           const KV* const* rows, __mmask16 tail, __m512* dots, Prefetch&& prefetch) {
  // the heads' scaled queries, read by the FMAs straight from L1: in registers (GG x NC of them) they crowded out
  // the tree's partial sums (a bf16 pool 1.1x slower in cache)
  const float* qh = qs + h0 * 16 * NC;
  const int64_t Dr = D + kRowExtra<KV>;
  if constexpr (kScaled<KV>) {
    // int8 codes widened to int16 times q as int16 (quantize_heads_i16), pairs summed into int32 lanes: exact, and
    // no conversion of K to fp32
    constexpr int NW = (NC + 1) / 2;
    constexpr bool kFull32 = kFull && NC % 2 == 0;
    const __mmask32 tail32 = kFull32 ? ~__mmask32{0} : static_cast<__mmask32>((1ull << (D - 32 * (NW - 1))) - 1);
    const int16_t* qw = q16 + h0 * 32 * NW;
    __m512i r2[GG][4];
    block_quads<GG>(r2, [&](int t, __m512i* a) {
      const KV* k = rows[t] + kvh * Dr;
      __m512i kc[NW];
      for (int c = 0; c < NW; ++c) kc[c] = load32_i16<kFull32>(k + 32 * c, c == NW - 1 ? tail32 : ~__mmask32{0});
      for (int g = 0; g < GG; ++g) {
        __m512i s = _mm512_madd_epi16(_mm512_load_si512(qw + g * 32 * NW), kc[0]);
        for (int c = 1; c < NW; ++c)
          s = _mm512_add_epi32(s, _mm512_madd_epi16(_mm512_load_si512(qw + (g * NW + c) * 32), kc[c]));
        a[g] = s;
      }
    }, prefetch);
    alignas(64) float ks[16];  // the block's K row scales
    for (int t = 0; t < 16; ++t) ks[t] = row_scale(rows[t] + kvh * Dr, D);
    const __m512 kscale = _mm512_load_ps(ks);
    for (int g = 0; g < GG; ++g)
      dots[g] = _mm512_mul_ps(_mm512_cvtepi32_ps(tree16(r2[g])), _mm512_mul_ps(kscale, _mm512_set1_ps(qsc[h0 + g])));
  } else {
    __m512 r2[GG][4];
    block_quads<GG>(r2, [&](int t, __m512* a) {
      const KV* k = rows[t] + kvh * Dr;
      __m512 kc[NC];
      for (int c = 0; c < NC; ++c) kc[c] = load16<kFull>(k + 16 * c, c == NC - 1 ? tail : 0xFFFF);
      for (int g = 0; g < GG; ++g) {
        __m512 s = _mm512_mul_ps(_mm512_load_ps(qh + g * 16 * NC), kc[0]);
        for (int c = 1; c < NC; ++c) s = _mm512_fmadd_ps(_mm512_load_ps(qh + (g * NC + c) * 16), kc[c], s);
        a[g] = s;
      }
    }, prefetch);
    for (int g = 0; g < GG; ++g) dots[g] = tree16(r2[g]);
  }
}

// A block's V rows weighted into GG heads' sums (acc: the first head's, 16 NC floats a head): each sum rescaled by its
// head's alpha (nullptr: kept), then w[g * wstride + t] times token t's row added in; the next block's lines
// prefetched a share per four tokens, from share `pf0` on
template <int GG, int NC, bool kFull, typename KV, typename Prefetch>
KVS_INLINE void weigh_block_avx512(const KV* const* rows, int m, int64_t at, const float* w, int64_t wstride,
                                   const float* alpha, __mmask16 tail, float* acc, int64_t pf0, Prefetch&& prefetch) {
  __m512 o[GG][NC];
  for (int g = 0; g < GG; ++g)
    for (int c = 0; c < NC; ++c) {
      o[g][c] = _mm512_loadu_ps(acc + g * 16 * NC + 16 * c);
      if (alpha) o[g][c] = _mm512_mul_ps(o[g][c], _mm512_set1_ps(alpha[g]));
    }
  for (int t = 0; t < m; ++t) {
    if ((t & 3) == 0) prefetch(pf0 + t / 4);
    const KV* v = rows[t] + at;
    __m512 vc[NC];
    for (int c = 0; c < NC; ++c) vc[c] = load16<kFull>(v + 16 * c, c == NC - 1 ? tail : 0xFFFF);
    for (int g = 0; g < GG; ++g) {
      const __m512 wt = _mm512_set1_ps(w[g * wstride + t]);
      for (int c = 0; c < NC; ++c) o[g][c] = _mm512_fmadd_ps(wt, vc[c], o[g][c]);
    }
  }
  for (int g = 0; g < GG; ++g)
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(acc + g * 16 * NC + 16 * c, o[g][c]);
}

// One block for the GG query heads h0 .. h0 + GG - 1 that share KV head kvh: each K and V row is loaded (a bf16 row
// widened) once for all of them; each head's arithmetic is the one-head loop's, in the same order. Per head the 16
// scores as one vector (FMAs over head_dim per token, the tree as the tokens come), an online-softmax update of its
// running max / sum / output, then the block's V rows weighted in.
template <int GG, int NC, bool kFull, typename KV, typename Prefetch>
KVS_INLINE void attend_heads_avx512(const float* qs, const int16_t* q16, const float* qsc, int64_t h0, int64_t kvh,
                                    int64_t D, const KV* const* rows, int m, __mmask16 valid, __mmask16 tail,
                                    int64_t v_offset, float* acc, float* mx, float* sm, Prefetch&& prefetch) {
  const int64_t Dr = D + kRowExtra<KV>;
  alignas(64) float vs[16];  // the block's V row scales (an int8 pool)
  if constexpr (kScaled<KV>) {
    for (int t = 0; t < 16; ++t) vs[t] = row_scale(rows[t] + v_offset + kvh * Dr, D);
  }
  __m512 dots[GG];
  block_dots<GG, NC, kFull, KV>(qs, q16, qsc, h0, kvh, D, rows, tail, dots, prefetch);
  alignas(64) float pw[GG][16];
  float alpha[GG];
  for (int g = 0; g < GG; ++g) {
    const int64_t h = h0 + g;
    const __m512 s = _mm512_mask_mov_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()), valid, dots[g]);
    const float m_old = mx[h];
    const float m_new = std::max(m_old, _mm512_reduce_max_ps(s));
    const __m512 pv = _mm512_maskz_mov_ps(valid, exp512_nonpositive(_mm512_sub_ps(s, _mm512_set1_ps(m_new))));
    alpha[g] = m_old == -std::numeric_limits<float>::infinity()
        ? 0.f : _mm512_cvtss_f32(exp512_nonpositive(_mm512_set1_ps(m_old - m_new)));
    mx[h] = m_new;
    sm[h] = sm[h] * alpha[g] + _mm512_reduce_add_ps(pv);
    _mm512_store_ps(pw[g], kScaled<KV> ? _mm512_mul_ps(pv, _mm512_load_ps(vs)) : pv);  // V rows' weights
  }
  weigh_block_avx512<GG, NC, kFull, KV>(rows, m, v_offset + kvh * Dr, &pw[0][0], 16, alpha, tail,
                                        acc + h0 * 16 * NC, 4, prefetch);
}

// An item's queries, scaled once: each head padded to 16 * NC lanes with zeros, 64-byte aligned; for an int8 pool
// also as int16 (q16) with their H factors back (qsc, after q)
template <int NC, bool kFull, typename KV>
KVS_INLINE const float* scale_queries(const float* q, int64_t H, int64_t D, float scale, __mmask16 tail,
                                      std::vector<float>& qbuf, std::vector<int16_t>& q16buf, int16_t*& q16,
                                      float*& qsc) {
  qbuf.resize(static_cast<size_t>(H * 16 * NC + 16 + H));
  float* qs = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(qbuf.data()) + 63) & ~uintptr_t{63});
  for (int64_t h = 0; h < H; ++h)
    for (int c = 0; c < NC; ++c) {
      const __m512 qc = load16<kFull>(q + h * D + 16 * c, c == NC - 1 ? tail : 0xFFFF);
      _mm512_store_ps(qs + (h * NC + c) * 16, _mm512_mul_ps(qc, _mm512_set1_ps(scale)));
    }
  qsc = qs + H * 16 * NC;
  if constexpr (kScaled<KV>) quantize_heads_i16(qs, H, NC, q16buf, q16, qsc);
  return qs;
}

// One (sequence, query) item, keys in blocks of 16 tokens, query heads in groups of up to kHeadGroup that share a
// KV head (attend_heads_avx512). State for all H heads stays in L1; the block's rows (K and V of every kv head) are
// touched once, the next block's are prefetched.
// NC = head_dim / 16 rounded up (the last chunk masked when head_dim is not a multiple of 16; kFull when it is).
constexpr int64_t kHeadGroup = 4;

template <int NC, bool kFull, typename KV>
KVS_INLINE void attend_item_avx512(const float* q, float* out, const KV* pool, const int32_t* table, int64_t tb,
                                   int64_t te, int64_t H, int64_t KVH, int64_t D, int64_t page_stride,
                                   int64_t v_offset, int64_t ps, float scale, std::vector<float>& state,
                                   std::vector<float>& qbuf, std::vector<int16_t>& q16buf, float* part) {
  const int64_t G = H / KVH, row_len = KVH * (D + kRowExtra<KV>);
  const __mmask16 tail = static_cast<__mmask16>(kFull ? 0xFFFF : (1u << (D - 16 * (NC - 1))) - 1);
  HeadStates st(state, H, 16 * NC);
  int16_t* q16 = nullptr;
  float* qsc = nullptr;
  const float* qs = scale_queries<NC, kFull, KV>(q, H, D, scale, tail, qbuf, q16buf, q16, qsc);
  const int64_t steps = KVH * kvs::cdiv(G, kHeadGroup) * 8;
  RowBlocks<KV, 16, kScaled<KV> ? 2 : 1> blk(pool, table, tb, te, page_stride, row_len, ps, v_offset, steps);
  const KV* const* rows = blk.rows;
  while (blk.next()) {
    const int m = blk.m;
    const __mmask16 valid = static_cast<__mmask16>(m == 16 ? 0xFFFF : (1u << m) - 1);
    int64_t step = 0;  // the next block's lines are prefetched a share per eighth of a group's work
    const auto prefetch = [&](int64_t k) { blk.prefetch_upto(step + k + 1); };
    for (int64_t kvh = 0; kvh < KVH; ++kvh) {
      for (int64_t g = 0; g < G; g += kHeadGroup, step += 8) {
        const int64_t h0 = kvh * G + g, n = std::min(kHeadGroup, G - g);
        switch (n) {
#define KVS_HEADS(GG) \
  case GG: attend_heads_avx512<GG, NC, kFull, KV>(qs, q16, qsc, h0, kvh, D, rows, m, valid, tail, v_offset, st.acc, \
                                                  st.mx, st.sm, prefetch); break;
          KVS_HEADS(1) KVS_HEADS(2) KVS_HEADS(3) default: KVS_HEADS(4)
#undef KVS_HEADS
        }
      }
    }
  }
  st.finish(out, part, D);
}

// One item (or part) in two passes, the int8 pool's loop: every block's scores for every head (the K rows, block by
// block in memory order, the next blocks' K lines prefetched), then per head one maximum, one pass of exp and one
// sum over all its scores, then the V rows block by block (their lines prefetched likewise; the first two while the
// softmax runs). No running maximum, no rescale per block: a head's chain of reductions and exps is one per item,
// not one per block. Over an int8 pool 1.04-1.16x the online loop out of cache and 1.10-1.12x in cache on a Zen 4
// EPYC; over a bf16 pool it was 0.88-0.92x out of cache (its K-only pass starves the prefetch), so fp32 and bf16
// rows keep the online loop. Scores take H x cdiv(keys, 16) x 16 floats (an item's keys are at most kPartKeys).
template <int NC, bool kFull, typename KV>
KVS_INLINE void attend_item_avx512_2p(const float* q, float* out, const KV* pool, const int32_t* table, int64_t tb,
                                      int64_t te, int64_t H, int64_t KVH, int64_t D, int64_t page_stride,
                                      int64_t v_offset, int64_t ps, float scale, std::vector<float>& state,
                                      std::vector<float>& qbuf, std::vector<int16_t>& q16buf,
                                      std::vector<float>& sbuf, float* part) {
  static_assert(kScaled<KV>, "the two-pass loop is the int8 pool's");
  const int64_t G = H / KVH, Dr = D + kRowExtra<KV>, row_len = KVH * Dr, n = te - tb, NB = kvs::cdiv(n, 16);
  const __mmask16 tail = static_cast<__mmask16>(kFull ? 0xFFFF : (1u << (D - 16 * (NC - 1))) - 1);
  HeadStates st(state, H, 16 * NC);
  int16_t* q16 = nullptr;
  float* qsc = nullptr;
  const float* qs = scale_queries<NC, kFull, KV>(q, H, D, scale, tail, qbuf, q16buf, q16, qsc);
  const int64_t W = NB * 16;  // a head's scores, then weights
  sbuf.resize(static_cast<size_t>(H * W + 16));
  float* sc = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(sbuf.data()) + 63) & ~uintptr_t{63});
  const int64_t groups = kvs::cdiv(G, kHeadGroup);
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  RowBlocks<KV, 16, 2, Lines::k> blk(pool, table, tb, te, page_stride, row_len, ps, v_offset, KVH * groups * 4);
  for (int64_t b = 0; blk.next(); ++b) {
    const int m = blk.m;
    const __mmask16 valid = static_cast<__mmask16>(m == 16 ? 0xFFFF : (1u << m) - 1);
    const KV* const* rows = blk.rows;
    int64_t step = 0;
    const auto prefetch = [&](int64_t k) { blk.prefetch_upto(step + k + 1); };
    for (int64_t kvh = 0; kvh < KVH; ++kvh)
      for (int64_t g = 0; g < G; g += kHeadGroup, step += 4) {
        const int64_t h0 = kvh * G + g, nh = std::min(kHeadGroup, G - g);
        __m512 dots[kHeadGroup];
        switch (nh) {
#define KVS_DOTS(GG) \
  case GG: block_dots<GG, NC, kFull, KV>(qs, q16, qsc, h0, kvh, D, rows, tail, dots, prefetch); break;
          KVS_DOTS(1) KVS_DOTS(2) KVS_DOTS(3) default: KVS_DOTS(4)
#undef KVS_DOTS
        }
        for (int64_t j = 0; j < nh; ++j)
          _mm512_store_ps(sc + (h0 + j) * W + b * 16, _mm512_mask_mov_ps(ninf, valid, dots[j]));
      }
  }
  // the V rows' blocks, the first two prefetched now (their lines arrive during the softmax)
  RowBlocks<KV, 16, 2, Lines::v> vblk(pool, table, tb, te, page_stride, row_len, ps, v_offset, KVH * groups * 4);
  for (int64_t h = 0; h < H; ++h) {
    float* sh = sc + h * W;
    __m512 mv = _mm512_load_ps(sh);
    for (int64_t b = 1; b < NB; ++b) mv = _mm512_max_ps(mv, _mm512_load_ps(sh + b * 16));
    const float mxh = _mm512_reduce_max_ps(mv);
    const __m512 mb = _mm512_set1_ps(mxh);
    __m512 sv = _mm512_setzero_ps();
    for (int64_t b = 0; b < NB; ++b) {
      const __m512 x = _mm512_load_ps(sh + b * 16);
      const __m512 e = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, ninf, _CMP_NEQ_OQ),  // past the keys: 0
                                           exp512_nonpositive(_mm512_sub_ps(x, mb)));
      sv = _mm512_add_ps(sv, e);
      _mm512_store_ps(sh + b * 16, e);
    }
    st.mx[h] = mxh;
    st.sm[h] = _mm512_reduce_add_ps(sv);
  }
  for (int64_t b = 0; vblk.next(); ++b) {
    const int m = vblk.m;
    const KV* const* rows = vblk.rows;
    int64_t step = 0;
    const auto prefetch = [&](int64_t k) { vblk.prefetch_upto(step + k + 1); };
    for (int64_t kvh = 0; kvh < KVH; ++kvh) {
      const int64_t at = v_offset + kvh * Dr;
      float* w = sc + b * 16;
      alignas(64) float vs[16];  // the V rows' scales into this block's weights
      for (int t = 0; t < 16; ++t) vs[t] = row_scale(rows[t] + at, D);
      const __m512 v = _mm512_load_ps(vs);
      for (int64_t j = 0; j < G; ++j) {
        float* wj = w + (kvh * G + j) * W;
        _mm512_store_ps(wj, _mm512_mul_ps(_mm512_load_ps(wj), v));
      }
      for (int64_t g = 0; g < G; g += kHeadGroup, step += 4) {
        const int64_t h0 = kvh * G + g, nh = std::min(kHeadGroup, G - g);
        float* acc = st.acc + h0 * 16 * NC;
        const float* wh = w + h0 * W;
        switch (nh) {
          case 1: weigh_block_avx512<1, NC, kFull, KV>(rows, m, at, wh, W, nullptr, tail, acc, 0, prefetch); break;
          case 2: weigh_block_avx512<2, NC, kFull, KV>(rows, m, at, wh, W, nullptr, tail, acc, 0, prefetch); break;
          case 3: weigh_block_avx512<3, NC, kFull, KV>(rows, m, at, wh, W, nullptr, tail, acc, 0, prefetch); break;
          default: weigh_block_avx512<4, NC, kFull, KV>(rows, m, at, wh, W, nullptr, tail, acc, 0, prefetch); break;
        }
      }
    }
  }
  st.finish(out, part, D);
}

template <int NC, typename KV>
void run_unit_avx512(const Problem<KV>& p, const Unit& u) {
  thread_local std::vector<float> state, qbuf;
  thread_local std::vector<int16_t> q16buf;
  const int64_t i = p.item_seq[u.item], row = p.query_start[i] + p.item_first[u.item];
  if constexpr (kScaled<KV>) {
    if (g_int8_passes.load(std::memory_order_relaxed) == 2) {
      thread_local std::vector<float> sbuf;
      const auto two = p.D == 16 * NC ? attend_item_avx512_2p<NC, true, KV> : attend_item_avx512_2p<NC, false, KV>;
      two(p.q + row * p.q_row_stride, p.out + row * p.out_row_stride, p.pool, p.tables + i * p.table_width, u.tb,
          u.te, p.H, p.KVH, p.D, p.page_stride, p.v_offset, p.ps, p.scale, state, qbuf, q16buf, sbuf,
          unit_state(p, u));
      return;
    }
  }
  const auto body = p.D == 16 * NC ? attend_item_avx512<NC, true, KV> : attend_item_avx512<NC, false, KV>;
  body(p.q + row * p.q_row_stride, p.out + row * p.out_row_stride, p.pool, p.tables + i * p.table_width, u.tb, u.te,
       p.H, p.KVH, p.D, p.page_stride, p.v_offset, p.ps, p.scale, state, qbuf, q16buf, unit_state(p, u));
}

#pragma GCC pop_options
#endif  // KVS_X86

enum class Isa { generic = 0, avx2 = 1, avx512 = 2 };

const char* isa_name(Isa isa) { return isa == Isa::avx512 ? "avx512" : isa == Isa::avx2 ? "avx2" : "generic"; }

// the CPU's best, no wider than ATEN_CPU_CAPABILITY (cap.h)
Isa best_isa() { return static_cast<Isa>(kvs::best_simd()); }

// "avx512" | "avx2" | "generic" | "" (best): refuses one this CPU cannot run
Isa parse_isa(const std::string& want) {
  const Isa best = best_isa();
  if (want.empty() || want == "auto") return best;
  Isa isa;
  if (want == "avx512") isa = Isa::avx512;
  else if (want == "avx2") isa = Isa::avx2;
  else if (want == "generic") isa = Isa::generic;
  else TORCH_CHECK(false, "KVSERVE_ATTN_ISA must be avx512, avx2, generic or auto, not '", want, "'");
  TORCH_CHECK(static_cast<int>(isa) <= static_cast<int>(best), "this CPU cannot run the ", want,
              " paged-attention kernel (best: ", isa_name(best), ")");
  return isa;
}

std::atomic<int> g_isa{-1};

Isa current_isa() {
  int v = g_isa.load();
  if (v < 0) {
    const char* env = std::getenv("KVSERVE_ATTN_ISA");
    v = static_cast<int>(parse_isa(env ? env : ""));
    g_isa.store(v);
  }
  return static_cast<Isa>(v);
}

std::string set_isa(const std::string& want) {
  g_isa.store(static_cast<int>(parse_isa(want)));
  return isa_name(current_isa());
}

std::string get_isa() { return isa_name(current_isa()); }

int64_t set_int8_passes(int64_t passes) {
  TORCH_CHECK(passes >= 0 && passes <= 2, "the int8 loop runs in 1 or 2 passes (0 keeps it), not ", passes);
  if (passes) g_int8_passes.store(static_cast<int>(passes));
  return g_int8_passes.load();
}

template <typename DimT, typename KV>
void run_unit(const Problem<KV>& p, const Unit& u, Isa isa) {
#ifdef KVS_X86
  if (isa == Isa::avx512) {
    switch (kvs::cdiv(p.D, 16)) {
      case 1: return run_unit_avx512<1, KV>(p, u);
      case 2: return run_unit_avx512<2, KV>(p, u);
      case 3: return run_unit_avx512<3, KV>(p, u);
      case 4: return run_unit_avx512<4, KV>(p, u);
      case 5: return run_unit_avx512<5, KV>(p, u);
      case 6: return run_unit_avx512<6, KV>(p, u);
      case 7: return run_unit_avx512<7, KV>(p, u);
      case 8: return run_unit_avx512<8, KV>(p, u);
      default: break;  // head_dim > 128: the AVX2 loops
    }
  }
  if (isa != Isa::generic && p.D % 8 == 0) {
    switch (p.D / 8) {
      case 1: return run_unit_avx2<1, KV>(p, u);
      case 2: return run_unit_avx2<2, KV>(p, u);
      case 3: return run_unit_avx2<3, KV>(p, u);
      case 4: return run_unit_avx2<4, KV>(p, u);
      case 5: return run_unit_avx2<5, KV>(p, u);
      case 6: return run_unit_avx2<6, KV>(p, u);
      case 8: return run_unit_avx2<8, KV>(p, u);
      case 10: return run_unit_avx2<10, KV>(p, u);
      case 12: return run_unit_avx2<12, KV>(p, u);
      case 16: return run_unit_avx2<16, KV>(p, u);
      default: break;
    }
  }
  if (isa != Isa::generic) return run_unit_avx2_two_pass<DimT, KV>(p, u);
#endif
  run_unit_generic<DimT, KV>(p, u);
}

// Each unit a chunk of the native pool's job, longest first: whichever thread is free takes the next longest, so a
// few long sequences do not leave one thread working alone. Then the split items' parts are merged.
template <typename DimT, typename KV>
void run(const Problem<KV>& p, const std::vector<Unit>& units, const std::vector<std::array<int64_t, 3>>& splits) {
  const Isa isa = current_isa();
  kvs::parallel_chunks(static_cast<int64_t>(units.size()), [&](int64_t at) { run_unit<DimT, KV>(p, units[at], isa); });
  for (const auto& [item, first_part, parts] : splits) {
    const int64_t i = p.item_seq[item], row = p.query_start[i] + p.item_first[item];
    merge_parts(p.out + row * p.out_row_stride, p.states + first_part * p.H * (p.D + 2), parts, p.H, p.D);
  }
}

template <typename KV>
void run_dims(const Problem<KV>& p, const std::vector<Unit>& units, const std::vector<std::array<int64_t, 3>>& splits) {
  switch (p.D) {
    case 16: return run<Dim<16>, KV>(p, units, splits);
    case 32: return run<Dim<32>, KV>(p, units, splits);
    case 64: return run<Dim<64>, KV>(p, units, splits);
    case 80: return run<Dim<80>, KV>(p, units, splits);
    case 96: return run<Dim<96>, KV>(p, units, splits);
    case 128: return run<Dim<128>, KV>(p, units, splits);
    default: return run<Dim<0>, KV>(p, units, splits);
  }
}

// The most keys one part of an item holds: an item of n keys runs as cdiv(n, kPartKeys) parts of equal length
// (rounded up to the AVX-512 loop's 16-key block). 256: one 512-token decode row is two parts (both of a 2-core
// host's threads), while 32 such rows add 32 merges of two parts, a few microseconds a layer.
constexpr int64_t kPartKeys = 256;

// The work units for items of `keys[w]` keys each, longest first (`splits`: (item, first part, parts) of each item
// cut into parts; `num_parts`: the parts' states to keep).
std::vector<Unit> plan_units(const std::vector<int64_t>& keys, std::vector<std::array<int64_t, 3>>* splits,
                             int64_t* num_parts) {
  std::vector<Unit> units;
  *num_parts = 0;
  for (int64_t w = 0; w < static_cast<int64_t>(keys.size()); ++w) {
    const int64_t n = keys[w], parts = kvs::cdiv(n, kPartKeys);
    if (parts <= 1) {
      units.push_back({w, 0, n, -1});
      continue;
    }
    const int64_t len = kvs::cdiv(kvs::cdiv(n, parts), 16) * 16;
    const int64_t first = *num_parts;
    for (int64_t tb = 0; tb < n; tb += len) units.push_back({w, tb, std::min(n, tb + len), (*num_parts)++});
    splits->push_back({w, first, *num_parts - first});
  }
  std::stable_sort(units.begin(), units.end(), [](const Unit& a, const Unit& b) { return a.te - a.tb > b.te - b.tb; });
  return units;
}

// One step's work over a pool layer, as paged_attention and paged_read both run it: the checked index tensors, the
// work items (sequence, query) and their units (plan_units)
struct StepPlan {
  const int32_t *tab, *lens, *qstart, *qlen;
  int64_t W, KVH, D, ps, layer_off, page_stride, v_offset, num_parts = 0;
  std::vector<int64_t> item_seq, item_first;
  std::vector<Unit> units;
  std::vector<std::array<int64_t, 3>> splits;
};

StepPlan plan_step(const at::Tensor& pool, int64_t layer, const at::Tensor& tables, const at::Tensor& context_lens,
                   const at::Tensor& query_start, const at::Tensor& query_len, int64_t q_rows) {
  const auto kv_type = pool.scalar_type();
  TORCH_CHECK(pool.dim() == 6 && pool.is_contiguous() && pool.device().is_cpu() &&
                  (kv_type == at::kFloat || kv_type == at::kBFloat16 || kv_type == at::kChar),
              "pool must be a contiguous fp32, bf16 or int8 CPU tensor [pages, layers, 2, page_size, kv_heads, row]");
  for (const auto* t : {&tables, &context_lens, &query_start, &query_len}) {
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous() && t->device().is_cpu(), "index tensors must be int32");
  }
  StepPlan sp;
  const int64_t S = tables.size(0);
  sp.W = tables.size(1);
  TORCH_CHECK(tables.dim() == 2 && context_lens.numel() == S && query_start.numel() == S && query_len.numel() == S,
              "tables [S, P] and one context_len, query_start, query_len per sequence");
  const int64_t num_pages = pool.size(0), L = pool.size(1), Dr = pool.size(5);
  sp.ps = pool.size(3);
  sp.KVH = pool.size(4);
  sp.D = Dr - (kv_type == at::kChar ? 4 : 0);
  TORCH_CHECK(layer >= 0 && layer < L, "layer out of range");
  sp.lens = context_lens.data_ptr<int32_t>();
  sp.qstart = query_start.data_ptr<int32_t>();
  sp.qlen = query_len.data_ptr<int32_t>();
  sp.tab = tables.data_ptr<int32_t>();
  for (int64_t i = 0; i < S; ++i) {
    TORCH_CHECK(sp.qlen[i] >= 1 && sp.lens[i] >= sp.qlen[i] && kvs::cdiv(sp.lens[i], sp.ps) <= sp.W, "sequence ", i,
                ": bad query_len/context_len for its table");
    TORCH_CHECK(sp.qstart[i] >= 0 && sp.qstart[i] + sp.qlen[i] <= q_rows, "sequence ", i, ": query rows out of range");
    for (int64_t k = 0; k < kvs::cdiv(sp.lens[i], sp.ps); ++k) {
      TORCH_CHECK(sp.tab[i * sp.W + k] >= 0 && sp.tab[i * sp.W + k] < num_pages, "sequence ", i,
                  ": page id out of range");
    }
    for (int64_t j = 0; j < sp.qlen[i]; ++j) {
      sp.item_seq.push_back(i);
      sp.item_first.push_back(j);
    }
  }
  sp.layer_off = layer * 2 * sp.ps * sp.KVH * Dr;
  sp.page_stride = L * 2 * sp.ps * sp.KVH * Dr;
  sp.v_offset = sp.ps * sp.KVH * Dr;
  std::vector<int64_t> keys(sp.item_seq.size());  // keys each query may see (causal, bottom-right aligned)
  for (size_t w = 0; w < keys.size(); ++w)
    keys[w] = sp.lens[sp.item_seq[w]] - sp.qlen[sp.item_seq[w]] + sp.item_first[w] + 1;
  sp.units = plan_units(keys, &sp.splits, &sp.num_parts);
  return sp;
}

// f(the pool's elements as the loops read them): bf16 raw, int8 codes, or fp32 (plan_step checked the dtype)
template <typename F>
void with_rows(const at::Tensor& pool, F&& f) {
  const auto kv_type = pool.scalar_type();
  if (kv_type == at::kBFloat16)
    f(static_cast<const bf16_t*>(pool.data_ptr()));
  else if (kv_type == at::kChar)
    f(static_cast<const i8_t*>(pool.data_ptr()));
  else
    f(pool.data_ptr<float>());
}

void paged_attention(const at::Tensor& out, const at::Tensor& q, const at::Tensor& pool, int64_t layer,
                     const at::Tensor& tables, const at::Tensor& context_lens, const at::Tensor& query_start,
                     const at::Tensor& query_len, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.stride(2) == 1 && q.stride(1) == q.size(2),
              "q must be fp32 [T, H, D] with contiguous heads");
  TORCH_CHECK(out.sizes() == q.sizes() && out.is_contiguous() && out.scalar_type() == at::kFloat, "out must be like q");
  const StepPlan sp = plan_step(pool, layer, tables, context_lens, query_start, query_len, q.size(0));
  const int64_t H = q.size(1), D = q.size(2);
  TORCH_CHECK(sp.D == D && H % sp.KVH == 0,
              "q heads must be a multiple of kv heads with the pool's head_dim (an int8 pool's rows: head_dim + 4)");
  std::vector<float> states(static_cast<size_t>(sp.num_parts * H * (D + 2)));
  auto go = [&](const auto* data) {
    using KV = std::remove_const_t<std::remove_pointer_t<decltype(data)>>;
    run_dims(Problem<KV>{q.data_ptr<float>(), out.data_ptr<float>(), data + sp.layer_off, sp.tab, sp.lens, sp.qstart,
                         sp.qlen, sp.item_seq.data(), sp.item_first.data(), sp.W, H, sp.KVH, D, sp.ps, sp.page_stride,
                         sp.v_offset, q.stride(0), out.stride(0), static_cast<float>(scale), states.data()},
             sp.units, sp.splits);
  };
  with_rows(pool, go);
}

using u32_alias = uint32_t __attribute__((may_alias));

// The bytes one unit of paged_attention reads (every K and V row of its keys, all KV heads), read the way the AVX-512
// loop walks them (blocks of 16 rows, the block ahead prefetched into L2 a share per four rows, two ahead for an
// int8 pool) with no arithmetic but a sum of their 32-bit words
template <typename KV>
uint64_t read_unit(const KV* pool, const int32_t* table, const Unit& u, int64_t page_stride, int64_t row_len,
                   int64_t ps, int64_t v_offset) {
  RowBlocks<KV, 16, kScaled<KV> ? 2 : 1> blk(pool, table, u.tb, u.te, page_stride, row_len, ps, v_offset, 4);
  const int64_t words = row_len * static_cast<int64_t>(sizeof(KV)) / 4;
  uint64_t sum = 0;
  while (blk.next()) {
    for (int t = 0; t < blk.m; ++t) {
      const auto* k = reinterpret_cast<const u32_alias*>(blk.rows[t]);
      const auto* v = reinterpret_cast<const u32_alias*>(blk.rows[t] + v_offset);
      for (int64_t w = 0; w < words; ++w) sum += uint64_t{k[w]} + v[w];
      if (t % 4 == 3) blk.prefetch_upto(t / 4 + 1);
    }
  }
  return sum;
}

// bench.attention's yardstick for the kernel's memory: what one decode step's call reads of `layer` (the same items,
// units and threads as paged_attention over these tables), read and summed, no attention. Returns the sum of the
// 32-bit words read (mod 2^64), which the tests check against torch's over the same rows.
int64_t paged_read(const at::Tensor& pool, int64_t layer, const at::Tensor& tables, const at::Tensor& context_lens,
                   const at::Tensor& query_start, const at::Tensor& query_len) {
  const StepPlan sp = plan_step(pool, layer, tables, context_lens, query_start, query_len,
                                std::numeric_limits<int64_t>::max());
  const int64_t row_len = sp.KVH * pool.size(5);
  TORCH_CHECK(row_len * pool.element_size() % 4 == 0, "a token's rows must be whole 32-bit words");
  std::vector<uint64_t> sums(sp.units.size());
  auto go = [&](const auto* data) {
    kvs::parallel_chunks(static_cast<int64_t>(sp.units.size()), [&](int64_t at) {
      const Unit& u = sp.units[at];
      sums[at] = read_unit(data + sp.layer_off, sp.tab + sp.item_seq[u.item] * sp.W, u, sp.page_stride, row_len,
                           sp.ps, sp.v_offset);
    });
  };
  with_rows(pool, go);
  uint64_t total = 0;
  for (const uint64_t x : sums) total += x;
  return static_cast<int64_t>(total);
}

// How plan_units cuts items of these key counts: the parts of each item (tests, bench)
std::vector<int64_t> attention_parts(const std::vector<int64_t>& keys) {
  std::vector<std::array<int64_t, 3>> splits;
  int64_t num_parts = 0;
  plan_units(keys, &splits, &num_parts);
  std::vector<int64_t> parts(keys.size(), 1);
  for (const auto& [item, first, n] : splits) parts[item] = n;
  return parts;
}

}  // namespace

TORCH_LIBRARY(kvserve_paged, m) {
  m.def("paged_attention(Tensor(a!) out, Tensor q, Tensor pool, int layer, Tensor tables, Tensor context_lens, "
        "Tensor query_start, Tensor query_len, float scale) -> ()");
  // which build of the loop runs (avx512|avx2|generic; set_isa("") picks the best this CPU has)
  m.def("set_isa(str isa) -> str", &set_isa);
  m.def("isa() -> str", &get_isa);
  // the int8 pool's AVX-512 loop: 2 passes (the default) or 1 (online softmax); 0 reads it
  m.def("set_int8_passes(int passes) -> int", &set_int8_passes);
  m.def("attention_parts(int[] keys) -> int[]", &attention_parts);
  // bench.attention's yardstick: the bytes a paged_attention call reads, read with no attention (their words' sum)
  m.def("paged_read(Tensor pool, int layer, Tensor tables, Tensor context_lens, Tensor query_start, "
        "Tensor query_len) -> int");
}

TORCH_LIBRARY_IMPL(kvserve_paged, CPU, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("paged_read", &paged_read);
}
