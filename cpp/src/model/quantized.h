#pragma once
// Matrix products against weights kept in GGUF block-quantized form (Q4_0, Q4_1, Q8_0).
//
// Decoding a few tokens at a time on a CPU is bound by reading the weights; reading them
// quantized moves 4-6x fewer bytes than float32. Two arithmetics:
// - float32 activations: each block dequantizes to exactly the float32 values the loader
//   produces (d*q is exact in float32), so only the order of the accumulation differs from
//   at::linear on the dequantized weights (transformers' results on the same file);
// - int8 activations (llama.cpp's arithmetic): each block of 32 activations is rounded to
//   8 bits with its own scale, and blocks multiply with integer dot products. Several times
//   cheaper per weight, so batch-1 decode is bound by memory again and batches of 16-32 rows
//   stay on the blocks; the cost is the activations' rounding (~0.4% of each block's largest
//   value), which can flip near-ties between the top two tokens.

#include <ATen/ATen.h>

#include <limits>
#include <string>

namespace cartridges {

enum class BlockFormat { kQ4_0, kQ4_1, kQ8_0 };

// Parses "Q4_0", "Q4_1", "Q8_0"; anything else raises.
BlockFormat parse_block_format(const std::string& name);
// Bytes of one block of 32 weights.
int64_t block_bytes(BlockFormat format);

struct QuantizedMatrix {
  BlockFormat format;
  at::Tensor data;  // uint8 [out_features, in_features / 32 * block_bytes], CPU, contiguous
  int64_t in_features;
  // The same weights laid out for the int8 kernels (quantized_int8.cpp; about as many bytes
  // as `data`): uint8 [groups of 16 features, blocks, 256 (4-bit) or 512 (Q8_0)] and float16
  // [groups, blocks, 2, 16] (each feature's d, then its offset weight). Filled by
  // quantized_matrix(); int8 activations need them.
  at::Tensor int8_weights;
  at::Tensor int8_scales;
  int64_t out_features() const { return data.size(0); }
};

enum class ActivationPrecision { kFloat32, kInt8 };

// Input rows one pass of the float32-activation kernel keeps in registers; more rows are taken
// in groups of this many, each group re-reading a small tile of weights from cache, not from
// memory.
constexpr int64_t kQuantizedRowGroup = 8;
// Largest number of input rows the quantized kernel handles (decoding up to this many
// requests at once); larger inputs (prefill) are faster as one float32 GEMM: the kernel's cost
// grows with the rows (it is compute-bound past ~8), hence the limit. Chosen when the kernel
// ran on one thread (before OpenMP was in our build); with two threads a SmolLM2-135M forward
// takes 11 ms at 1 row and 45 ms at 16 on blocks. Not re-tuned since: float32 activations
// are no longer the default.
constexpr int64_t kMaxQuantizedRows = 20;
// With int8 activations there is no limit: their integer dot products cost about what the
// float32 GEMM costs per row (measured: 2.4 vs 2.9 ms per row of a SmolLM2-135M forward at 64
// rows, 2.6 vs 2.3 at 256), and every row then gets the same arithmetic whatever it is
// batched with, so a request's tokens do not depend on its neighbours in a step.
inline int64_t max_quantized_rows(ActivationPrecision precision) {
  return precision == ActivationPrecision::kInt8 ? std::numeric_limits<int64_t>::max() : kMaxQuantizedRows;
}

// A QuantizedMatrix of GGUF blocks `data` with its int8 layout.
QuantizedMatrix quantized_matrix(BlockFormat format, at::Tensor data, int64_t in_features);

// y [..., out] = x [..., in] @ W^T for float32 CPU x with at most max_quantized_rows rows.
at::Tensor quantized_linear(const at::Tensor& x, const QuantizedMatrix& w,
                            ActivationPrecision precision = ActivationPrecision::kFloat32);

// x rounded as the int8 path rounds it, back in float32 (the reference it is tested against):
// per block of 32, d = max|x| / 127 and x ~ d * round(x * 127 / max|x|).
at::Tensor round_activations_int8(const at::Tensor& x);

// Whether the int8 kernels may use AVX-512 VNNI where the CPU has it (the default); returns
// the previous setting. For tests of the AVX2 path, which must give the same bits.
bool allow_vnni_for_testing(bool allowed);
// Whether the int8 kernels may use SIMD at all (the default); returns the previous setting. For
// tests of the scalar path (CPUs without AVX2), which must give the same bits.
bool allow_simd_for_testing(bool allowed);

// The float32 matrix W [out, in] (the reference the kernel is tested against).
at::Tensor dequantize(const QuantizedMatrix& w);

}  // namespace cartridges
