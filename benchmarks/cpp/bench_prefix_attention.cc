// The bfloat16 attention kernels (cpp/src/model/prefix_attention_bf16.cpp) against ATen's
// fused CPU attention on the same inputs, forward and backward: over a prefix on the shapes of
// a training step and of synthesis' scoring behind a teacher's window, and each row's own keys,
// causal, on a training step's. Over a prefix both get the layout split attention gives them:
// one sequence per KV head, the query heads and rows of a KV head in it.
//
//     build/py/bench_prefix_attention [threads=2]
//
// Built with the GoogleTest suite (`make build`). Prints milliseconds (best of 15) and
// multiply-adds a second (two products of D per query and key).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>

#include "model/prefix_attention_bf16.h"

using namespace cartridges;

namespace {

template <typename F>
double best_ms(int trials, const F& fn) {
  fn();
  double best = 1e30;
  for (int t = 0; t < trials; ++t) {
    const auto start = std::chrono::steady_clock::now();
    fn();
    best = std::min(best, std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
  }
  return best;
}

struct Shape {
  const char* name;
  int64_t rows, tokens, prefix;  // rows x tokens queries a query head, behind `prefix` keys
};

}  // namespace

int main(int argc, char** argv) {
  const int threads = argc > 1 ? std::atoi(argv[1]) : 2;
  at::set_num_threads(threads);
  at::manual_seed(0);
  if (!ops::prefix_attention_bf16_supported(64)) {
    std::printf("this CPU has no AVX-512 BF16: the kernel does not run here\n");
    return 0;
  }
  constexpr int64_t kHeads = 9, kKvHeads = 3, kDim = 64;  // SmolLM2-135M
  const Shape shapes[] = {{"training step (4 x 180 behind 1,024)", 4, 180, 1024},
                          {"bench_train_step (4 x 320 behind 1,024)", 4, 320, 1024},
                          {"synthesis scoring (16 x 150 behind 1,024)", 16, 150, 1024},
                          {"synthesis scoring (16 x 150 behind 1,536)", 16, 150, 1536}};
  std::printf("prefix attention forward, bfloat16, %d thread(s), best of 15\n", threads);
  for (const auto& s : shapes) {
    const int64_t len = s.rows * (kHeads / kKvHeads) * s.tokens;
    auto q = at::randn({1, kKvHeads, len, kDim}).to(at::kBFloat16);
    auto k = at::randn({kKvHeads, s.prefix, kDim}).to(at::kBFloat16);
    auto v = at::randn({kKvHeads, s.prefix, kDim}).to(at::kBFloat16);
    const double aten = best_ms(15, [&] {
      at::_scaled_dot_product_flash_attention_for_cpu(q, k.unsqueeze(0), v.unsqueeze(0), 0.0, false);
    });
    const double kernel = best_ms(15, [&] { ops::prefix_attention_bf16(q, k, v, at::Tensor()); });
    const double macs = 2.0 * kKvHeads * len * s.prefix * kDim;
    std::printf("%-44s forward   ATen %7.2f ms %6.1f GMAC/s   kernel %7.2f ms %6.1f GMAC/s   %.2fx\n", s.name,
                aten, macs / aten / 1e6, kernel, macs / kernel / 1e6, aten / kernel);
    // The backward: five products of D per query and key (scores and dP rebuilt; dq, dk, dv).
    auto grad = at::randn_like(q);
    auto [out, lse] = ops::prefix_attention_bf16(q, k, v, at::Tensor());
    const auto ke = k.unsqueeze(0), ve = v.unsqueeze(0);
    const double aten_back = best_ms(15, [&] {
      at::_scaled_dot_product_flash_attention_for_cpu_backward(grad, q, ke, ve, out, lse, 0.0, false);
    });
    const double kernel_back =
        best_ms(15, [&] { ops::prefix_attention_bf16_backward(grad, q, k, v, at::Tensor(), out, lse); });
    std::printf("%-44s backward  ATen %7.2f ms %6.1f GMAC/s   kernel %7.2f ms %6.1f GMAC/s   %.2fx\n", "",
                aten_back, 2.5 * macs / aten_back / 1e6, kernel_back, 2.5 * macs / kernel_back / 1e6,
                aten_back / kernel_back);
  }
  // Each row's own keys, causal: ATen's fused attention over the keys repeated per query head
  // (as split attention gave it), the kernel over each KV head's keys with its query heads folded.
  std::printf("own keys, causal, forward and backward\n");
  for (const int64_t tokens : {180, 320}) {
    const int64_t rows = 4, groups = kHeads / kKvHeads;
    auto q = at::randn({rows, kHeads, tokens, kDim}).to(at::kBFloat16);
    auto k = at::randn({rows, kKvHeads, tokens, kDim}).to(at::kBFloat16);
    auto v = at::randn({rows, kKvHeads, tokens, kDim}).to(at::kBFloat16);
    auto grad = at::randn_like(q);
    auto k_rep = k.repeat_interleave(groups, 1), v_rep = v.repeat_interleave(groups, 1);
    auto fold = [&](const at::Tensor& x) {  // [B, H, S, D] -> [B, H_kv, G * S, D]
      return x.reshape({rows, kKvHeads, groups * tokens, kDim}).contiguous();
    };
    auto fq = fold(q), fgrad = fold(grad);
    const double aten = best_ms(15, [&] {
      auto [out, lse] = at::_scaled_dot_product_flash_attention_for_cpu(q, k_rep, v_rep, 0.0, true);
      at::_scaled_dot_product_flash_attention_for_cpu_backward(grad, q, k_rep, v_rep, out, lse, 0.0, true);
    });
    const double kernel = best_ms(15, [&] {
      auto [out, lse] = ops::causal_attention_bf16(fq, k, v);
      ops::causal_attention_bf16_backward(fgrad, fq, k, v, out, lse);
    });
    std::printf("%ld rows x %ld tokens %29s ATen %7.2f ms   kernel %7.2f ms   %.2fx\n", static_cast<long>(rows),
                static_cast<long>(tokens), "", aten, kernel, aten / kernel);
  }
  return 0;
}
