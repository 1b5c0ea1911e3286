#pragma once
// Random block-quantized matrices for the kernel's tests and its benchmark
// (benchmarks/cpp/bench_int8_kernel.cc).

#include <ATen/ATen.h>

#include "model/quantized.h"

namespace cartridges {

// Random blocks with sensible scales: d, m as float16 in [-0.1, 0.1], random payload bytes.
inline QuantizedMatrix random_quantized_matrix(BlockFormat format, int64_t out, int64_t in) {
  const int64_t bb = block_bytes(format), blocks = in / 32;
  auto data = at::randint(0, 256, {out, blocks * bb}, at::kLong).to(at::kByte);
  auto scales = (at::rand({out, blocks, 2}) * 0.2 - 0.1).to(at::kHalf);
  auto bytes = data.view({out, blocks, bb});
  auto scale_bytes = scales.view(at::kByte).view({out, blocks, 4});
  const int64_t header = format == BlockFormat::kQ4_1 ? 4 : 2;
  bytes.narrow(2, 0, header).copy_(scale_bytes.narrow(2, 0, header));
  return quantized_matrix(format, data.contiguous(), in);
}

}  // namespace cartridges
