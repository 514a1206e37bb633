// Paged attention on the CPU that reads K/V straight from the pool's pages (no gather copy).
//
// Pool layout (inference/kv_cache.py): pool[page, layer, k_or_v, offset, kv_head, head_dim], fp32 or bf16 (read
// as the top half of an fp32: exact; the math is fp32 either way, a bf16 pool reads half the bytes).
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
// KVSERVE_ATTN_ISA=avx512|avx2|generic read at load, or the set_isa op): `avx512` (blocks of 16
// tokens, online softmax, see attend_item_avx512), `avx2` and `generic` (the two-pass loop compiled
// for x86-64-v3 and for the baseline). No -march flag is used, so the .so runs on any x86-64 CPU.
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
#include <vector>

#include "cap.h"
#include "pool.h"

namespace {

#if defined(__x86_64__) && defined(__GNUC__)
#define KVS_X86 1
#include <immintrin.h>
#endif

#define KVS_INLINE inline __attribute__((always_inline))

using bf16_t = uint16_t;  // a bf16 pool's element, raw: the top 16 bits of an fp32

KVS_INLINE float kv_load(const float* p, int64_t i) { return p[i]; }
KVS_INLINE float kv_load(const bf16_t* p, int64_t i) {
  const uint32_t bits = static_cast<uint32_t>(p[i]) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// e^x for x <= 0 (scores minus their max), vectorizable: x = n ln2 + r, |r| <= ln2 / 2, e^r by its
// Taylor series to degree 7 (relative error < 1e-7 before float rounding), 2^n by building the float.
KVS_INLINE float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float t = x * 1.4426950408889634f;
  const float n = std::floor(t + 0.5f);
  const float r = (t - n) * 0.6931471805599453f;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
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
  const int64_t G = H / KVH, row_len = KVH * D, n = te - tb, first_page = tb / ps, end_page = (te + ps - 1) / ps;
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
          for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(next + o * row_bytes + b);
        }
        const KV* rowp = page + o * row_len;
        for (int64_t kvh = 0; kvh < KVH; ++kvh) {
          const KV* x = rowp + kvh * D;
          for (int64_t g = 0; g < G; ++g) {
            const int64_t h = kvh * G + g;
            if (pass == 0) {
              const float* qh = q + h * D;
              float dot = 0.f;
#pragma omp simd reduction(+ : dot)
              for (int64_t d = 0; d < D; ++d) dot += qh[d] * kv_load(x, d);
              s[h * n + t0 + o] = dot * scale;
            } else {
              const float p = s[h * n + t0 + o];
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

#ifdef KVS_X86
template <typename DimT, typename KV>
__attribute__((target("arch=x86-64-v3"))) void run_unit_avx2(const Problem<KV>& p, const Unit& u) {
  run_unit_body<DimT, KV>(p, u);
}

#pragma GCC push_options
#pragma GCC target("avx512f,avx512dq,avx512vl,avx512bw,avx2,fma,bmi2")

// e^x for x <= 0 on 16 lanes: the scalar exp_nonpositive's reduction and polynomial, 2^n by scalef.
KVS_INLINE __m512 exp512_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f));
  const __m512 n = _mm512_roundscale_ps(_mm512_add_ps(t, _mm512_set1_ps(0.5f)), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.6931471805599453f));
  __m512 q = _mm512_set1_ps(1.0f / 5040.0f);
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(1.0f / 720.0f));
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(1.0f / 120.0f));
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(1.0f / 24.0f));
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(1.0f / 6.0f));
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(0.5f));
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(1.0f));
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(q, n);
}

// 16 (or fewer, masked) K or V values of one row as fp32 lanes
KVS_INLINE __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
KVS_INLINE __m512 load16(const bf16_t* p, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

// 16 vectors of partial sums (a[t]: token t's products, 16 lanes) -> one vector of their 16 sums:
// a transpose-and-add tree (15 adds, 30 shuffles per 16 dot products, no per-product reduction).
// The result's lanes come out in the order (4 * (t % 4) + t / 4); kFixLanes puts them back.
KVS_INLINE __m512 reduce16(const __m512* a) {
  __m512 r1[8], r2[4], r3[2];
  for (int i = 0; i < 8; ++i) {
    r1[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                          _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  }
  for (int i = 0; i < 4; ++i) {
    r2[i] = _mm512_add_ps(_mm512_shuffle_f32x4(r1[2 * i], r1[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                          _mm512_shuffle_f32x4(r1[2 * i], r1[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  }
  for (int i = 0; i < 2; ++i) {
    r3[i] = _mm512_add_ps(_mm512_shuffle_ps(r2[2 * i], r2[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                          _mm512_shuffle_ps(r2[2 * i], r2[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  }
  const __m512 r4 = _mm512_add_ps(_mm512_shuffle_ps(r3[0], r3[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_ps(r3[0], r3[1], _MM_SHUFFLE(3, 1, 3, 1)));
  return r4;
}

// One (sequence, query) item, keys in blocks of 16 tokens: for each query head, the 16 scores as one
// vector (FMAs over head_dim per token, reduce16), an online-softmax update of the head's running
// max / sum / output, then the block's V rows weighted in. State for all H heads stays in L1; the
// block's rows (K and V of every kv head) are touched once, the next block's are prefetched.
// NC = head_dim / 16 rounded up (the last chunk masked when head_dim is not a multiple of 16).
template <int NC, typename KV>
KVS_INLINE void attend_item_avx512(const float* q, float* out, const KV* pool, const int32_t* table, int64_t tb,
                                   int64_t te, int64_t H, int64_t KVH, int64_t D, int64_t page_stride,
                                   int64_t v_offset, int64_t ps, float scale, const __m512i fix_lanes,
                                   std::vector<float>& state, float* part) {
  const int64_t n = te - tb;
  const int64_t G = H / KVH, row_len = KVH * D;
  const __mmask16 tail = static_cast<__mmask16>(D - 16 * (NC - 1) >= 16 ? 0xFFFF : (1u << (D - 16 * (NC - 1))) - 1);
  state.resize(static_cast<size_t>(H) * (16 * NC + 2));
  float* acc = state.data();            // [H, 16 * NC] running output (unnormalized)
  float* mx = acc + H * 16 * NC;        // [H] running max
  float* sm = mx + H;                   // [H] running sum
  for (int64_t h = 0; h < H; ++h) {
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(acc + h * 16 * NC + 16 * c, _mm512_setzero_ps());
    mx[h] = -std::numeric_limits<float>::infinity();
    sm[h] = 0.f;
  }
  const KV* rows[16];
  const KV* next_rows[16];
  int64_t cur_page = tb / ps, cur_off = tb % ps;  // the token rows in order, page by page (no division per row)
  auto next_row = [&]() {
    const KV* r = pool + static_cast<int64_t>(table[cur_page]) * page_stride + cur_off * row_len;
    if (++cur_off == ps) cur_off = 0, ++cur_page;
    return r;
  };
  const int64_t row_bytes = row_len * static_cast<int64_t>(sizeof(KV));
  for (int t = 0, m0 = static_cast<int>(std::min<int64_t>(16, n)); t < m0; ++t) next_rows[t] = next_row();
  for (int64_t t0 = 0; t0 < n; t0 += 16) {
    const int m = static_cast<int>(std::min<int64_t>(16, n - t0));
    for (int t = 0; t < m; ++t) rows[t] = next_rows[t];
    for (int t = m; t < 16; ++t) rows[t] = rows[0];  // lanes past the end read a valid row, masked out below
    const __mmask16 valid = static_cast<__mmask16>(m == 16 ? 0xFFFF : (1u << m) - 1);
    // pages are scattered, so the hardware prefetcher cannot see the next block's rows: their lines
    // (K and V) are prefetched a share per head below, spread over this block's work (a burst of them
    // all at once filled the miss buffers and stalled the loads)
    int mn = 0;
    if (t0 + 16 < n) {
      mn = static_cast<int>(std::min<int64_t>(16, n - t0 - 16));
      for (int t = 0; t < mn; ++t) next_rows[t] = next_row();
    }
    const int64_t lines = 2 * mn * ((row_bytes + 63) / 64);
    int64_t line = 0, pf_b = 0;
    int pf_r = 0;
    const char* pf_row = mn ? reinterpret_cast<const char*>(next_rows[0]) : nullptr;
    for (int64_t kvh = 0; kvh < KVH; ++kvh) {
      for (int64_t g = 0; g < G; ++g) {
        const int64_t h = kvh * G + g;
        for (const int64_t stop = lines * (h + 1) / H; line < stop; ++line) {
          __builtin_prefetch(pf_row + pf_b);
          if ((pf_b += 64) >= row_bytes) {  // next line: K row, then V row, then the next token's
            pf_b = 0;
            pf_row = ++pf_r >= 2 * mn ? pf_row
                : reinterpret_cast<const char*>(next_rows[pf_r >> 1] + ((pf_r & 1) ? v_offset : 0));
          }
        }
        __m512 qv[NC];
        for (int c = 0; c < NC; ++c) {
          const __mmask16 mk = c == NC - 1 ? tail : 0xFFFF;
          qv[c] = _mm512_mul_ps(_mm512_maskz_loadu_ps(mk, q + h * D + 16 * c), _mm512_set1_ps(scale));
        }
        __m512 part[16];
        for (int t = 0; t < 16; ++t) {
          const KV* k = rows[t] + kvh * D;
          __m512 a = _mm512_mul_ps(qv[0], load16(k, NC == 1 ? tail : 0xFFFF));
          for (int c = 1; c < NC; ++c) {
            const __mmask16 mk = c == NC - 1 ? tail : 0xFFFF;
            a = _mm512_fmadd_ps(qv[c], load16(k + 16 * c, mk), a);
          }
          part[t] = a;
        }
        const __m512 s = _mm512_mask_mov_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()), valid,
                                            _mm512_permutexvar_ps(fix_lanes, reduce16(part)));
        const float m_old = mx[h];
        const float m_new = std::max(m_old, _mm512_reduce_max_ps(s));
        const __m512 pv = _mm512_maskz_mov_ps(valid, exp512_nonpositive(_mm512_sub_ps(s, _mm512_set1_ps(m_new))));
        const float alpha = m_old == -std::numeric_limits<float>::infinity()
            ? 0.f : _mm512_cvtss_f32(exp512_nonpositive(_mm512_set1_ps(m_old - m_new)));
        mx[h] = m_new;
        sm[h] = sm[h] * alpha + _mm512_reduce_add_ps(pv);
        alignas(64) float pw[16];
        _mm512_store_ps(pw, pv);
        float* oh = acc + h * 16 * NC;
        __m512 o[NC];
        const __m512 av = _mm512_set1_ps(alpha);
        for (int c = 0; c < NC; ++c) o[c] = _mm512_mul_ps(_mm512_loadu_ps(oh + 16 * c), av);
        for (int t = 0; t < m; ++t) {
          const __m512 w = _mm512_set1_ps(pw[t]);
          const KV* v = rows[t] + v_offset + kvh * D;
          for (int c = 0; c < NC; ++c) {
            const __mmask16 mk = c == NC - 1 ? tail : 0xFFFF;
            o[c] = _mm512_fmadd_ps(w, load16(v + 16 * c, mk), o[c]);
          }
        }
        for (int c = 0; c < NC; ++c) _mm512_storeu_ps(oh + 16 * c, o[c]);
      }
    }
  }
  for (int64_t h = 0; h < H; ++h) {
    const __m512 inv = _mm512_set1_ps(part ? 1.f : 1.f / sm[h]);  // a part stays unnormalized (merge_parts)
    float* dst = part ? part : out;
    for (int c = 0; c < NC; ++c) {
      const __mmask16 mk = c == NC - 1 ? tail : 0xFFFF;
      _mm512_mask_storeu_ps(dst + h * D + 16 * c, mk, _mm512_mul_ps(_mm512_loadu_ps(acc + h * 16 * NC + 16 * c), inv));
    }
    if (part) {
      part[H * D + h] = mx[h];
      part[H * D + H + h] = sm[h];
    }
  }
}

template <int NC, typename KV>
void run_unit_avx512(const Problem<KV>& p, const Unit& u) {
  thread_local std::vector<float> state;
  // reduce16's lane l holds token 4 * (l % 4) + l / 4: gather them back into token order
  alignas(64) int32_t idx[16];
  for (int t = 0; t < 16; ++t) idx[t] = 4 * (t % 4) + t / 4;
  const __m512i fix_lanes = _mm512_load_si512(idx);
  const int64_t i = p.item_seq[u.item], row = p.query_start[i] + p.item_first[u.item];
  attend_item_avx512<NC, KV>(p.q + row * p.q_row_stride, p.out + row * p.out_row_stride, p.pool,
                             p.tables + i * p.table_width, u.tb, u.te, p.H, p.KVH, p.D, p.page_stride, p.v_offset,
                             p.ps, p.scale, fix_lanes, state, unit_state(p, u));
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

template <typename DimT, typename KV>
void run_unit(const Problem<KV>& p, const Unit& u, Isa isa) {
#ifdef KVS_X86
  if (isa == Isa::avx512) {
    switch ((p.D + 15) / 16) {
      case 1: return run_unit_avx512<1, KV>(p, u);
      case 2: return run_unit_avx512<2, KV>(p, u);
      case 3: return run_unit_avx512<3, KV>(p, u);
      case 4: return run_unit_avx512<4, KV>(p, u);
      case 5: return run_unit_avx512<5, KV>(p, u);
      case 6: return run_unit_avx512<6, KV>(p, u);
      case 7: return run_unit_avx512<7, KV>(p, u);
      case 8: return run_unit_avx512<8, KV>(p, u);
      default: break;  // head_dim > 128: the AVX2 loop
    }
  }
  if (isa != Isa::generic) return run_unit_avx2<DimT, KV>(p, u);
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
    const int64_t n = keys[w], parts = (n + kPartKeys - 1) / kPartKeys;
    if (parts <= 1) {
      units.push_back({w, 0, n, -1});
      continue;
    }
    const int64_t len = (((n + parts - 1) / parts + 15) / 16) * 16;
    const int64_t first = *num_parts;
    for (int64_t tb = 0; tb < n; tb += len) units.push_back({w, tb, std::min(n, tb + len), (*num_parts)++});
    splits->push_back({w, first, *num_parts - first});
  }
  std::stable_sort(units.begin(), units.end(), [](const Unit& a, const Unit& b) { return a.te - a.tb > b.te - b.tb; });
  return units;
}

void paged_attention(const at::Tensor& out, const at::Tensor& q, const at::Tensor& pool, int64_t layer,
                     const at::Tensor& tables, const at::Tensor& context_lens, const at::Tensor& query_start,
                     const at::Tensor& query_len, double scale) {
  const bool bf16 = pool.scalar_type() == at::kBFloat16;
  TORCH_CHECK(pool.dim() == 6 && pool.is_contiguous() && (bf16 || pool.scalar_type() == at::kFloat) &&
                  pool.device().is_cpu(),
              "pool must be a contiguous fp32 or bf16 CPU tensor [pages, layers, 2, page_size, kv_heads, head_dim]");
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.stride(2) == 1 && q.stride(1) == q.size(2),
              "q must be fp32 [T, H, D] with contiguous heads");
  TORCH_CHECK(out.sizes() == q.sizes() && out.is_contiguous() && out.scalar_type() == at::kFloat, "out must be like q");
  for (const auto* t : {&tables, &context_lens, &query_start, &query_len}) {
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous() && t->device().is_cpu(), "index tensors must be int32");
  }
  const int64_t S = tables.size(0), W = tables.size(1);
  TORCH_CHECK(tables.dim() == 2 && context_lens.numel() == S && query_start.numel() == S && query_len.numel() == S,
              "tables [S, P] and one context_len, query_start, query_len per sequence");
  const int64_t num_pages = pool.size(0), L = pool.size(1), ps = pool.size(3), KVH = pool.size(4), D = pool.size(5);
  const int64_t H = q.size(1);
  TORCH_CHECK(q.size(2) == D && H % KVH == 0, "q heads must be a multiple of kv heads with the pool's head_dim");
  TORCH_CHECK(layer >= 0 && layer < L, "layer out of range");
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  const int32_t* qstart = query_start.data_ptr<int32_t>();
  const int32_t* qlen = query_len.data_ptr<int32_t>();
  const int32_t* tab = tables.data_ptr<int32_t>();
  std::vector<int64_t> item_seq, item_first;
  for (int64_t i = 0; i < S; ++i) {
    TORCH_CHECK(qlen[i] >= 1 && lens[i] >= qlen[i] && (lens[i] + ps - 1) / ps <= W, "sequence ", i,
                ": bad query_len/context_len for its table");
    TORCH_CHECK(qstart[i] >= 0 && qstart[i] + qlen[i] <= q.size(0), "sequence ", i, ": query rows out of range");
    for (int64_t k = 0; k < (lens[i] + ps - 1) / ps; ++k) {
      TORCH_CHECK(tab[i * W + k] >= 0 && tab[i * W + k] < num_pages, "sequence ", i, ": page id out of range");
    }
    for (int64_t j = 0; j < qlen[i]; ++j) {
      item_seq.push_back(i);
      item_first.push_back(j);
    }
  }
  const int64_t layer_off = layer * 2 * ps * KVH * D, page_stride = L * 2 * ps * KVH * D, v_offset = ps * KVH * D;
  std::vector<int64_t> keys(item_seq.size());  // keys each query may see (causal, bottom-right aligned)
  for (size_t w = 0; w < keys.size(); ++w) keys[w] = lens[item_seq[w]] - qlen[item_seq[w]] + item_first[w] + 1;
  std::vector<std::array<int64_t, 3>> splits;
  int64_t num_parts = 0;
  const std::vector<Unit> units = plan_units(keys, &splits, &num_parts);
  std::vector<float> states(static_cast<size_t>(num_parts * H * (D + 2)));
  if (bf16) {
    const auto* data = reinterpret_cast<const bf16_t*>(pool.data_ptr<c10::BFloat16>());
    run_dims(Problem<bf16_t>{q.data_ptr<float>(), out.data_ptr<float>(), data + layer_off, tab, lens, qstart, qlen,
                             item_seq.data(), item_first.data(), W, H, KVH, D, ps, page_stride, v_offset,
                             q.stride(0), out.stride(0), static_cast<float>(scale), states.data()}, units, splits);
  } else {
    run_dims(Problem<float>{q.data_ptr<float>(), out.data_ptr<float>(), pool.data_ptr<float>() + layer_off, tab, lens,
                            qstart, qlen, item_seq.data(), item_first.data(), W, H, KVH, D, ps, page_stride, v_offset,
                            q.stride(0), out.stride(0), static_cast<float>(scale), states.data()}, units, splits);
  }
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
  m.def("attention_parts(int[] keys) -> int[]", &attention_parts);
}

TORCH_LIBRARY_IMPL(kvserve_paged, CPU, m) { m.impl("paged_attention", &paged_attention); }
