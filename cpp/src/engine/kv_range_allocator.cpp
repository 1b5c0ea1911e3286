#include "engine/kv_range_allocator.h"

#include <algorithm>

#include <c10/util/Exception.h>

namespace cartridges {

KVRangeAllocator::KVRangeAllocator(int64_t capacity) : capacity_(capacity) {
  TORCH_CHECK(capacity > 0, "KV pool capacity must be positive");
  free_[0] = capacity;
}

std::optional<int64_t> KVRangeAllocator::allocate(int64_t size) {
  TORCH_INTERNAL_ASSERT(size > 0);
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->second < size) continue;
    const int64_t offset = it->first, left = it->second - size;
    free_.erase(it);
    if (left > 0) free_[offset + size] = left;
    used_ += size;
    return offset;
  }
  return std::nullopt;
}

void KVRangeAllocator::release(int64_t offset, int64_t size) {
  TORCH_INTERNAL_ASSERT(size > 0 && offset >= 0 && offset + size <= capacity_);
  auto next = free_.lower_bound(offset);
  TORCH_INTERNAL_ASSERT(next == free_.end() || next->first >= offset + size, "KV range released twice");
  int64_t start = offset, length = size;
  if (next != free_.begin()) {
    auto prev = std::prev(next);
    TORCH_INTERNAL_ASSERT(prev->first + prev->second <= offset, "KV range released twice");
    if (prev->first + prev->second == offset) {
      start = prev->first;
      length += prev->second;
      free_.erase(prev);
    }
  }
  if (next != free_.end() && next->first == offset + size) {
    length += next->second;
    free_.erase(next);
  }
  free_[start] = length;
  used_ -= size;
}

int64_t KVRangeAllocator::largest_free() const {
  int64_t best = 0;
  for (const auto& [offset, size] : free_) best = std::max(best, size);
  return best;
}

}  // namespace cartridges
