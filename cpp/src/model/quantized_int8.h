#pragma once
// The int8-activation kernels behind quantized_linear (quantized.h), in their own translation
// unit: the weights in groups of 16 output features, integer dot products by AVX-512 VNNI (or
// AVX2), and one float32 accumulator lane per output feature.

#include "model/quantized.h"

namespace cartridges {

// y [rows, out] = x [rows, in] @ W^T, each block of 32 activations rounded to 8 bits with its
// own scale (round_activations_int8). `w` must have its int8 layout.
void int8_linear(const float* x, int64_t rows, const QuantizedMatrix& w, float* y);

// Whether this CPU runs the AVX2 kernels (AVX2, FMA and F16C).
bool cpu_has_avx2();

}  // namespace cartridges
