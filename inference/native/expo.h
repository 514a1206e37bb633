// e^x for x <= 0 (scores minus their max), as the softmax loops take it: x = n ln2 + r, |r| <= ln2 / 2, e^r by its
// Taylor series to degree 7 (relative error < 1e-7 before float rounding), 2^n by building the float. The scalar and
// AVX2 forms live in paged_attention.cpp; the AVX-512 one here serves it and prefill.cpp alike.
#pragma once

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

namespace kvs {

// e^r's Taylor coefficients, highest degree first (Horner), for every build's exp_nonpositive
constexpr float kExpTaylor[8] = {1.0f / 5040.0f, 1.0f / 720.0f, 1.0f / 120.0f, 1.0f / 24.0f,
                                 1.0f / 6.0f,    0.5f,          1.0f,          1.0f};

#if defined(__x86_64__) && defined(__GNUC__)
// 16 lanes; 2^n by scalef
__attribute__((target("avx512f"))) inline __m512 exp512_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f));
  const __m512 n =
      _mm512_roundscale_ps(_mm512_add_ps(t, _mm512_set1_ps(0.5f)), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.6931471805599453f));
  __m512 q = _mm512_set1_ps(kExpTaylor[0]);
  for (int i = 1; i < 8; ++i) q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(kExpTaylor[i]));
  return _mm512_scalef_ps(q, n);
}
#endif

}  // namespace kvs
