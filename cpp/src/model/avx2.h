#pragma once
// Small AVX2 helpers shared by the CPU kernels. Each is compiled for AVX2 and FMA only, so it
// inlines into any kernel compiled for those and more (F16C, AVX-512 VNNI).

#include <immintrin.h>

namespace cartridges {

// The sum of a vector's 8 floats.
__attribute__((target("avx2,fma"))) inline float horizontal_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

}  // namespace cartridges
