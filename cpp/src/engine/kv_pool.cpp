#include "cartridges/kv_pool.h"

#include <c10/util/Exception.h>

namespace cartridges {

KVPool::KVPool(const LlamaConfig& config, int64_t capacity, at::TensorOptions options) {
  TORCH_CHECK(capacity > 0, "KVPool: capacity must be positive");
  // Empty, not zeroed: a sequence only ever reads the slots it wrote, and untouched pages of
  // a large pool cost no memory until they are used.
  for (int64_t l = 0; l < config.num_layers; ++l) {
    keys.push_back(at::empty({capacity, config.num_kv_heads, config.head_dim}, options));
    values.push_back(at::empty({capacity, config.num_kv_heads, config.head_dim}, options));
  }
}

int64_t KVPool::nbytes() const {
  int64_t total = 0;
  for (size_t l = 0; l < keys.size(); ++l) total += keys[l].nbytes() + values[l].nbytes();
  return total;
}

}  // namespace cartridges
