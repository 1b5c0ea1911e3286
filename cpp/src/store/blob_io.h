#pragma once
// File-system helpers of the store: checksums, random names, durable writes.

#include <cstddef>
#include <cstdint>
#include <string>

namespace cartridges::store_io {

// CRC-32 (IEEE 802.3, as zlib's crc32), continued from `crc` (0 to start).
uint32_t crc32_update(uint32_t crc, const char* data, size_t size);

// `length` characters drawn uniformly from `alphabet` with the kernel's CSPRNG.
std::string random_token(size_t length, const std::string& alphabet);
extern const std::string kAlphanumeric;  // [A-Za-z0-9]
extern const std::string kLowerHex;      // [0-9a-f]

// mkdir -p; throws StoreError naming the path.
void make_dirs(const std::string& path);
// fsync of a directory, so that a rename inside it survives a crash.
void fsync_dir(const std::string& path);
// "<what> <path>: <strerror(errno)>"
std::string errno_message(const std::string& what, const std::string& path);

}  // namespace cartridges::store_io
