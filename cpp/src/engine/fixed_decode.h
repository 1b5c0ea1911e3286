#pragma once
// Decode steps at fixed shapes (docs/design.md, "Decode steps as CUDA graphs"). A step whose
// sequences all decode one token is padded to buckets: rows to a power of two, each row's
// prefix keys and own keys to a power of two of at least 64. On CUDA each bucket's step is
// captured once as a CUDA graph and replayed, without the host's work per operator (some
// 2,600 kernel launches a step for the default model), which bounds a GPU step of a small
// model.

#include <map>
#include <memory>
#include <tuple>
#include <vector>

#include "cartridges/kv_pool.h"
#include "cartridges/model.h"
#include "engine/cuda_graph.h"
#include "model/packed_attention.h"

namespace cartridges {

class FixedDecode {
 public:
  // `graphs`: capture and replay CUDA graphs (a model on CUDA, a build with CUDA graphs);
  // otherwise each step runs the same fixed-shape forward eagerly (tests check its arithmetic
  // on any device that way).
  FixedDecode(std::shared_ptr<const LlamaModel> model, bool graphs);

  // Whether this path takes `batch`: every sequence decodes one token and returns its logits,
  // and there are at most 256 of them.
  static bool serves(const PackedBatch& batch);
  // The step: appends each sequence's new K/V to `pool` and returns float32 logits [R, vocab],
  // as LlamaModel::forward_packed does.
  at::Tensor step(const PackedBatch& batch, KVPool& pool);
  // CUDA graphs captured so far (bucket shapes seen; at most 48 kept).
  int64_t captures() const { return captures_; }

 private:
  // A prefix list's place in the slab: its prefixes end to end (held, so the pointers stay
  // theirs, until no one else holds one of them), from row `start`.
  struct Placed {
    PrefixList prefixes;
    int64_t start = 0, length = 0;
  };
  struct Captured {
    at::Tensor inputs;  // [kDecodeInputs, R] on the device, written before each replay
    std::unique_ptr<StepGraph> graph;
  };
  using Bucket = std::tuple<int64_t, int64_t, int64_t>;  // rows, prefix keys, own keys

  // The slab rows of each sequence's prefix list (appended when new; the slab is refilled, or
  // grown and every graph dropped, when it runs out of room).
  std::vector<const Placed*> place_prefixes(const PackedBatch& batch);
  void copy_into_slab(Placed& placed);

  std::shared_ptr<const LlamaModel> model_;
  bool graphs_;
  DecodeSlab slab_;
  int64_t slab_used_ = 0;
  std::map<ops::PrefixKey, Placed> placed_;
  std::map<Bucket, Captured> captured_;
  int64_t captures_ = 0;
};

}  // namespace cartridges
