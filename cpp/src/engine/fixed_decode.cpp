#include "engine/fixed_decode.h"

#include <ATen/record_function.h>

#include <algorithm>
#include <set>

namespace cartridges {

namespace {

constexpr size_t kMaxRows = 256;
constexpr int64_t kLeastKeys = 64;      // the smallest key bucket
constexpr int64_t kLeastSlabRows = 1024;
constexpr size_t kMaxGraphs = 48;       // past it every graph is dropped and captured anew

int64_t bucket(int64_t n, int64_t least) {
  int64_t b = least;
  while (b < n) b *= 2;
  return b;
}

}  // namespace

FixedDecode::FixedDecode(std::shared_ptr<const LlamaModel> model, bool graphs)
    : model_(std::move(model)), graphs_(graphs) {
  TORCH_CHECK(!graphs_ || (model_->device().is_cuda() && cuda_graphs_built()),
              "FixedDecode: CUDA graphs need a model on CUDA and a build with CUDA");
}

bool FixedDecode::serves(const PackedBatch& batch) {
  if (batch.sequences.empty() || batch.sequences.size() > kMaxRows) return false;
  return std::all_of(batch.sequences.begin(), batch.sequences.end(),
                     [](const PackedSequence& s) { return s.num_new == 1 && s.logits && !s.all_logits; });
}

void FixedDecode::copy_into_slab(Placed& placed) {
  const auto& c = model_->config();
  int64_t row = placed.start;
  for (const auto& p : placed.prefixes) {
    const int64_t n = p->num_tokens();
    for (int64_t l = 0; l < c.num_layers; ++l) {
      slab_.keys[l].narrow(0, row, n).copy_(p->keys[l].transpose(0, 1));
      slab_.values[l].narrow(0, row, n).copy_(p->values[l].transpose(0, 1));
      auto biases = slab_.biases[l].narrow(0, row, n);
      if (p->biases.empty()) {
        biases.zero_();
      } else {
        biases.copy_(p->biases[l].transpose(0, 1));
      }
    }
    row += n;
  }
}

std::vector<const FixedDecode::Placed*> FixedDecode::place_prefixes(const PackedBatch& batch) {
  // A list with a prefix no one else holds any more (its cartridge evicted or deleted, its
  // requests ended) can never be asked for again: let it go, so that its memory is freed now,
  // not at the next refill. Its rows stay unused until then.
  for (auto it = placed_.begin(); it != placed_.end();) {
    const auto& list = it->second.prefixes;
    const bool orphaned =
        std::any_of(list.begin(), list.end(), [](const PrefixPtr& p) { return p.use_count() == 1; });
    it = orphaned ? placed_.erase(it) : std::next(it);
  }
  // The lists this step needs that the slab lacks, and the rows they take.
  int64_t missing = 0, needed = 0;
  std::set<ops::PrefixKey> seen;
  for (const auto& s : batch.sequences) {
    if (s.prefixes.empty()) continue;
    auto key = ops::prefix_key(s.prefixes);
    if (!seen.insert(key).second) continue;
    int64_t length = 0;
    for (const auto& p : s.prefixes) length += p->num_tokens();
    needed += length;
    if (placed_.count(key) == 0) missing += length;
  }
  if (slab_used_ + missing > slab_.capacity()) {
    // Out of room: lists no longer used are let go and the slab is filled anew with this
    // step's; a larger slab moves, and the graphs that read the old one go with it.
    placed_.clear();
    slab_used_ = 0;
    if (needed > slab_.capacity()) {
      const auto& c = model_->config();
      const int64_t capacity = bucket(2 * needed, kLeastSlabRows);
      captured_.clear();
      slab_ = DecodeSlab{};
      const auto floats = at::TensorOptions().dtype(at::kFloat).device(model_->device());
      for (int64_t l = 0; l < c.num_layers; ++l) {
        slab_.keys.push_back(at::empty({capacity, c.num_kv_heads, c.head_dim}, model_->options()));
        slab_.values.push_back(at::empty({capacity, c.num_kv_heads, c.head_dim}, model_->options()));
        slab_.biases.push_back(at::zeros({capacity, c.num_kv_heads}, floats));
      }
    }
  }
  std::vector<const Placed*> rows;
  for (const auto& s : batch.sequences) {
    if (s.prefixes.empty()) {
      rows.push_back(nullptr);
      continue;
    }
    auto key = ops::prefix_key(s.prefixes);
    auto it = placed_.find(key);
    if (it == placed_.end()) {
      Placed placed{s.prefixes, slab_used_, 0};
      for (const auto& p : s.prefixes) placed.length += p->num_tokens();
      copy_into_slab(placed);
      slab_used_ += placed.length;
      it = placed_.emplace(std::move(key), std::move(placed)).first;
    }
    rows.push_back(&it->second);
  }
  return rows;
}

at::Tensor FixedDecode::step(const PackedBatch& batch, KVPool& pool) {
  RECORD_FUNCTION("cartridges::fixed_decode_step", std::vector<c10::IValue>());
  TORCH_CHECK(serves(batch), "FixedDecode: a step of one-token sequences with logits, at most ", kMaxRows);
  const int64_t rows = static_cast<int64_t>(batch.sequences.size());
  const auto placed = place_prefixes(batch);
  const auto tokens = batch.tokens.to(at::kCPU).to(at::kLong).contiguous();
  TORCH_CHECK(tokens.numel() == rows, "FixedDecode: one token per sequence");

  // One column per row; padding rows repeat row 0 (they compute and write exactly what it
  // does, so their writes to its slot change nothing).
  const int64_t padded = bucket(rows, 1);
  auto inputs = at::empty({kDecodeInputs, padded}, at::kLong);
  auto in = inputs.accessor<int64_t, 2>();
  const auto* token = tokens.data_ptr<int64_t>();
  int64_t longest_own = 1, longest_prefix = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const auto& s = batch.sequences[r];
    TORCH_CHECK(s.kv_offset >= 0 && s.past >= 0 && s.kv_offset + s.past < pool.capacity(),
                "FixedDecode: a sequence's slots lie outside the pool");
    const int64_t prefix_length = placed[r] != nullptr ? placed[r]->length : 0;
    in[kToken][r] = token[r];
    in[kPosition][r] = prefix_length + s.past;
    in[kOwnOffset][r] = s.kv_offset;
    in[kOwnLength][r] = s.past + 1;
    in[kPrefixStart][r] = placed[r] != nullptr ? placed[r]->start : 0;
    in[kPrefixLength][r] = prefix_length;
    longest_own = std::max(longest_own, s.past + 1);
    longest_prefix = std::max(longest_prefix, prefix_length);
  }
  for (int64_t r = rows; r < padded; ++r) {
    for (int64_t i = 0; i < kDecodeInputs; ++i) in[i][r] = in[i][0];
  }
  const int64_t own_keys = bucket(longest_own, kLeastKeys);
  const int64_t prefix_keys = longest_prefix == 0 ? 0 : bucket(longest_prefix, kLeastKeys);
  const auto& model = *model_;
  if (!graphs_) {
    auto logits = model.forward_fixed_decode(inputs.to(model.device()), prefix_keys, own_keys, slab_, pool);
    return logits.narrow(0, 0, rows);
  }

  const Bucket key{padded, prefix_keys, own_keys};
  auto it = captured_.find(key);
  if (it == captured_.end()) {
    if (captured_.size() >= kMaxGraphs) captured_.clear();
    Captured fresh;
    fresh.inputs = inputs.to(model.device());
    const auto device_inputs = fresh.inputs;
    const StepGraph* share = captured_.empty() ? nullptr : captured_.begin()->second.graph.get();
    fresh.graph = capture_step_graph(
        [&model, device_inputs, prefix_keys, own_keys, this, &pool] {
          return model.forward_fixed_decode(device_inputs, prefix_keys, own_keys, slab_, pool);
        },
        share);
    ++captures_;
    it = captured_.emplace(key, std::move(fresh)).first;
  } else {
    it->second.inputs.copy_(inputs);
  }
  return it->second.graph->replay().narrow(0, 0, rows);
}

}  // namespace cartridges
