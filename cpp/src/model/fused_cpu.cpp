#include "model/fused_cpu.h"

#include <ATen/Parallel.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>

namespace cartridges::ops {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The loops below are plain C++ written so that the compiler vectorizes them (one accumulator
// per lane for the sums, a branch-free exp); each entry point is compiled for AVX-512, AVX2 and
// the baseline, the right one picked at load time.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define CARTRIDGES_VECTOR_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define CARTRIDGES_VECTOR_CLONES
#endif
#define CARTRIDGES_INLINE inline __attribute__((always_inline))

constexpr int kLanes = 16;

CARTRIDGES_INLINE float load(const float* p) { return *p; }
CARTRIDGES_INLINE float load(const uint16_t* p) {  // bfloat16: the high half of a float32
  const uint32_t bits = static_cast<uint32_t>(*p) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

CARTRIDGES_INLINE void store(float* p, float x) { *p = x; }
CARTRIDGES_INLINE void store(uint16_t* p, float x) {  // round to nearest even, as c10::BFloat16
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  *p = x != x ? uint16_t{0x7FC0} : static_cast<uint16_t>(rounded);
}

// x as stored in T and read back.
CARTRIDGES_INLINE float round_to(const float*, float x) { return x; }
CARTRIDGES_INLINE float round_to(const uint16_t*, float x) {
  uint16_t stored;
  store(&stored, x);
  return load(&stored);
}

// Cephes' expf without branches or calls, so that loops calling it vectorize: exact to about
// 2 ulp; below -87.3 it gives exp(-87.3) (about 1e-38), above 88.7 inf. n = round(x / ln 2) by adding and taking away 1.5 *
// 2^23 (the default rounding mode rounds to the nearest integer there).
CARTRIDGES_INLINE float fast_exp(float x) {
  x = x < -87.3f ? -87.3f : x;
  x = x > 88.7f ? 88.7f : x;
  const float n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t biased = static_cast<int32_t>(n) + 127;  // 1..255: 2^n as a float's bits
  const uint32_t scale_bits = static_cast<uint32_t>(biased) << 23;
  float scale;
  std::memcpy(&scale, &scale_bits, sizeof scale);
  return p * scale;
}

// sum_j a[j] * b[j] over n elements, in float32 with one partial sum per lane.
template <typename A, typename B>
CARTRIDGES_INLINE float dot(const A* a, const B* b, int64_t n) {
  float lanes[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    for (int l = 0; l < kLanes; ++l) lanes[l] += load(a + j + l) * load(b + j + l);
  }
  float sum = 0.f;
  for (int l = 0; l < kLanes; ++l) sum += lanes[l];
  for (; j < n; ++j) sum += load(a + j) * load(b + j);
  return sum;
}

template <typename T>
CARTRIDGES_INLINE void rms_norm_rows(const T* x, const T* weight, T* out, float* scales, int64_t n, int64_t begin,
                                     int64_t end, float eps) {
  for (int64_t r = begin; r < end; ++r) {
    const T* xr = x + r * n;
    T* outr = out + r * n;
    const float scale = 1.f / __builtin_sqrtf(dot(xr, xr, n) / static_cast<float>(n) + eps);
    scales[r] = scale;
    for (int64_t j = 0; j < n; ++j) store(outr + j, load(weight + j) * round_to(xr, load(xr + j) * scale));
  }
}

// dx = scale * g - x * scale^3 * mean(g * x) with g = grad * weight: the gradient of
// x * scale(x), through the rounding of the forward as if it were not there.
template <typename T>
CARTRIDGES_INLINE void rms_norm_backward_rows(const T* grad, const T* x, const T* weight, const float* scales,
                                              T* grad_x, float* g, int64_t n, int64_t begin, int64_t end) {
  for (int64_t r = begin; r < end; ++r) {
    const T* xr = x + r * n;
    const T* gr = grad + r * n;
    T* dxr = grad_x + r * n;
    for (int64_t j = 0; j < n; ++j) g[j] = load(gr + j) * load(weight + j);
    const float gx = dot(g, xr, n);
    const float scale = scales[r];
    const float correction = scale * scale * scale * gx / static_cast<float>(n);
    for (int64_t k = 0; k < n; ++k) store(dxr + k, scale * g[k] - load(xr + k) * correction);
  }
}

template <typename T>
CARTRIDGES_INLINE void swiglu_rows(const T* gate_up, T* out, int64_t width, int64_t begin, int64_t end) {
  for (int64_t r = begin; r < end; ++r) {
    const T* gate = gate_up + r * 2 * width;
    const T* up = gate + width;
    T* o = out + r * width;
    for (int64_t j = 0; j < width; ++j) {
      const float g = load(gate + j);
      store(o + j, g / (1.f + fast_exp(-g)) * load(up + j));
    }
  }
}

// d gate = grad * up * s * (1 + gate * (1 - s)), d up = grad * gate * s, with s = sigmoid(gate).
template <typename T>
CARTRIDGES_INLINE void swiglu_backward_rows(const T* grad, const T* gate_up, T* grad_gate_up, int64_t width,
                                            int64_t begin, int64_t end) {
  for (int64_t r = begin; r < end; ++r) {
    const T* gate = gate_up + r * 2 * width;
    const T* up = gate + width;
    const T* dy = grad + r * width;
    T* dgate = grad_gate_up + r * 2 * width;
    T* dup = dgate + width;
    for (int64_t j = 0; j < width; ++j) {
      const float g = load(gate + j), u = load(up + j), d = load(dy + j);
      const float s = 1.f / (1.f + fast_exp(-g));
      store(dgate + j, d * u * s * (1.f + g * (1.f - s)));
      store(dup + j, d * g * s);
    }
  }
}

// Per row: m = max z, lse = m + log sum exp(z - m), in float32.
template <typename T>
CARTRIDGES_INLINE void logsumexp_rows(const T* z, float* lse, int64_t n, int64_t begin, int64_t end) {
  for (int64_t r = begin; r < end; ++r) {
    const T* zr = z + r * n;
    float lanes[kLanes];
    for (int l = 0; l < kLanes; ++l) lanes[l] = -std::numeric_limits<float>::infinity();
    int64_t j = 0;
    for (; j + kLanes <= n; j += kLanes) {
      for (int l = 0; l < kLanes; ++l) {
        const float v = load(zr + j + l);
        lanes[l] = v > lanes[l] ? v : lanes[l];
      }
    }
    float m = -std::numeric_limits<float>::infinity();
    for (int l = 0; l < kLanes; ++l) m = lanes[l] > m ? lanes[l] : m;
    for (; j < n; ++j) m = load(zr + j) > m ? load(zr + j) : m;
    for (int l = 0; l < kLanes; ++l) lanes[l] = 0.f;
    for (j = 0; j + kLanes <= n; j += kLanes) {
      for (int l = 0; l < kLanes; ++l) lanes[l] += fast_exp(load(zr + j + l) - m);
    }
    float sum = 0.f;
    for (int l = 0; l < kLanes; ++l) sum += lanes[l];
    for (; j < n; ++j) sum += fast_exp(load(zr + j) - m);
    lse[r] = m + std::log(sum);
  }
}

// Per row: dz = mass * exp(z - lse), less coef[k] at ids[k] (summed where an id repeats).
template <typename T>
CARTRIDGES_INLINE void softmax_grad_rows(const T* z, const float* lse, const float* mass, const int64_t* ids,
                                         const float* coef, T* dz, int64_t n, int64_t k, int64_t begin,
                                         int64_t end) {
  for (int64_t r = begin; r < end; ++r) {
    const T* zr = z + r * n;
    T* dr = dz + r * n;
    const float shift = lse[r], scale = mass[r];
    for (int64_t j = 0; j < n; ++j) store(dr + j, scale * fast_exp(load(zr + j) - shift));
    const int64_t* idr = ids + r * k;
    const float* cr = coef + r * k;
    for (int64_t a = 0; a < k; ++a) {
      float value = scale * fast_exp(load(zr + idr[a]) - shift);
      for (int64_t b = 0; b < k; ++b) value -= idr[b] == idr[a] ? cr[b] : 0.f;
      store(dr + idr[a], value);
    }
  }
}

// One token's heads of qkv [heads + 2 kv_heads, D] to q [B, H, S, D], k and v [B, H_kv, S, D]
// (rows `stride` apart in each), q and k rotated by RoPE: y1 = x1 c - x2 s, y2 = x2 c + x1 s over
// the halves of each head. `inverse` runs the backward: the transposed rotation, from the heads
// back to qkv's layout.
template <typename T>
CARTRIDGES_INLINE void rope_token(T* qkv, T* q, T* k, T* v, const T* cos, const T* sin, int64_t heads,
                                  int64_t kv_heads, int64_t dim, int64_t stride, bool inverse) {
  const int64_t half = dim / 2;
  for (int64_t h = 0; h < heads + 2 * kv_heads; ++h) {
    T* token = qkv + h * dim;
    T* head = h < heads ? q + h * stride : (h < heads + kv_heads ? k + (h - heads) * stride
                                                                  : v + (h - heads - kv_heads) * stride);
    if (h >= heads + kv_heads) {
      if (inverse) {
        for (int64_t j = 0; j < dim; ++j) store(token + j, load(head + j));
      } else {
        for (int64_t j = 0; j < dim; ++j) store(head + j, load(token + j));
      }
      continue;
    }
    if (inverse) {  // dx1 = g1 c + g2 s, dx2 = g2 c - g1 s
      for (int64_t j = 0; j < half; ++j) {
        const float g1 = load(head + j), g2 = load(head + half + j);
        store(token + j, g1 * load(cos + j) + g2 * load(sin + j));
        store(token + half + j, g2 * load(cos + half + j) - g1 * load(sin + half + j));
      }
    } else {
      for (int64_t j = 0; j < half; ++j) {
        const float x1 = load(token + j), x2 = load(token + half + j);
        store(head + j, x1 * load(cos + j) - x2 * load(sin + j));
        store(head + half + j, x2 * load(cos + half + j) + x1 * load(sin + half + j));
      }
    }
  }
}

// Per row r of n elements: out = a * wa[r] + b * wb[r] (the merge of two partial attentions by
// their shares), or, with b null, out = a * wa[r] and out2 = a * wb[r] (its backward).
template <typename T>
CARTRIDGES_INLINE void weighted_rows(const T* a, const float* wa, const T* b, const float* wb, T* out, T* out2,
                                     int64_t n, int64_t begin, int64_t end) {
  for (int64_t r = begin; r < end; ++r) {
    const T* ar = a + r * n;
    T* o = out + r * n;
    const float x = wa[r], y = wb[r];
    if (b != nullptr) {
      const T* br = b + r * n;
      for (int64_t j = 0; j < n; ++j) store(o + j, load(ar + j) * x + load(br + j) * y);
    } else {
      T* o2 = out2 + r * n;
      for (int64_t j = 0; j < n; ++j) {
        const float v = load(ar + j);
        store(o + j, v * x);
        store(o2 + j, v * y);
      }
    }
  }
}

CARTRIDGES_VECTOR_CLONES void rms_norm_float(const float* x, const float* w, float* out, float* scales, int64_t n,
                                             int64_t begin, int64_t end, float eps) {
  rms_norm_rows(x, w, out, scales, n, begin, end, eps);
}
CARTRIDGES_VECTOR_CLONES void rms_norm_bf16(const uint16_t* x, const uint16_t* w, uint16_t* out, float* scales,
                                            int64_t n, int64_t begin, int64_t end, float eps) {
  rms_norm_rows(x, w, out, scales, n, begin, end, eps);
}
CARTRIDGES_VECTOR_CLONES void rms_norm_backward_float(const float* grad, const float* x, const float* w,
                                                      const float* scales, float* dx, float* g, int64_t n,
                                                      int64_t begin, int64_t end) {
  rms_norm_backward_rows(grad, x, w, scales, dx, g, n, begin, end);
}
CARTRIDGES_VECTOR_CLONES void rms_norm_backward_bf16(const uint16_t* grad, const uint16_t* x, const uint16_t* w,
                                                     const float* scales, uint16_t* dx, float* g, int64_t n,
                                                     int64_t begin, int64_t end) {
  rms_norm_backward_rows(grad, x, w, scales, dx, g, n, begin, end);
}
CARTRIDGES_VECTOR_CLONES void swiglu_float(const float* gate_up, float* out, int64_t width, int64_t begin,
                                           int64_t end) {
  swiglu_rows(gate_up, out, width, begin, end);
}
CARTRIDGES_VECTOR_CLONES void swiglu_bf16(const uint16_t* gate_up, uint16_t* out, int64_t width, int64_t begin,
                                          int64_t end) {
  swiglu_rows(gate_up, out, width, begin, end);
}
CARTRIDGES_VECTOR_CLONES void swiglu_backward_float(const float* grad, const float* gate_up, float* dgu,
                                                    int64_t width, int64_t begin, int64_t end) {
  swiglu_backward_rows(grad, gate_up, dgu, width, begin, end);
}
CARTRIDGES_VECTOR_CLONES void swiglu_backward_bf16(const uint16_t* grad, const uint16_t* gate_up, uint16_t* dgu,
                                                   int64_t width, int64_t begin, int64_t end) {
  swiglu_backward_rows(grad, gate_up, dgu, width, begin, end);
}

CARTRIDGES_VECTOR_CLONES void logsumexp_float(const float* z, float* lse, int64_t n, int64_t begin, int64_t end) {
  logsumexp_rows(z, lse, n, begin, end);
}
CARTRIDGES_VECTOR_CLONES void logsumexp_bf16(const uint16_t* z, float* lse, int64_t n, int64_t begin, int64_t end) {
  logsumexp_rows(z, lse, n, begin, end);
}
CARTRIDGES_VECTOR_CLONES void softmax_grad_float(const float* z, const float* lse, const float* mass,
                                                 const int64_t* ids, const float* coef, float* dz, int64_t n,
                                                 int64_t k, int64_t begin, int64_t end) {
  softmax_grad_rows(z, lse, mass, ids, coef, dz, n, k, begin, end);
}
CARTRIDGES_VECTOR_CLONES void softmax_grad_bf16(const uint16_t* z, const float* lse, const float* mass,
                                                const int64_t* ids, const float* coef, uint16_t* dz, int64_t n,
                                                int64_t k, int64_t begin, int64_t end) {
  softmax_grad_rows(z, lse, mass, ids, coef, dz, n, k, begin, end);
}

// Tokens [begin, end) of B * S, token i = b * S + s; cos and sin rows for token i at
// (cos_batch > 1 ? b : 0) * S + s.
template <typename T>
CARTRIDGES_INLINE void rope_tokens(T* qkv, T* q, T* k, T* v, const T* cos, const T* sin, int64_t steps,
                                   int64_t cos_batch, int64_t heads, int64_t kv_heads, int64_t dim, bool inverse,
                                   int64_t begin, int64_t end) {
  const int64_t width = (heads + 2 * kv_heads) * dim;
  for (int64_t i = begin; i < end; ++i) {
    const int64_t b = i / steps, s = i % steps;
    const int64_t angle_row = ((cos_batch > 1 ? b : 0) * steps + s) * dim;
    rope_token(qkv + i * width, q + (b * heads * steps + s) * dim, k + (b * kv_heads * steps + s) * dim,
               v + (b * kv_heads * steps + s) * dim, cos + angle_row, sin + angle_row, heads, kv_heads, dim,
               steps * dim, inverse);
  }
}

CARTRIDGES_VECTOR_CLONES void rope_tokens_float(float* qkv, float* q, float* k, float* v, const float* cos,
                                                const float* sin, int64_t steps, int64_t cos_batch, int64_t heads,
                                                int64_t kv_heads, int64_t dim, bool inverse, int64_t begin,
                                                int64_t end) {
  rope_tokens(qkv, q, k, v, cos, sin, steps, cos_batch, heads, kv_heads, dim, inverse, begin, end);
}
CARTRIDGES_VECTOR_CLONES void rope_tokens_bf16(uint16_t* qkv, uint16_t* q, uint16_t* k, uint16_t* v,
                                               const uint16_t* cos, const uint16_t* sin, int64_t steps,
                                               int64_t cos_batch, int64_t heads, int64_t kv_heads, int64_t dim,
                                               bool inverse, int64_t begin, int64_t end) {
  rope_tokens(qkv, q, k, v, cos, sin, steps, cos_batch, heads, kv_heads, dim, inverse, begin, end);
}

CARTRIDGES_VECTOR_CLONES void weighted_rows_float(const float* a, const float* wa, const float* b, const float* wb,
                                                  float* out, float* out2, int64_t n, int64_t begin, int64_t end) {
  weighted_rows(a, wa, b, wb, out, out2, n, begin, end);
}
CARTRIDGES_VECTOR_CLONES void weighted_rows_bf16(const uint16_t* a, const float* wa, const uint16_t* b,
                                                 const float* wb, uint16_t* out, uint16_t* out2, int64_t n,
                                                 int64_t begin, int64_t end) {
  weighted_rows(a, wa, b, wb, out, out2, n, begin, end);
}

template <typename T>
T* pointer(const at::Tensor& t) {
  return static_cast<T*>(t.data_ptr());
}

// Rows per task: enough work (about 32K elements) to be worth a thread.
int64_t grain(int64_t row_elements) { return std::max<int64_t>(1, (1 << 15) / std::max<int64_t>(1, row_elements)); }

// x and weight contiguous, weight in x's dtype; returns (out, scales [rows]).
std::pair<at::Tensor, at::Tensor> rms_norm_forward(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const int64_t n = x.size(-1), rows = x.numel() / n;
  auto out = at::empty_like(x);
  auto scales = at::empty({rows}, x.options().dtype(at::kFloat));
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const float epsilon = static_cast<float>(eps);
  at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
    if (bf16) {
      rms_norm_bf16(pointer<uint16_t>(x), pointer<uint16_t>(weight), pointer<uint16_t>(out), pointer<float>(scales), n,
                    begin, end, epsilon);
    } else {
      rms_norm_float(pointer<float>(x), pointer<float>(weight), pointer<float>(out), pointer<float>(scales), n, begin,
                     end, epsilon);
    }
  });
  return {out, scales};
}

struct RmsNormFunction : public torch::autograd::Function<RmsNormFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight, double eps) {
    auto [out, scales] = rms_norm_forward(x, weight, eps);
    ctx->save_for_backward({x, weight, scales});
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &x = saved[0], &weight = saved[1], &scales = saved[2];
    const auto grad = grads[0].to(x.scalar_type()).contiguous();
    const int64_t n = x.size(-1), rows = x.numel() / n;
    auto dx = at::empty_like(x);
    const bool bf16 = x.scalar_type() == at::kBFloat16;
    at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
      std::vector<float> g(n);  // grad * weight of one row
      if (bf16) {
        rms_norm_backward_bf16(pointer<uint16_t>(grad), pointer<uint16_t>(x), pointer<uint16_t>(weight),
                               pointer<float>(scales), pointer<uint16_t>(dx), g.data(), n, begin, end);
      } else {
        rms_norm_backward_float(pointer<float>(grad), pointer<float>(x), pointer<float>(weight),
                                pointer<float>(scales), pointer<float>(dx), g.data(), n, begin, end);
      }
    });
    return {dx, at::Tensor(), at::Tensor()};
  }
};

at::Tensor swiglu_forward(const at::Tensor& gate_up) {
  const int64_t width = gate_up.size(-1) / 2, rows = gate_up.numel() / gate_up.size(-1);
  auto sizes = gate_up.sizes().vec();
  sizes.back() = width;
  auto out = at::empty(sizes, gate_up.options());
  const bool bf16 = gate_up.scalar_type() == at::kBFloat16;
  at::parallel_for(0, rows, grain(2 * width), [&](int64_t begin, int64_t end) {
    if (bf16) {
      swiglu_bf16(pointer<uint16_t>(gate_up), pointer<uint16_t>(out), width, begin, end);
    } else {
      swiglu_float(pointer<float>(gate_up), pointer<float>(out), width, begin, end);
    }
  });
  return out;
}

struct SwigluFunction : public torch::autograd::Function<SwigluFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& gate_up) {
    ctx->save_for_backward({gate_up});
    return swiglu_forward(gate_up);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto gate_up = ctx->get_saved_variables()[0];
    const auto grad = grads[0].to(gate_up.scalar_type()).contiguous();
    const int64_t width = gate_up.size(-1) / 2, rows = gate_up.numel() / gate_up.size(-1);
    auto dgu = at::empty_like(gate_up);
    const bool bf16 = gate_up.scalar_type() == at::kBFloat16;
    at::parallel_for(0, rows, grain(2 * width), [&](int64_t begin, int64_t end) {
      if (bf16) {
        swiglu_backward_bf16(pointer<uint16_t>(grad), pointer<uint16_t>(gate_up), pointer<uint16_t>(dgu), width,
                             begin, end);
      } else {
        swiglu_backward_float(pointer<float>(grad), pointer<float>(gate_up), pointer<float>(dgu), width, begin, end);
      }
    });
    return {dgu};
  }
};

// Runs the RoPE kernel between qkv [B, S, (H + 2 H_kv) D] and q, k, v in heads-first layout,
// forward (qkv to the heads) or inverse (the heads' gradients to qkv's).
void run_rope(const at::Tensor& qkv, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
              const at::Tensor& cos, const at::Tensor& sin, bool inverse) {
  const int64_t B = qkv.size(0), S = qkv.size(1), heads = q.size(1), kv_heads = k.size(1), dim = q.size(3);
  const bool bf16 = qkv.scalar_type() == at::kBFloat16;
  at::parallel_for(0, B * S, grain(qkv.size(2)), [&](int64_t begin, int64_t end) {
    if (bf16) {
      rope_tokens_bf16(pointer<uint16_t>(qkv), pointer<uint16_t>(q), pointer<uint16_t>(k), pointer<uint16_t>(v),
                       pointer<uint16_t>(cos), pointer<uint16_t>(sin), S, cos.size(0), heads, kv_heads, dim,
                       inverse, begin, end);
    } else {
      rope_tokens_float(pointer<float>(qkv), pointer<float>(q), pointer<float>(k), pointer<float>(v),
                        pointer<float>(cos), pointer<float>(sin), S, cos.size(0), heads, kv_heads, dim, inverse,
                        begin, end);
    }
  });
}

struct RopeSplitHeads : public torch::autograd::Function<RopeSplitHeads> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& qkv, const at::Tensor& cos,
                               const at::Tensor& sin, int64_t heads, int64_t kv_heads) {
    const int64_t B = qkv.size(0), S = qkv.size(1), dim = qkv.size(2) / (heads + 2 * kv_heads);
    auto q = at::empty({B, heads, S, dim}, qkv.options());
    auto k = at::empty({B, kv_heads, S, dim}, qkv.options());
    auto v = at::empty({B, kv_heads, S, dim}, qkv.options());
    run_rope(qkv, q, k, v, cos, sin, /*inverse=*/false);
    ctx->save_for_backward({cos, sin});
    ctx->saved_data["sizes"] = std::vector<int64_t>{B, S, heads, kv_heads, dim};
    return {q, k, v};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &cos = saved[0], &sin = saved[1];
    const auto sizes = ctx->saved_data["sizes"].toIntVector();
    const int64_t B = sizes[0], S = sizes[1], heads = sizes[2], kv_heads = sizes[3], dim = sizes[4];
    // A gradient autograd leaves undefined (an output nothing used) is zero.
    auto grad = [&](size_t i, int64_t h) {
      return grads[i].defined() ? grads[i].to(cos.scalar_type()).contiguous()
                                : at::zeros({B, h, S, dim}, cos.options());
    };
    auto dqkv = at::empty({B, S, (heads + 2 * kv_heads) * dim}, cos.options());
    run_rope(dqkv, grad(0, heads), grad(1, kv_heads), grad(2, kv_heads), cos, sin, /*inverse=*/true);
    return {dqkv, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

bool fused_cpu_supported(const at::Tensor& x) {
  return x.device().is_cpu() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
         x.dim() > 0 && x.numel() > 0;
}

at::Tensor rms_norm_fused_cpu(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(fused_cpu_supported(x) && weight.numel() == x.size(-1),
              "rms_norm_fused_cpu: x on the CPU in float32 or bfloat16, weight of x's last size");
  const auto xc = x.contiguous();
  const auto w = weight.detach().to(x.scalar_type()).contiguous();
  if (at::GradMode::is_enabled() && x.requires_grad()) return RmsNormFunction::apply(xc, w, eps);
  return rms_norm_forward(xc, w, eps).first;
}

at::Tensor swiglu_fused_cpu(const at::Tensor& gate_up) {
  TORCH_CHECK(fused_cpu_supported(gate_up) && gate_up.size(-1) % 2 == 0,
              "swiglu_fused_cpu: gate_up on the CPU in float32 or bfloat16, of even last size");
  const auto x = gate_up.contiguous();
  if (at::GradMode::is_enabled() && gate_up.requires_grad()) return SwigluFunction::apply(x);
  return swiglu_forward(x);
}

at::Tensor logsumexp_rows_cpu(const at::Tensor& logits_in) {
  TORCH_CHECK(fused_cpu_supported(logits_in) && logits_in.dim() == 2,
              "logsumexp_rows_cpu: logits [T, V] on the CPU in float32 or bfloat16");
  const auto logits = logits_in.contiguous();
  const int64_t rows = logits.size(0), n = logits.size(1);
  auto lse = at::empty({rows}, logits.options().dtype(at::kFloat));
  const bool bf16 = logits.scalar_type() == at::kBFloat16;
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    if (bf16) {
      logsumexp_bf16(pointer<uint16_t>(logits), pointer<float>(lse), n, begin, end);
    } else {
      logsumexp_float(pointer<float>(logits), pointer<float>(lse), n, begin, end);
    }
  });
  return lse;
}

at::Tensor softmax_grad_cpu(const at::Tensor& logits_in, const at::Tensor& lse, const at::Tensor& mass,
                            const at::Tensor& ids_in, const at::Tensor& coef_in) {
  TORCH_CHECK(fused_cpu_supported(logits_in) && logits_in.dim() == 2 && ids_in.dim() == 2 &&
                  ids_in.sizes() == coef_in.sizes() && ids_in.size(0) == logits_in.size(0),
              "softmax_grad_cpu: logits [T, V] on the CPU in float32 or bfloat16, ids and coef [T, K]");
  const auto logits = logits_in.contiguous();
  const auto ids = ids_in.to(at::kLong).contiguous();
  const auto coef = coef_in.to(at::kFloat).contiguous();
  const auto lse_f = lse.to(at::kFloat).contiguous(), mass_f = mass.to(at::kFloat).contiguous();
  TORCH_CHECK(ids.numel() == 0 || (ids.min().item<int64_t>() >= 0 && ids.max().item<int64_t>() < logits.size(1)),
              "softmax_grad_cpu: ids outside the vocabulary");
  const int64_t rows = logits.size(0), n = logits.size(1), k = ids.size(1);
  auto dz = at::empty_like(logits);
  const bool bf16 = logits.scalar_type() == at::kBFloat16;
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    if (bf16) {
      softmax_grad_bf16(pointer<uint16_t>(logits), pointer<float>(lse_f), pointer<float>(mass_f),
                        pointer<int64_t>(ids), pointer<float>(coef), pointer<uint16_t>(dz), n, k, begin, end);
    } else {
      softmax_grad_float(pointer<float>(logits), pointer<float>(lse_f), pointer<float>(mass_f),
                         pointer<int64_t>(ids), pointer<float>(coef), pointer<float>(dz), n, k, begin, end);
    }
  });
  return dz;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> rope_split_heads_cpu(const at::Tensor& qkv, const at::Tensor& cos,
                                                                     const at::Tensor& sin, int64_t heads,
                                                                     int64_t kv_heads) {
  TORCH_CHECK(fused_cpu_supported(qkv) && qkv.dim() == 3 && heads > 0 && kv_heads > 0 &&
                  qkv.size(2) % (heads + 2 * kv_heads) == 0,
              "rope_split_heads_cpu: qkv [B, S, (heads + 2 kv_heads) D] on the CPU in float32 or bfloat16");
  const int64_t B = qkv.size(0), S = qkv.size(1), dim = qkv.size(2) / (heads + 2 * kv_heads);
  TORCH_CHECK(dim % 2 == 0 && cos.dim() == 4 && (cos.size(0) == 1 || cos.size(0) == B) && cos.size(1) == 1 &&
                  cos.size(2) == S && cos.size(3) == dim && sin.sizes() == cos.sizes(),
              "rope_split_heads_cpu: cos and sin [B or 1, 1, S, D] for an even D");
  const auto dtype = qkv.scalar_type();
  const auto c = cos.to(dtype).contiguous(), s = sin.to(dtype).contiguous();
  const auto x = qkv.contiguous();
  if (at::GradMode::is_enabled() && qkv.requires_grad()) {
    auto out = RopeSplitHeads::apply(x, c, s, heads, kv_heads);
    return {out[0], out[1], out[2]};
  }
  auto q = at::empty({B, heads, S, dim}, x.options());
  auto k = at::empty({B, kv_heads, S, dim}, x.options());
  auto v = at::empty({B, kv_heads, S, dim}, x.options());
  run_rope(x, q, k, v, c, s, /*inverse=*/false);
  return {q, k, v};
}

namespace {

// a (and b) [..., n] in one dtype, wa and wb float32 of a's leading shape.
void run_weighted_rows(const at::Tensor& a, const at::Tensor& wa, const at::Tensor& b, const at::Tensor& wb,
                       const at::Tensor& out, const at::Tensor& out2) {
  const int64_t n = a.size(-1), rows = a.numel() / n;
  TORCH_CHECK(fused_cpu_supported(a) && wa.numel() == rows && wb.numel() == rows && wa.scalar_type() == at::kFloat &&
                  wb.scalar_type() == at::kFloat && wa.is_contiguous() && wb.is_contiguous(),
              "weighted rows: a [..., n] on the CPU in float32 or bfloat16, one float32 weight per row");
  const bool bf16 = a.scalar_type() == at::kBFloat16;
  at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
    if (bf16) {
      weighted_rows_bf16(pointer<uint16_t>(a), pointer<float>(wa), b.defined() ? pointer<uint16_t>(b) : nullptr,
                         pointer<float>(wb), pointer<uint16_t>(out), out2.defined() ? pointer<uint16_t>(out2) : nullptr,
                         n, begin, end);
    } else {
      weighted_rows_float(pointer<float>(a), pointer<float>(wa), b.defined() ? pointer<float>(b) : nullptr,
                          pointer<float>(wb), pointer<float>(out), out2.defined() ? pointer<float>(out2) : nullptr, n,
                          begin, end);
    }
  });
}

}  // namespace

at::Tensor weighted_row_sum_cpu(const at::Tensor& a, const at::Tensor& wa, const at::Tensor& b,
                                const at::Tensor& wb) {
  TORCH_CHECK(a.sizes() == b.sizes() && a.scalar_type() == b.scalar_type(),
              "weighted_row_sum_cpu: a and b of one shape and dtype");
  const auto ac = a.contiguous(), bc = b.contiguous();
  auto out = at::empty_like(ac);
  run_weighted_rows(ac, wa.contiguous(), bc, wb.contiguous(), out, at::Tensor());
  return out;
}

std::pair<at::Tensor, at::Tensor> scaled_rows_cpu(const at::Tensor& x, const at::Tensor& wa, const at::Tensor& wb) {
  const auto xc = x.contiguous();
  auto out = at::empty_like(xc), out2 = at::empty_like(xc);
  run_weighted_rows(xc, wa.contiguous(), at::Tensor(), wb.contiguous(), out, out2);
  return {out, out2};
}

}  // namespace cartridges::ops
