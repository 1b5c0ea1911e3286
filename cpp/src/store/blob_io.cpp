#include "store/blob_io.h"

#include <fcntl.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <cstring>

#include "cartridges/store.h"

namespace cartridges::store_io {

const std::string kAlphanumeric = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
const std::string kLowerHex = "0123456789abcdef";

namespace {

// Slicing-by-8 tables: tables[k][b] is the CRC of byte b followed by k zero bytes.
using Tables = std::array<std::array<uint32_t, 256>, 8>;

Tables make_tables() {
  Tables t{};
  for (uint32_t b = 0; b < 256; ++b) {
    uint32_t c = b;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (0xEDB88320u ^ (c >> 1)) : (c >> 1);
    t[0][b] = c;
  }
  for (uint32_t b = 0; b < 256; ++b) {
    for (int k = 1; k < 8; ++k) t[k][b] = (t[k - 1][b] >> 8) ^ t[0][t[k - 1][b] & 0xFF];
  }
  return t;
}

const Tables& tables() {
  static const Tables t = make_tables();
  return t;
}

}  // namespace

uint32_t crc32_update(uint32_t crc, const char* data, size_t size) {
  const Tables& t = tables();
  const auto* p = reinterpret_cast<const unsigned char*>(data);
  uint32_t c = ~crc;
  while (size >= 8) {
    uint32_t lo, hi;
    std::memcpy(&lo, p, 4);  // little-endian hosts only (x86-64, aarch64)
    std::memcpy(&hi, p + 4, 4);
    lo ^= c;
    c = t[7][lo & 0xFF] ^ t[6][(lo >> 8) & 0xFF] ^ t[5][(lo >> 16) & 0xFF] ^ t[4][lo >> 24] ^
        t[3][hi & 0xFF] ^ t[2][(hi >> 8) & 0xFF] ^ t[1][(hi >> 16) & 0xFF] ^ t[0][hi >> 24];
    p += 8;
    size -= 8;
  }
  while (size--) c = t[0][(c ^ *p++) & 0xFF] ^ (c >> 8);
  return ~c;
}

std::string random_token(size_t length, const std::string& alphabet) {
  std::string out;
  out.reserve(length);
  const size_t n = alphabet.size();
  const unsigned limit = 256 - (256 % n);  // rejection sampling: no modulo bias
  unsigned char buf[64];
  while (out.size() < length) {
    ssize_t got = getrandom(buf, sizeof(buf), 0);
    if (got < 0) {
      if (errno == EINTR) continue;
      throw StoreError(std::string("getrandom failed: ") + std::strerror(errno));
    }
    for (ssize_t i = 0; i < got && out.size() < length; ++i) {
      if (buf[i] < limit) out.push_back(alphabet[buf[i] % n]);
    }
  }
  return out;
}

std::string errno_message(const std::string& what, const std::string& path) {
  return what + " " + path + ": " + std::strerror(errno);
}

void make_dirs(const std::string& path) {
  for (size_t pos = 1; pos <= path.size(); ++pos) {
    if (pos != path.size() && path[pos] != '/') continue;
    std::string prefix = path.substr(0, pos);
    if (::mkdir(prefix.c_str(), 0755) != 0 && errno != EEXIST) throw StoreError(errno_message("cannot create", prefix));
  }
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) throw StoreError("not a directory: " + path);
}

void fsync_dir(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) throw StoreError(errno_message("cannot open directory", path));
  int rc = ::fsync(fd);
  int saved = errno;
  ::close(fd);
  errno = saved;
  if (rc != 0) throw StoreError(errno_message("fsync failed for", path));
}

}  // namespace cartridges::store_io

namespace cartridges {

BlobWriter::BlobWriter(std::string tmp_path, bool sync) : tmp_path_(std::move(tmp_path)), sync_(sync) {
  fd_ = ::open(tmp_path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd_ < 0) throw StoreError(store_io::errno_message("cannot create", tmp_path_));
}

BlobWriter::~BlobWriter() { abort(); }

void BlobWriter::write(const char* data, size_t size) {
  if (fd_ < 0) throw StoreError("blob writer is closed");
  crc_ = store_io::crc32_update(crc_, data, size);
  while (size > 0) {
    ssize_t n = ::write(fd_, data, size);
    if (n < 0) {
      if (errno == EINTR) continue;
      std::string message = store_io::errno_message("write failed for", tmp_path_);
      abort();
      throw StoreError(message);
    }
    data += n;
    size -= static_cast<size_t>(n);
    bytes_ += n;
  }
}

void BlobWriter::abort() {
  if (fd_ >= 0) {
    ::close(fd_);
    fd_ = -1;
  }
  if (!tmp_path_.empty()) {
    ::unlink(tmp_path_.c_str());
    tmp_path_.clear();
  }
}

void BlobWriter::finish() {
  if (fd_ < 0) throw StoreError("blob writer is closed");
  if (sync_ && ::fsync(fd_) != 0) {
    std::string message = store_io::errno_message("fsync failed for", tmp_path_);
    abort();
    throw StoreError(message);
  }
  int rc = ::close(fd_);
  fd_ = -1;
  if (rc != 0) {
    std::string message = store_io::errno_message("close failed for", tmp_path_);
    abort();
    throw StoreError(message);
  }
}

}  // namespace cartridges
