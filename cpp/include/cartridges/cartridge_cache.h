#pragma once
// Loaded cartridges under a byte budget, least recently used evicted first.

#include <cstdint>
#include <list>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "cartridges/prefix.h"

namespace cartridges {

struct CartridgeCacheStats {
  int64_t entries = 0, bytes = 0, budget_bytes = 0;
  int64_t hits = 0, misses = 0, loads = 0, evictions = 0;
};

// Cartridges (KV prefixes) by id under a byte budget. A cartridge that a queued or running
// request holds (its shared pointer is held outside the cache) is never evicted; loading past
// the budget evicts the least recently used idle ones. Thread-safe.
class CartridgeCache {
 public:
  explicit CartridgeCache(int64_t budget_bytes);

  // The cartridge, marked as just used; null when absent (counted as a miss).
  PrefixPtr get(const std::string& id);
  bool contains(const std::string& id) const;
  // Adds (or replaces) a cartridge, evicting idle ones as needed; CacheFullError when it
  // cannot fit even then (nothing is evicted in that case).
  void put(const std::string& id, PrefixPtr prefix);
  // Removes it from the cache (a request holding it keeps its copy alive until it ends).
  bool remove(const std::string& id);
  std::vector<std::string> ids() const;  // most recently used first
  CartridgeCacheStats stats() const;

 private:
  struct Entry {
    std::string id;
    PrefixPtr prefix;
    int64_t bytes;
  };
  mutable std::mutex mutex_;
  int64_t budget_, bytes_ = 0;
  CartridgeCacheStats counters_;
  std::list<Entry> lru_;  // front: most recently used
  std::unordered_map<std::string, std::list<Entry>::iterator> index_;
};

}  // namespace cartridges
