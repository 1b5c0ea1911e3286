// The CPU decode attention alone (ops::packed_attention's kernel for one-token rows,
// cpp/src/model/packed_attention.cpp): microseconds per layer for decoding rows behind a
// cartridge, on the default model's heads (9 query heads, 3 KV heads, 64 dimensions, 30
// layers), with the engine's spinning pool of `threads`. End-to-end decode on a shared 2-core
// machine moves by 10-20% between runs; the kernel repeated many times, best of 15, resolves a
// few percent. "hot" repeats one layer (its keys and values in cache); "step" takes the 30
// layers in turn, as a decode step does, so a cartridge's keys and values come from memory.
//
//     build/py/bench_decode_attention [threads=2]
//
// Built with the GoogleTest suite (`make build`). Cases: batch 1 and 16, no cartridge, one
// 1,024-token cartridge shared by every row, and a 512-token cartridge of each row's own; each
// row has 160 keys of its own. Prints a hash of each output: a change that keeps the
// arithmetic keeps the hashes.
#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "model/packed_attention.h"
#include "model/spin_pool.h"
#include "output_hash.h"

using namespace cartridges;

namespace {

constexpr int64_t kHeads = 9, kKvHeads = 3, kDim = 64, kOwn = 160;

constexpr int64_t kLayers = 30;  // SmolLM2-135M's: a step reads each layer's keys once, from memory

PrefixPtr random_prefix(int64_t tokens) {
  auto p = std::make_shared<KVPrefix>();
  for (int64_t l = 0; l < kLayers; ++l) {
    p->keys.push_back(at::randn({kKvHeads, tokens, kDim}));
    p->values.push_back(at::randn({kKvHeads, tokens, kDim}));
  }
  return p;
}

}  // namespace

int main(int argc, char** argv) {
  const int threads = argc > 1 ? std::atoi(argv[1]) : 2;
  SpinPool pool(threads);
  PoolScope scope(&pool);
  at::manual_seed(0);
  const int64_t capacity = 16 * kOwn;
  auto keys = at::randn({capacity, kKvHeads, kDim}), values = at::randn({capacity, kKvHeads, kDim});
  auto shared = random_prefix(1024);
  std::vector<PrefixPtr> own;
  for (int i = 0; i < 16; ++i) own.push_back(random_prefix(512));
  std::printf("decode attention, %d threads, %lld own keys a row: microseconds a layer (best of 15)\n", threads,
              static_cast<long long>(kOwn));
  for (const char* cartridge : {"none", "one 1,024-token", "own 512-token"}) {
    for (int64_t rows : {1, 16}) {
      PackedBatch batch;
      for (int64_t r = 0; r < rows; ++r) {
        PrefixList prefixes;
        if (std::string(cartridge) == "one 1,024-token") prefixes = {shared};
        if (std::string(cartridge) == "own 512-token") prefixes = {own[r]};
        batch.sequences.push_back({r * kOwn, kOwn - 1, 1, prefixes, true});
      }
      auto q = at::randn({rows, kHeads, kDim});
      auto layout = ops::packed_layout(batch, at::kCPU, /*gathered=*/false);
      // "hot": one layer repeated (its keys in cache); "step": the 30 layers in turn, as a decode
      // step reads them (a 1,024-token cartridge is 45 MB over its layers: from memory).
      at::Tensor out;
      double hot = 1e30, step = 1e30;
      for (int trial = 0; trial < 15; ++trial) {
        auto start = std::chrono::steady_clock::now();
        for (int i = 0; i < 5 * kLayers; ++i) out = ops::packed_attention(q, keys, values, batch, layout, 0);
        double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count();
        hot = std::min(hot, us / (5 * kLayers));
        start = std::chrono::steady_clock::now();
        for (int i = 0; i < 5; ++i) {
          for (int64_t l = 0; l < kLayers; ++l) ops::packed_attention(q, keys, values, batch, layout, l);
        }
        us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count();
        step = std::min(step, us / (5 * kLayers));
      }
      std::printf("batch %2lld, cartridge %-16s hot %8.1f us  step %8.1f us  hash %016llx\n",
                  static_cast<long long>(rows), cartridge, hot, step, static_cast<unsigned long long>(output_hash(out)));
    }
  }
  return 0;
}
