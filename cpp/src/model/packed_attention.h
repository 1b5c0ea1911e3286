#pragma once
// Attention of a packed serving step: every sequence attends to its prefixes (cartridges,
// shared) and to its own keys/values in the KV pool.
//
// Each part is computed as a partial softmax (running max m, sum of exponentials l and the
// unnormalized output o) and the parts are merged like flash-attention does, so that
//  - sequences that share a prefix list attend to it in one matrix product per segment
//    (the cartridge's KV is read once per layer and step, never copied per sequence), and
//  - each sequence's own KV is read in place from its range of pool slots.

#include <ATen/ATen.h>

#include <vector>

#include "cartridges/kv_pool.h"
#include "cartridges/model.h"

namespace cartridges::ops {

// A prefix list's identity: the prefixes it holds, in order. Sequences with equal keys share
// one attention over their prefixes (here) or one copy of them (the fixed-shape decode slab).
using PrefixKey = std::vector<const KVPrefix*>;
PrefixKey prefix_key(const PrefixList& list);

// Partial attention results over a set of keys, in float32: o [N, H, D] (unnormalized),
// m [N, H] (max score), l [N, H] (sum of exp(score - m)).
struct PartialAttention {
  at::Tensor o, m, l;
};

// Where each sequence's tokens sit in the packed step, computed once per step.
struct PackedLayout {
  std::vector<int64_t> token_start;  // first packed token of each sequence
  // Sequences grouped by identical (non-empty) prefix list; each group's packed token indices.
  std::vector<std::vector<int64_t>> groups;  // sequence indices per group
  std::vector<at::Tensor> group_tokens;      // [n_g] int64 on the model's device
  at::Tensor decode_tokens;                  // gathered path: packed indices of one-token sequences
  std::vector<int64_t> decode_sequences;     // their sequence indices
  std::vector<int64_t> decode_token_list, decode_offsets, decode_lengths;  // per one-token sequence
  std::vector<const PrefixList*> decode_prefixes;
  // The gathered path (not CPU float32), for R one-token rows: own pool slots [R * longest];
  // the prefixes folded into the rows (below), laid end to end row by row, and each row's
  // indices into them [R * longest_prefix] (undefined when no row folds one); an additive mask
  // [R, 1, 1, longest_prefix + longest] of 0 and -inf over the row's prefix then own keys.
  at::Tensor decode_slots, decode_prefix_slots, decode_mask;
  std::vector<const KVPrefix*> decode_folded;
  bool decode_folded_biases = false;  // some folded prefix has attention biases
};

// `gathered`: the one-token sequences take the gathered path (slot indices built here). There,
// a row whose prefix list no other sequence of the step has folds its prefixes into its own
// gathered keys (one attention for every such row at once, however many distinct cartridges:
// the launch count of a GPU step stays flat in the number of users); rows that share a list
// join that list's group, whose prefix KV is then read once for all of them. Otherwise (the
// CPU kernel) the one-token sequences attend to their prefixes in the kernel, ordered so that
// rows sharing a prefix list are adjacent, and the groups hold only multi-token sequences.
PackedLayout packed_layout(const PackedBatch& batch, at::Device device, bool gathered);

// q: [N, H, D] already rotated; keys/values: the layer's pool slabs [capacity, H_kv, D]
// holding this step's new tokens; `layer` selects the prefixes' tensors. Returns [N, H, D]
// in q's dtype.
at::Tensor packed_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                            const PackedBatch& batch, const PackedLayout& layout, int64_t layer);

// The CPU float32 kernel for one-token sequences: packed token `tokens[i]` attends to its
// prefixes `prefixes[i]` (layer `layer`) and to its own pool slots [offsets[i], + lengths[i]);
// fills its rows of `out`. Rows are taken in the given order, so rows that share a cartridge
// should be adjacent: its KV is then read from memory once and from cache for the others.
void decode_attention_cpu(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                          const std::vector<int64_t>& tokens, const std::vector<int64_t>& offsets,
                          const std::vector<int64_t>& lengths, const std::vector<const PrefixList*>& prefixes,
                          int64_t layer, PartialAttention& out);

// Where the rows of a fixed-shape decode step (LlamaModel::forward_fixed_decode) read their keys:
// R rows, each over P prefix keys then L own keys, padded (a padded key reads a valid slot and
// is masked).
struct FixedDecodeIndex {
  at::Tensor own_slots;     // [R * L] int64 pool slots
  at::Tensor prefix_slots;  // [R * P] int64 rows of the DecodeSlab; undefined when P = 0
  at::Tensor mask;          // [R, 1, 1, P + L] float32: 0, or -inf over padding
};

// Attention of a fixed-shape decode step's rows: q [R, H, D] already rotated, the layer's pool
// slabs and the prefix slab. The arithmetic of the gathered path (every row folds its
// prefixes), with no host work, so that a CUDA graph can replay it. Returns [R, H, D] in q's
// dtype.
at::Tensor fixed_decode_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                                  const DecodeSlab& slab, int64_t layer, const FixedDecodeIndex& index);

}  // namespace cartridges::ops
