// RMSNorm fused into one pass (kvserve_paged::rms_norm): at one decode row torch runs it as ~8 ops (~20-30 us
// on these CPUs; this: ~5 us). fp32 math, written in fp32 or (for a bf16 matmul's input) straight in bf16,
// rounded to nearest even as Tensor.to(torch.bfloat16) does, which saves that cast. SiLU*up stays torch's:
// its vectorized exp beats a plain loop here (measured 9.7 vs 12.4 us at one row).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>

namespace {

template <typename Out>
void rms_rows(const float* x, const float* w, Out* out, int64_t rows, int64_t h, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t lo, int64_t hi) {
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

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvserve_paged, m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps, bool to_bf16) -> Tensor", &rms_norm);
}
