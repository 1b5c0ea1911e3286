#include <string>

#include "cartridges/engine.h"

namespace cartridges {

CartridgeCache::CartridgeCache(int64_t budget_bytes) : budget_(budget_bytes) {
  TORCH_CHECK(budget_bytes >= 0, "the cartridge cache budget must not be negative");
  counters_.budget_bytes = budget_bytes;
}

PrefixPtr CartridgeCache::get(const std::string& id) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = index_.find(id);
  if (it == index_.end()) {
    ++counters_.misses;
    return nullptr;
  }
  ++counters_.hits;
  lru_.splice(lru_.begin(), lru_, it->second);
  return it->second->prefix;
}

bool CartridgeCache::contains(const std::string& id) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return index_.count(id) > 0;
}

void CartridgeCache::put(const std::string& id, PrefixPtr prefix) {
  TORCH_CHECK(prefix != nullptr, "CartridgeCache::put: no cartridge");
  const int64_t bytes = prefix->nbytes();
  std::lock_guard<std::mutex> lock(mutex_);
  int64_t replaced = 0;
  if (auto it = index_.find(id); it != index_.end()) replaced = it->second->bytes;
  // Plan the evictions first, so that a cartridge that cannot fit evicts nothing. An entry is
  // idle when the cache holds the only reference: no queued or running request uses it.
  int64_t need = bytes_ - replaced + bytes - budget_;
  std::vector<std::list<Entry>::iterator> victims;
  for (auto it = lru_.rbegin(); need > 0 && it != lru_.rend(); ++it) {
    if (it->id == id || it->prefix.use_count() > 1) continue;
    victims.push_back(std::prev(it.base()));
    need -= it->bytes;
  }
  if (need > 0) {
    throw CacheFullError("the cartridge needs " + std::to_string(bytes) + " bytes; the cartridge memory budget is " +
                         std::to_string(budget_) + " bytes and " + std::to_string(bytes_ - replaced) +
                         " are held by cartridges in use");
  }
  for (auto victim : victims) {
    bytes_ -= victim->bytes;
    index_.erase(victim->id);
    lru_.erase(victim);
    ++counters_.evictions;
  }
  if (auto it = index_.find(id); it != index_.end()) {
    bytes_ -= it->second->bytes;
    lru_.erase(it->second);
    index_.erase(it);
  }
  lru_.push_front(Entry{id, std::move(prefix), bytes});
  index_[id] = lru_.begin();
  bytes_ += bytes;
  ++counters_.loads;
}

bool CartridgeCache::remove(const std::string& id) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = index_.find(id);
  if (it == index_.end()) return false;
  bytes_ -= it->second->bytes;
  lru_.erase(it->second);
  index_.erase(it);
  return true;
}

std::vector<std::string> CartridgeCache::ids() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<std::string> out;
  for (const auto& e : lru_) out.push_back(e.id);
  return out;
}

CartridgeCacheStats CartridgeCache::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto s = counters_;
  s.entries = static_cast<int64_t>(lru_.size());
  s.bytes = bytes_;
  return s;
}

}  // namespace cartridges
