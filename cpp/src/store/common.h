#pragma once
// Helpers shared by the store's translation units (store.cpp, files.cpp, datablocks.cpp).

#include <unistd.h>

#include <cstdint>
#include <ctime>
#include <string>

namespace cartridges::store_common {

inline int64_t now() { return static_cast<int64_t>(std::time(nullptr)); }

// [A-Za-z0-9._-]{1,64} (user and project names); std::invalid_argument naming `what`.
void check_name(const std::string& name, const std::string& what);
// List pages hold 1..10000 entries; std::invalid_argument otherwise.
void check_list_limit(int64_t limit);
// The tail of a cursor-paginated SELECT ordered by (created_at, seq): the cursor condition
// (binds ?4, ?5) when `cursor`, the order, and LIMIT ?6. `table` prefixes the columns ("d.").
std::string page_clause(const std::string& table, bool cursor, bool descending);

// Removes a committed-but-unrecorded blob unless disarmed: keeps the "no row, no blob" rule
// when recording fails.
class BlobGuard {
 public:
  explicit BlobGuard(std::string path) : path_(std::move(path)) {}
  ~BlobGuard() {
    if (!path_.empty()) ::unlink(path_.c_str());
  }
  BlobGuard(const BlobGuard&) = delete;
  BlobGuard& operator=(const BlobGuard&) = delete;
  void disarm() { path_.clear(); }

 private:
  std::string path_;
};

}  // namespace cartridges::store_common
