// Every decoder layer of a w4a8 step whose rows all read the pool (decode; a chunk continuing its cached
// prefix), in one call from Python: at one row a layer's ~20 torch calls from Python cost more than its
// matmuls, and one call per layer still cost ~26 us a layer. The same ops in the same order as
// inference/model.py's loop (so the same numbers, bit for bit: tests/inference/test_native_layer.py): RMSNorm,
// qkv, RoPE + K/V write, paged attention, o + residual, RMSNorm, gate|up, SiLU * up, down + residual. Each op is
// the library's own, called through the dispatcher.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <vector>

namespace {

using Tensor = at::Tensor;

c10::OperatorHandle op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
}

// codes, scale, mins (empty for Q8_0 blocks in the file's layout): a CodedWeight's tensors (inference/precision.py);
// 3-D codes are an interleaved layout (x16 or x8)
Tensor coded(const Tensor& x, const Tensor& codes, const Tensor& scale, const Tensor& mins) {
  using Linear4 = Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&);
  static const auto interleaved = op("kvserve_paged::interleaved_linear").typed<Linear4>();
  static const auto w4 = op("kvserve_paged::w4a8_linear").typed<Linear4>();
  static const auto w8 = op("kvserve_paged::w8a8_linear").typed<Tensor(const Tensor&, const Tensor&, const Tensor&)>();
  if (codes.dim() == 3) return interleaved.call(x, codes, scale, mins);
  return mins.numel() ? w4.call(x, codes, scale, mins) : w8.call(x, codes, scale);
}

constexpr size_t kPerLayer = 14;

// x [T, hidden] fp32, updated in place to layer `layer`'s output. w: attn_norm, qkv (codes, scale, mins), o (3),
// mlp_norm, gate_up (3), down (3): the layer's 14 tensors (inference.model.Llama._native_layer_weights).
void one_layer(Tensor& x, const Tensor* w, const Tensor& cos, const Tensor& sin, Tensor& pool, int64_t layer,
               const Tensor& pages, const Tensor& offsets, const Tensor& tables, const Tensor& context_lens,
               const Tensor& query_start, const Tensor& query_len, double scale, int64_t heads, int64_t kv_heads,
               double eps) {
  static const auto rms = op("kvserve_paged::rms_norm").typed<Tensor(const Tensor&, const Tensor&, double, bool)>();
  static const auto silu_mul = op("kvserve_paged::silu_mul").typed<Tensor(const Tensor&)>();
  static const auto rope_store = op("kvserve_paged::rope_store").typed<Tensor(
      const Tensor&, const Tensor&, const Tensor&, Tensor, int64_t, const Tensor&, const Tensor&, int64_t, int64_t)>();
  static const auto attend = op("kvserve_paged::paged_attention").typed<void(
      const Tensor&, const Tensor&, const Tensor&, int64_t, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
      double)>();
  Tensor h = rms.call(x, w[0], eps, false);
  Tensor qkv = coded(h, w[1], w[2], w[3]);
  Tensor qk = rope_store.call(qkv, cos, sin, pool, layer, pages, offsets, heads, kv_heads);
  const int64_t T = x.size(0), D = qk.size(2);
  Tensor q = qk.narrow(1, 0, heads);
  Tensor attn = at::empty({T, heads, D}, x.options());
  attend.call(attn, q, pool, layer, tables, context_lens, query_start, query_len, scale);
  x.add_(coded(attn.view({T, heads * D}), w[4], w[5], w[6]));
  h = rms.call(x, w[7], eps, false);
  Tensor gate_up = coded(h, w[8], w[9], w[10]);
  x.add_(coded(silu_mul.call(gate_up), w[11], w[12], w[13]));  // silu_mul's output: contiguous
}

// x [T, hidden] fp32, updated in place to the last layer's output; w: every layer's 14 tensors in layer order.
void decode_layers(Tensor x, const std::vector<Tensor>& w, const Tensor& cos, const Tensor& sin, Tensor pool,
                   const Tensor& pages, const Tensor& offsets, const Tensor& tables, const Tensor& context_lens,
                   const Tensor& query_start, const Tensor& query_len, double scale, int64_t heads, int64_t kv_heads,
                   double eps) {
  TORCH_CHECK(!w.empty() && w.size() % kPerLayer == 0, "decode_layers: 14 weight tensors a layer, got ", w.size());
  const int64_t layers = static_cast<int64_t>(w.size() / kPerLayer);
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(), "decode_layers: x must be a "
              "contiguous fp32 [T, hidden]");
  TORCH_CHECK(pool.dim() == 6 && pool.size(1) == layers, "decode_layers: ", layers, " layers of weights for a pool "
              "of ", pool.dim() == 6 ? pool.size(1) : -1, " layers");
  for (int64_t layer = 0; layer < layers; ++layer)
    one_layer(x, w.data() + layer * kPerLayer, cos, sin, pool, layer, pages, offsets, tables, context_lens,
              query_start, query_len, scale, heads, kv_heads, eps);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvserve_paged, m) {
  m.def("decode_layers(Tensor(a!) x, Tensor[] w, Tensor cos, Tensor sin, Tensor(b!) pool, Tensor pages, "
        "Tensor offsets, Tensor tables, Tensor context_lens, Tensor query_start, Tensor query_len, float scale, "
        "int heads, int kv_heads, float eps) -> ()", &decode_layers);
}
