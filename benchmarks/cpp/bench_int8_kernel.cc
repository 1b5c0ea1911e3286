// The int8 kernel alone (cpp/src/model/quantized_int8.cpp): how many multiply-adds a second
// it reaches on the default model's shapes, without the rest of a decode step. End-to-end
// decode figures on a shared 2-core machine move by 10-20% between runs; a product repeated
// many times, best of 15, resolves a kernel change of a few percent.
//
//     build/py/bench_int8_kernel [threads=1] [rows=1,4,16,64]
//
// Built with the GoogleTest suite (`make build`). Weights are random blocks (the tests'
// random_quantized_matrix) in the default model's formats (Q4_1 layers, the Q8_0 embedding as
// the output layer); "hot" repeats one matrix (in cache), "model" runs a forward's 121
// products in order on distinct matrices, so their weights come from memory as in a decode
// step. Prints a hash of each output: a change that keeps the arithmetic must keep the hashes.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

#include "model/quantized_int8.h"
#include "output_hash.h"
#include "random_quantized.h"

using namespace cartridges;

namespace {

struct Shape {
  const char* name;
  BlockFormat format;
  int64_t out, in;
  int per_forward;  // products of this shape in one forward of the default model
};

// SmolLM2-135M: fused q/k/v and gate/up, 30 layers; the tied embedding as the output layer.
const Shape kShapes[] = {{"qkv", BlockFormat::kQ4_1, 960, 576, 30},
                         {"o", BlockFormat::kQ4_1, 576, 576, 30},
                         {"gate_up", BlockFormat::kQ4_1, 3072, 576, 30},
                         {"down", BlockFormat::kQ4_1, 576, 1536, 30},
                         {"lm_head", BlockFormat::kQ8_0, 49152, 576, 1}};

template <typename F>
double best_ms(int trials, int repeats, const F& fn) {
  double best = 1e30;
  for (int t = 0; t < trials; ++t) {
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < repeats; ++i) fn();
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    best = std::min(best, ms / repeats);
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  const int threads = argc > 1 ? std::atoi(argv[1]) : 1;
  std::vector<int64_t> row_counts = {1, 4, 16, 64};
  if (argc > 2) {
    row_counts.clear();
    std::stringstream list(argv[2]);
    for (std::string item; std::getline(list, item, ',');) row_counts.push_back(std::stoll(item));
  }
  at::set_num_threads(threads);
  at::manual_seed(0);
  std::printf("int8 kernel, %d thread(s), AVX2 %s; GMAC/s = 1e9 multiply-adds a second, best of 15\n", threads,
              cpu_has_avx2() ? "yes" : "no");
  std::vector<QuantizedMatrix> hot;
  for (const auto& s : kShapes) hot.push_back(random_quantized_matrix(s.format, s.out, s.in));
  std::vector<QuantizedMatrix> model;  // one forward's products, each its own matrix
  for (const auto& s : kShapes) {
    for (int i = 0; i < s.per_forward; ++i) model.push_back(random_quantized_matrix(s.format, s.out, s.in));
  }
  for (const int64_t rows : row_counts) {
    auto x = at::randn({rows, 1536});
    auto y = at::empty({rows, 49152});
    for (size_t k = 0; k < hot.size(); ++k) {
      const Shape& s = kShapes[k];
      auto out = y.narrow(1, 0, s.out).contiguous();
      auto run = [&] { int8_linear(x.data_ptr<float>(), rows, hot[k], out.data_ptr<float>()); };
      run();
      const double ms = best_ms(15, std::max<int64_t>(1, 2000000000 / (rows * s.out * s.in) / 10), run);
      std::printf("rows %3ld  hot %-8s %9.3f ms %7.1f GMAC/s  hash %016llx\n", static_cast<long>(rows), s.name, ms,
                  static_cast<double>(rows) * s.out * s.in / ms / 1e6, static_cast<unsigned long long>(output_hash(out)));
    }
    double macs = 0;
    for (const auto& s : kShapes) macs += static_cast<double>(rows) * s.out * s.in * s.per_forward;
    const double ms = best_ms(15, 1, [&] {
      for (const auto& w : model) int8_linear(x.data_ptr<float>(), rows, w, y.data_ptr<float>());
    });
    std::printf("rows %3ld  model (121 products) %9.3f ms %7.1f GMAC/s\n", static_cast<long>(rows), ms,
                macs / ms / 1e6);
  }
  return 0;
}
