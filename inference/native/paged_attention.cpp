// Paged attention on the CPU that reads K/V straight from the pool's pages (no gather copy).
//
// Pool layout (inference/kv_cache.py): pool[page, layer, k_or_v, offset, kv_head, head_dim], fp32.
// Sequence i owns query rows [query_start[i], query_start[i] + query_len[i]) of q/out and its
// context_lens[i] tokens live in pages tables[i, 0..]. Query j of sequence i attends causally to
// keys 0 .. context_lens[i] - query_len[i] + j (bottom-right aligned; a decode row sees them all).
// Query head h reads KV head h / (H / KVH) (grouped-query attention; MHA when H == KVH).
// One work item is (sequence, query): all its heads, so each page is read as one contiguous stream.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define KVS_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define KVS_CLONES
#endif

#define KVS_INLINE inline __attribute__((always_inline))

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
// over the item's n keys. A token's K (and V) rows for all kv heads are contiguous in a page, so
// the page is read as one stream; the next page is prefetched while this one is used.
template <typename DimT>
KVS_INLINE void attend_item(const float* q, float* out, const float* pool, const int32_t* table, int64_t n,
                            int64_t H, int64_t KVH, int64_t d_runtime, int64_t page_stride, int64_t v_offset,
                            int64_t ps, float scale, std::vector<float>& scores) {
  const int64_t D = DimT::value > 0 ? DimT::value : d_runtime;
  const int64_t G = H / KVH, row_len = KVH * D, num_pages = (n + ps - 1) / ps;
  scores.resize(static_cast<size_t>(H) * n);
  float* s = scores.data();
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
        const float inv = 1.f / sum;
#pragma omp simd
        for (int64_t t = 0; t < n; ++t) sh[t] *= inv;
        float* oh = out + h * D;
        for (int64_t d = 0; d < D; ++d) oh[d] = 0.f;
      }
    }
    const int64_t base = pass == 0 ? 0 : v_offset;
    for (int64_t pi = 0; pi < num_pages; ++pi) {
      const float* page = pool + static_cast<int64_t>(table[pi]) * page_stride + base;
      // the next page's rows, one row ahead of their use: pages are scattered, so the hardware
      // prefetcher cannot see the jump from one to the next
      const char* next = pi + 1 < num_pages
          ? reinterpret_cast<const char*>(pool + static_cast<int64_t>(table[pi + 1]) * page_stride + base) : nullptr;
      const int64_t row_bytes = row_len * static_cast<int64_t>(sizeof(float));
      const int64_t t0 = pi * ps, m = std::min(ps, n - t0);
      for (int64_t o = 0; o < m; ++o) {
        if (next) {
          for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(next + o * row_bytes + b);
        }
        const float* rowp = page + o * row_len;
        for (int64_t kvh = 0; kvh < KVH; ++kvh) {
          const float* x = rowp + kvh * D;
          for (int64_t g = 0; g < G; ++g) {
            const int64_t h = kvh * G + g;
            if (pass == 0) {
              const float* qh = q + h * D;
              float acc = 0.f;
#pragma omp simd reduction(+ : acc)
              for (int64_t d = 0; d < D; ++d) acc += qh[d] * x[d];
              s[h * n + t0 + o] = acc * scale;
            } else {
              const float p = s[h * n + t0 + o];
              float* oh = out + h * D;
#pragma omp simd
              for (int64_t d = 0; d < D; ++d) oh[d] += p * x[d];
            }
          }
        }
      }
    }
  }
}

struct Problem {
  const float* q;
  float* out;
  const float* pool;  // already offset to (page 0, layer, K)
  const int32_t* tables;
  const int32_t* context_lens;
  const int32_t* query_start;
  const int32_t* query_len;
  const int64_t* item_seq;  // work item -> sequence
  const int64_t* item_first;  // work item -> first query index inside its sequence
  int64_t table_width, H, KVH, D, ps, page_stride, v_offset, q_row_stride, out_row_stride;
  float scale;
};

template <typename DimT>
KVS_CLONES void run_items(const Problem& p, const std::vector<int64_t>& order, int64_t first, int64_t step) {
  std::vector<float> scores;
  for (int64_t at = first; at < static_cast<int64_t>(order.size()); at += step) {
    const int64_t item = order[at];
    const int64_t i = p.item_seq[item], j = p.item_first[item];
    const int64_t n = p.context_lens[i] - p.query_len[i] + j + 1;  // keys this query may see
    const int64_t row = p.query_start[i] + j;
    attend_item<DimT>(p.q + row * p.q_row_stride, p.out + row * p.out_row_stride, p.pool, p.tables + i * p.table_width,
                      n, p.H, p.KVH, p.D, p.page_stride, p.v_offset, p.ps, p.scale, scores);
  }
}

// Work items longest first, dealt round-robin to the threads: a few long sequences do not leave
// one thread working alone (a static split of contiguous items did).
template <typename DimT>
void run(const Problem& p, const std::vector<int64_t>& order) {
  const int64_t nt = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), order.size()));
  at::parallel_for(0, nt, 1, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) run_items<DimT>(p, order, t, nt);
  });
}

void paged_attention(const at::Tensor& out, const at::Tensor& q, const at::Tensor& pool, int64_t layer,
                     const at::Tensor& tables, const at::Tensor& context_lens, const at::Tensor& query_start,
                     const at::Tensor& query_len, double scale) {
  TORCH_CHECK(pool.dim() == 6 && pool.is_contiguous() && pool.scalar_type() == at::kFloat && pool.device().is_cpu(),
              "pool must be a contiguous fp32 CPU tensor [pages, layers, 2, page_size, kv_heads, head_dim]");
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
  Problem p{q.data_ptr<float>(), out.data_ptr<float>(), pool.data_ptr<float>() + layer * 2 * ps * KVH * D, tab, lens,
            qstart, qlen, item_seq.data(), item_first.data(), W, H, KVH, D, ps,
            /*page_stride=*/L * 2 * ps * KVH * D, /*v_offset=*/ps * KVH * D,
            q.stride(0), out.stride(0), static_cast<float>(scale)};
  std::vector<int64_t> order(item_seq.size());
  for (size_t w = 0; w < order.size(); ++w) order[w] = static_cast<int64_t>(w);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return lens[item_seq[a]] - qlen[item_seq[a]] + item_first[a] > lens[item_seq[b]] - qlen[item_seq[b]] + item_first[b];
  });
  switch (D) {
    case 16: run<Dim<16>>(p, order); break;
    case 32: run<Dim<32>>(p, order); break;
    case 64: run<Dim<64>>(p, order); break;
    case 80: run<Dim<80>>(p, order); break;
    case 96: run<Dim<96>>(p, order); break;
    case 128: run<Dim<128>>(p, order); break;
    default: run<Dim<0>>(p, order); break;
  }
}

}  // namespace

TORCH_LIBRARY(kvserve_paged, m) {
  m.def("paged_attention(Tensor(a!) out, Tensor q, Tensor pool, int layer, Tensor tables, Tensor context_lens, "
        "Tensor query_start, Tensor query_len, float scale) -> ()");
}

TORCH_LIBRARY_IMPL(kvserve_paged, CPU, m) { m.impl("paged_attention", &paged_attention); }
