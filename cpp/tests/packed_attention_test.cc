// Packed attention against a plain reference (each token: softmax over its prefixes' keys and
// its own causal keys), on both the CPU kernel path and the gathered path used elsewhere.
#include <gtest/gtest.h>

#include <cmath>

#include "model/packed_attention.h"

using namespace cartridges;

namespace {

constexpr int64_t kHeads = 4, kKvHeads = 2, kDim = 8, kCapacity = 64;

PrefixPtr random_prefix(int64_t tokens, bool biased = false, int64_t kv_heads = kKvHeads, int64_t dim = kDim) {
  auto p = std::make_shared<KVPrefix>();
  p->keys.push_back(at::randn({kv_heads, tokens, dim}));
  p->values.push_back(at::randn({kv_heads, tokens, dim}));
  if (biased) p->biases.push_back(at::randn({kv_heads, tokens}) * 2);
  return p;
}

// Token j of sequence s attends to its prefixes and to own slots [0, past + j].
at::Tensor reference(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, const PackedBatch& batch) {
  const int64_t heads = q.size(1), kv_heads = keys.size(1), dim = q.size(2);
  auto out = at::empty_like(q);
  int64_t token = 0;
  for (const auto& s : batch.sequences) {
    for (int64_t j = 0; j < s.num_new; ++j, ++token) {
      std::vector<at::Tensor> ks, vs, bs;
      for (const auto& p : s.prefixes) {
        ks.push_back(p->keys[0].transpose(0, 1));  // [P, Hkv, D]
        vs.push_back(p->values[0].transpose(0, 1));
        bs.push_back(p->biases.empty() ? at::zeros({kv_heads, p->num_tokens()}) : p->biases[0]);
      }
      ks.push_back(keys.narrow(0, s.kv_offset, s.past + j + 1));
      vs.push_back(values.narrow(0, s.kv_offset, s.past + j + 1));
      bs.push_back(at::zeros({kv_heads, s.past + j + 1}));
      auto k = at::cat(ks).repeat_interleave(heads / kv_heads, 1).transpose(0, 1);  // [H, T, D]
      auto v = at::cat(vs).repeat_interleave(heads / kv_heads, 1).transpose(0, 1);
      auto bias = at::cat(bs, 1).repeat_interleave(heads / kv_heads, 0).unsqueeze(1);  // [H, 1, T]
      auto scores = at::matmul(q[token].unsqueeze(1), k.transpose(1, 2)) / std::sqrt(double(dim)) + bias;
      out[token] = at::matmul(scores.softmax(-1), v).squeeze(1);
    }
  }
  return out;
}

// Random queries for the batch's tokens through the kernel and the gathered paths, each against
// the reference.
void expect_paths_match_reference(const at::Tensor& keys, const at::Tensor& values, const PackedBatch& batch,
                                  int64_t heads = kHeads) {
  int64_t tokens = 0;
  for (const auto& s : batch.sequences) tokens += s.num_new;
  auto q = at::randn({tokens, heads, keys.size(2)});
  auto expected = reference(q, keys, values, batch);
  for (bool gathered : {false, true}) {
    auto layout = ops::packed_layout(batch, at::kCPU, gathered);
    auto got = ops::packed_attention(q, keys, values, batch, layout, 0);
    EXPECT_TRUE(at::allclose(got, expected, 1e-5, 1e-5)) << (gathered ? "gathered" : "kernel") << " path, max error "
                                                         << (got - expected).abs().max().item<float>();
  }
}

}  // namespace

TEST(PackedAttention, KernelAndGatheredPathsMatchTheReference) {
  at::manual_seed(0);
  auto keys = at::randn({kCapacity, kKvHeads, kDim}), values = at::randn({kCapacity, kKvHeads, kDim});
  auto shared = random_prefix(5), other = random_prefix(3);
  PackedBatch batch;
  // Decode rows with and without prefixes (two share theirs), and a prefill chunk.
  batch.sequences = {{0, 6, 1, {shared}, true},        {10, 11, 1, {}, true}, {30, 2, 1, {shared}, true},
                     {40, 3, 4, {other, shared}, true}, {50, 0, 1, {other}, true}};
  expect_paths_match_reference(keys, values, batch);
}

// Other shapes through the CPU kernel: more query heads per KV head than it takes at once (5),
// a head size past its 64 registered output dimensions and not a multiple of 16 (136), prefixes
// and own keys whose counts are not multiples of 8, and a row behind a long cartridge.
TEST(PackedAttention, WideHeadsAndManyQueryHeadsMatchTheReference) {
  at::manual_seed(7);
  constexpr int64_t kv_heads = 2, heads = 10, dim = 136;
  auto keys = at::randn({kCapacity, kv_heads, dim}), values = at::randn({kCapacity, kv_heads, dim});
  auto cartridge = random_prefix(37, /*biased=*/true, kv_heads, dim), other = random_prefix(5, false, kv_heads, dim);
  auto long_cartridge = random_prefix(500, /*biased=*/true, kv_heads, dim);
  PackedBatch batch;
  batch.sequences = {{0, 12, 1, {cartridge}, true},           {20, 0, 1, {}, true},
                     {30, 3, 1, {other, cartridge}, true},     {40, 10, 1, {cartridge}, true},
                     {50, 13, 1, {other, long_cartridge}, true}};
  expect_paths_match_reference(keys, values, batch, heads);
}

// A prefix's attention biases add to its keys' logits on every path; a prefix without biases
// beside it is unaffected.
TEST(PackedAttention, PrefixBiasesMatchTheReference) {
  at::manual_seed(3);
  auto keys = at::randn({kCapacity, kKvHeads, kDim}), values = at::randn({kCapacity, kKvHeads, kDim});
  auto biased = random_prefix(6, /*biased=*/true), plain = random_prefix(3);
  PackedBatch batch;
  batch.sequences = {{0, 4, 1, {biased}, true}, {10, 2, 1, {plain, biased}, true}, {20, 3, 3, {biased}, true},
                     {40, 0, 1, {biased}, true}};
  expect_paths_match_reference(keys, values, batch);
}

// One-token rows that each hold their own prefix list (the many-users case) fold their
// prefixes into the gathered keys, padded to the longest; beside them a row without prefixes,
// a composed list and a shared one (which stays a group).
TEST(PackedAttention, DistinctPrefixListsFoldIntoTheGatheredRows) {
  at::manual_seed(5);
  auto keys = at::randn({kCapacity, kKvHeads, kDim}), values = at::randn({kCapacity, kKvHeads, kDim});
  auto a = random_prefix(7), b = random_prefix(2, /*biased=*/true), c = random_prefix(4), shared = random_prefix(3);
  PackedBatch batch;
  batch.sequences = {{0, 5, 1, {a}, true},        {8, 0, 1, {b}, true},       {12, 9, 1, {}, true},
                     {24, 2, 1, {c, a}, true},     {30, 3, 1, {shared}, true}, {36, 1, 1, {shared}, true},
                     {40, 6, 2, {b, c}, true}};
  auto layout = ops::packed_layout(batch, at::kCPU, /*gathered=*/true);
  EXPECT_EQ(layout.decode_folded.size(), 4u);  // a; b; c, a
  EXPECT_TRUE(layout.decode_folded_biases);
  EXPECT_EQ(layout.groups.size(), 2u);  // shared (two rows) and the prefill chunk's {b, c}
  expect_paths_match_reference(keys, values, batch);
}

// A prompt's rows come out bit for bit the same whether it is prefilled whole or in chunks of
// any size, beside other sequences or alone, behind a cartridge or not (the CPU float32 path;
// with int8 activations a last-bit difference here moves log-probs by up to 0.1 nats). Shapes
// of SmolLM2-135M's attention, over more than two of ATen's 512-key blocks.
TEST(PackedAttention, PrefillRowsDoNotDependOnHowThePromptIsChunked) {
  at::manual_seed(11);
  constexpr int64_t kv_heads = 3, heads = 9, dim = 64, length = 1100, capacity = 2048;
  auto keys = at::randn({capacity, kv_heads, dim}), values = at::randn({capacity, kv_heads, dim});
  auto q = at::randn({length, heads, dim});
  auto neighbour_q = at::randn({40, heads, dim});
  for (bool with_cartridge : {false, true}) {
    PrefixList prefixes;
    if (with_cartridge) prefixes.push_back(random_prefix(300, /*biased=*/true, kv_heads, dim));
    // Rows [start, start + n) of the prompt, optionally after a neighbour's chunk of `neighbour`
    // tokens (its own slots lie after the prompt's).
    auto chunk = [&](int64_t start, int64_t n, int64_t neighbour) {
      PackedBatch batch;
      std::vector<at::Tensor> rows;
      if (neighbour > 0) {
        batch.sequences.push_back({length + 100, 7, neighbour, prefixes, true});
        rows.push_back(neighbour_q.narrow(0, 0, neighbour));
      }
      batch.sequences.push_back({0, start, n, prefixes, true});
      rows.push_back(q.narrow(0, start, n));
      auto layout = ops::packed_layout(batch, at::kCPU, /*gathered=*/false);
      return ops::packed_attention(at::cat(rows), keys, values, batch, layout, 0).narrow(0, neighbour, n);
    };
    const auto whole = chunk(0, length, 0);
    PackedBatch alone;
    alone.sequences.push_back({0, 0, length, prefixes, true});
    auto expected = reference(q, keys, values, alone);
    EXPECT_TRUE(at::allclose(whole, expected, 1e-5, 1e-5)) << (whole - expected).abs().max().item<float>();
    for (int64_t size : {2, 3, 6, 33, 100, 128, 500, 512, 700}) {  // none leaves one token
      for (int64_t neighbour : {0, 1, 5}) {
        std::vector<at::Tensor> parts;
        for (int64_t start = 0; start < length; start += size) {
          parts.push_back(chunk(start, std::min(size, length - start), neighbour));
        }
        auto chunked = at::cat(parts);
        EXPECT_TRUE(at::equal(chunked, whole))
            << "chunks of " << size << ", neighbour of " << neighbour << (with_cartridge ? ", cartridge" : "")
            << ": max difference " << (chunked - whole).abs().max().item<float>();
      }
    }
  }
}
