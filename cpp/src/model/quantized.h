#pragma once
// Matrix products against weights kept in GGUF block-quantized form (Q4_0, Q4_1, Q8_0).
//
// Decoding a few tokens at a time on a CPU is bound by reading the weights; reading them
// quantized moves 4-6x fewer bytes than float32. Each block dequantizes to exactly the
// float32 values the loader produces (d*q is exact in float32), so only the order of the
// accumulation differs from at::linear on the dequantized weights.

#include <ATen/ATen.h>

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
  int64_t out_features() const { return data.size(0); }
};

// Input rows one pass of the kernel keeps in registers; more rows are taken in groups of
// this many, each group re-reading a small tile of weights from cache, not from memory.
constexpr int64_t kQuantizedRowGroup = 8;
// Largest number of input rows the quantized kernel handles (decoding up to this many
// requests at once); larger inputs (prefill) are faster as one float32 GEMM. Measured on
// SmolLM2-135M Q4_1, 2 cores: a whole forward takes 35 ms at 1 row, 97 ms at 16, 138 ms at
// 24 and 180 ms at 32 on blocks, against ~130 ms for any count up to 48 rows in float32:
// the kernel's cost grows with the rows (it is compute-bound past ~8), hence the limit.
constexpr int64_t kMaxQuantizedRows = 20;

// y [..., out] = x [..., in] @ W^T for float32 CPU x with at most kMaxQuantizedRows rows.
at::Tensor quantized_linear(const at::Tensor& x, const QuantizedMatrix& w);

// The float32 matrix W [out, in] (the reference the kernel is tested against).
at::Tensor dequantize(const QuantizedMatrix& w);

}  // namespace cartridges
