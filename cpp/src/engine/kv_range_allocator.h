#pragma once
// Hands out ranges of the engine's KV pool (see KVPool in cartridges/kv_pool.h): policy only,
// no tensors. A request gets one contiguous range of slots, so that its own keys and values
// are read in place, and gives it back when it ends; the scheduler packs the ranges (a new
// allocator, filled in offset order) when the free slots are too fragmented.

#include <cstdint>
#include <map>
#include <optional>

namespace cartridges {

class KVRangeAllocator {
 public:
  explicit KVRangeAllocator(int64_t capacity);

  // The first offset of a free range of `size` slots (first fit), or nothing.
  std::optional<int64_t> allocate(int64_t size);
  // Returns a range given by allocate; neighbouring free ranges are merged.
  void release(int64_t offset, int64_t size);

  int64_t capacity() const { return capacity_; }
  int64_t used() const { return used_; }
  int64_t largest_free() const;

 private:
  int64_t capacity_, used_ = 0;
  std::map<int64_t, int64_t> free_;  // offset -> size, non-adjacent
};

}  // namespace cartridges
