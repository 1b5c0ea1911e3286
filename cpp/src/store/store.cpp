// The store: database metadata (SQLite or PostgreSQL) + blob files. See cartridges/store.h for the on-disk layout.
#include "cartridges/store.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <ctime>
#include <stdexcept>
#include <unordered_set>

#include "store/blob_io.h"
#include "store/common.h"
#include "store/schema.h"
#include "store/sql.h"

namespace cartridges {

namespace {

using sql::Stmt;
using sql::Transaction;

constexpr size_t kBlobIdChars = 32;
constexpr size_t kReadChunk = 1 << 20;
constexpr int64_t kMaxListLimit = 10000;

using store_common::BlobGuard;
using store_common::now;

std::vector<std::string> blob_ids(sql::Connection& db) {
  std::vector<std::string> ids;
  Stmt s(db, "SELECT id FROM blobs");
  while (s.step()) ids.push_back(s.text(0));
  return ids;
}

}  // namespace

namespace store_common {

void check_name(const std::string& name, const std::string& what) {
  bool ok = !name.empty() && name.size() <= 64;
  for (char c : name) {
    ok = ok && (std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-');
  }
  if (!ok) throw std::invalid_argument("invalid " + what + " '" + name + "': use 1 to 64 characters [A-Za-z0-9._-]");
}

void check_list_limit(int64_t limit) {
  if (limit < 1 || limit > kMaxListLimit) throw std::invalid_argument("limit must be between 1 and 10000");
}

std::string page_clause(const std::string& table, bool cursor, bool descending) {
  const std::string order = table + "created_at, " + table + "seq";
  std::string out;
  if (cursor) out += " AND (" + order + (descending ? ") < (?4, ?5)" : ") > (?4, ?5)");
  const char* dir = descending ? " DESC" : " ASC";
  return out + " ORDER BY " + table + "created_at" + dir + ", " + table + "seq" + dir + " LIMIT ?6";
}

}  // namespace store_common

Store::Store(StoreOptions options) : options_(std::move(options)) {
  if (options_.data_dir.empty()) throw std::invalid_argument("StoreOptions.data_dir is required");
  while (options_.data_dir.size() > 1 && options_.data_dir.back() == '/') options_.data_dir.pop_back();
  const std::string& dir = options_.data_dir;
  store_io::make_dirs(dir + "/blobs/tmp");
  store_io::make_dirs(dir + "/jobs");

  const std::string lock_path = dir + "/store.lock";
  lock_fd_ = ::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (lock_fd_ < 0) throw StoreError(store_io::errno_message("cannot open", lock_path));
  // Exclusive if nobody else has the directory open: only then is sweeping safe.
  const bool exclusive = ::flock(lock_fd_, LOCK_EX | LOCK_NB) == 0;
  if (!exclusive) ::flock(lock_fd_, LOCK_SH);

  const std::string& url = options_.database_url;
  const bool postgres = url.rfind("postgresql://", 0) == 0 || url.rfind("postgres://", 0) == 0;
  std::string db_name = dir + "/store.db";
  if (url.rfind("sqlite:///", 0) == 0) {
    db_name = url.substr(std::string("sqlite://").size());
  } else if (postgres) {
    db_name = "the PostgreSQL database";  // never the URL: it may hold a password
  } else if (!url.empty()) {
    ::close(lock_fd_);
    lock_fd_ = -1;
    throw std::invalid_argument("database_url must be empty, sqlite:///<path> or postgresql://...: '" + url + "'");
  }
  try {
    db_ = postgres ? sql::open_postgres(url, options_) : sql::open_sqlite(db_name, options_);
    db_name = db_->describe();
    migrate();
    if (exclusive) swept_ = sweep();
  } catch (const StoreError& e) {
    close();
    // Keep the subclass (CorruptError stays CorruptError) and name the database.
    if (dynamic_cast<const CorruptError*>(&e)) throw CorruptError(db_name + ": " + e.what());
    if (dynamic_cast<const UnavailableError*>(&e)) throw;  // names the database already
    throw StoreError(db_name + ": " + e.what());
  } catch (...) {
    close();
    throw;
  }
  if (exclusive) ::flock(lock_fd_, LOCK_SH);
}

Store::~Store() { close(); }

void Store::close() {
  std::lock_guard<std::mutex> lock(mutex_);
  db_.reset();
  if (lock_fd_ >= 0) {
    ::close(lock_fd_);  // releases the flock
    lock_fd_ = -1;
  }
}

sql::Connection& Store::db() {
  if (!db_) throw StoreError("store is closed");
  return *db_;
}

int Store::schema_version() {
  std::lock_guard<std::mutex> lock(mutex_);
  return static_cast<int>(db().schema_version());
}

void Store::ping() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    Stmt(db(), "SELECT 1").run();
  }
  if (options_.blob_mirror) options_.blob_mirror->check();
}

void Store::migrate() {
  const auto& all = schema::migrations(db_->dialect());
  db_->lock_schema();
  try {
    const int64_t version = db_->schema_version();
    if (version > static_cast<int64_t>(all.size())) {
      throw StoreError("database schema version " + std::to_string(version) + " is newer than this build knows (" +
                       std::to_string(all.size()) + ")");
    }
    for (size_t i = static_cast<size_t>(version); i < all.size(); ++i) {
      Transaction tx(*db_);
      db_->exec(all[i]);
      db_->set_schema_version(static_cast<int64_t>(i) + 1);
      tx.commit();
    }
  } catch (...) {
    db_->unlock_schema();
    throw;
  }
  db_->unlock_schema();
}

int64_t Store::sweep() {
  int64_t removed = 0;
  const std::string blobs = options_.data_dir + "/blobs";
  auto each_entry = [](const std::string& path, auto&& fn) {
    DIR* d = ::opendir(path.c_str());
    if (!d) throw StoreError(store_io::errno_message("cannot list", path));
    while (dirent* e = ::readdir(d)) {
      std::string name = e->d_name;
      if (name != "." && name != "..") fn(name);
    }
    ::closedir(d);
  };
  each_entry(blobs + "/tmp", [&](const std::string& name) {
    if (::unlink((blobs + "/tmp/" + name).c_str()) == 0) ++removed;
  });
  const std::vector<std::string> ids = blob_ids(*db_);
  const std::unordered_set<std::string> recorded(ids.begin(), ids.end());
  each_entry(blobs, [&](const std::string& name) {
    if (name == "tmp" || recorded.count(name)) return;
    struct stat st {};
    std::string path = blobs + "/" + name;
    if (::lstat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode) && ::unlink(path.c_str()) == 0) ++removed;
  });
  return removed + sweep_job_dirs();
}

// ---- users and keys ----

User Store::create_user(const std::string& name) {
  store_common::check_name(name, "user name");
  std::lock_guard<std::mutex> lock(mutex_);
  User user{0, name, now()};
  try {
    Stmt insert(db(), "INSERT INTO users (name, created_at) VALUES (?1, ?2) RETURNING id");
    insert.bind(1, name).bind(2, user.created_at).step();
    user.id = insert.int64(0);
    insert.run();
  } catch (const ConflictError&) {
    throw ConflictError("user '" + name + "' already exists");
  }
  return user;
}

std::optional<User> Store::find_user(const std::string& name) {
  std::lock_guard<std::mutex> lock(mutex_);
  Stmt s(db(), "SELECT id, name, created_at FROM users WHERE name = ?1");
  s.bind(1, name);
  if (!s.step()) return std::nullopt;
  return User{s.int64(0), s.text(1), s.int64(2)};
}

std::vector<std::string> Store::recorded_blobs() {
  std::lock_guard<std::mutex> lock(mutex_);
  return blob_ids(db());
}

std::vector<User> Store::list_users() {
  std::lock_guard<std::mutex> lock(mutex_);
  Stmt s(db(), "SELECT id, name, created_at FROM users ORDER BY id");
  std::vector<User> out;
  while (s.step()) out.push_back(User{s.int64(0), s.text(1), s.int64(2)});
  return out;
}

ApiKeyInfo Store::add_key(int64_t user_id, const std::string& key_hash, const std::string& hint) {
  if (key_hash.size() < 32) throw std::invalid_argument("key_hash must be a hex digest");
  std::lock_guard<std::mutex> lock(mutex_);
  Stmt u(db(), "SELECT name FROM users WHERE id = ?1");
  u.bind(1, user_id);
  if (!u.step()) throw NotFoundError("No such user: " + std::to_string(user_id));
  ApiKeyInfo info{0, user_id, u.text(0), hint, now(), std::nullopt};
  try {
    Stmt insert(db(), "INSERT INTO api_keys (user_id, key_hash, hint, created_at) VALUES (?1, ?2, ?3, ?4) RETURNING id");
    insert.bind(1, user_id).bind(2, key_hash).bind(3, hint).bind(4, info.created_at).step();
    info.id = insert.int64(0);
    insert.run();
  } catch (const ConflictError&) {
    throw ConflictError("this key is already registered");
  }
  return info;
}

std::optional<User> Store::user_for_key(const std::string& key_hash) {
  std::lock_guard<std::mutex> lock(mutex_);
  Stmt s(db(),
         "SELECT u.id, u.name, u.created_at FROM api_keys k JOIN users u ON u.id = k.user_id "
         "WHERE k.key_hash = ?1 AND k.revoked_at IS NULL");
  s.bind(1, key_hash);
  if (!s.step()) return std::nullopt;
  return User{s.int64(0), s.text(1), s.int64(2)};
}

std::vector<ApiKeyInfo> Store::list_keys() {
  std::lock_guard<std::mutex> lock(mutex_);
  Stmt s(db(),
         "SELECT k.id, k.user_id, u.name, k.hint, k.created_at, k.revoked_at FROM api_keys k "
         "JOIN users u ON u.id = k.user_id ORDER BY k.id");
  std::vector<ApiKeyInfo> out;
  while (s.step()) out.push_back(ApiKeyInfo{s.int64(0), s.int64(1), s.text(2), s.text(3), s.int64(4), s.opt_int64(5)});
  return out;
}

void Store::revoke_key(int64_t key_id) {
  std::lock_guard<std::mutex> lock(mutex_);
  Stmt revoke(db(), "UPDATE api_keys SET revoked_at = ?1 WHERE id = ?2 AND revoked_at IS NULL");
  revoke.bind(1, now()).bind(2, key_id).run();
  if (revoke.changes() == 0) throw NotFoundError("No active key with id " + std::to_string(key_id));
}

// ---- blobs ----

std::unique_ptr<BlobWriter> Store::begin_blob() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    db();  // refuse on a closed store
  }
  std::string tmp = options_.data_dir + "/blobs/tmp/" + store_io::random_token(kBlobIdChars, store_io::kLowerHex);
  return std::unique_ptr<BlobWriter>(new BlobWriter(tmp, options_.sync));
}

std::string Store::blob_path(const std::string& blob_id) const { return options_.data_dir + "/blobs/" + blob_id; }

Store::BlobRef Store::commit_blob(BlobWriter& writer) {
  writer.finish();
  BlobRef ref{store_io::random_token(kBlobIdChars, store_io::kLowerHex), writer.bytes(), writer.crc32()};
  const std::string path = blob_path(ref.id);
  if (::rename(writer.tmp_path_.c_str(), path.c_str()) != 0) {
    std::string message = store_io::errno_message("cannot rename into", path);
    writer.abort();
    throw StoreError(message);
  }
  writer.tmp_path_.clear();  // now owned by the caller, who records or removes it
  try {
    if (options_.sync) store_io::fsync_dir(options_.data_dir + "/blobs");
    // Durable in the mirror before it is recorded: a record never names a blob only one
    // machine has.
    if (options_.blob_mirror) options_.blob_mirror->upload(ref.id, path);
  } catch (...) {
    ::unlink(path.c_str());
    throw;
  }
  return ref;
}

void Store::remove_blob_file(const std::string& blob_id) {
  // A failure leaves an unrecorded blob, which the next sweep removes (locally; the mirror's
  // copy then stays as an orphan).
  ::unlink(blob_path(blob_id).c_str());
  if (options_.blob_mirror) {
    try {
      options_.blob_mirror->remove(blob_id);
    } catch (const StoreError&) {
    }
  }
}

void Store::ensure_local(const BlobRef& blob, const std::string& what) const {
  const std::string path = blob_path(blob.id);
  if (!options_.blob_mirror || ::access(path.c_str(), F_OK) == 0) return;
  const std::string tmp =
      options_.data_dir + "/blobs/tmp/" + store_io::random_token(kBlobIdChars, store_io::kLowerHex);
  bool found = false;
  try {
    found = options_.blob_mirror->download(blob.id, tmp);
  } catch (...) {
    ::unlink(tmp.c_str());
    throw;
  }
  if (!found) {
    ::unlink(tmp.c_str());
    throw CorruptError(what + " is missing from the object store (blob " + blob.id + ")");
  }
  // Another reader may have fetched it meanwhile: the rename replaces a file of the same bytes.
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    std::string message = store_io::errno_message("cannot rename into", path);
    ::unlink(tmp.c_str());
    throw StoreError(message);
  }
}

void Store::insert_blob_locked(const BlobRef& blob) {
  Stmt(db(), "INSERT INTO blobs (id, bytes, crc32, created_at) VALUES (?1, ?2, ?3, ?4)")
      .bind(1, blob.id)
      .bind(2, blob.bytes)
      .bind(3, static_cast<int64_t>(blob.crc))
      .bind(4, now())
      .run();
}

std::string Store::checked_blob_path(const BlobRef& blob, const std::string& what) const {
  ensure_local(blob, what);
  const std::string path = blob_path(blob.id);
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) throw CorruptError(what + " is missing");
  if (st.st_size != blob.bytes) {
    throw CorruptError(what + " is damaged: expected " + std::to_string(blob.bytes) + " bytes, found " +
                       std::to_string(st.st_size));
  }
  return path;
}

BlobContent Store::content_of(const BlobRef& blob, const std::string& what) const {
  if (!options_.blob_mirror) return BlobContent{blob.id, blob.bytes, checked_blob_path(blob, what)};
  const std::string path = blob_path(blob.id);
  struct stat st {};
  const bool whole = ::stat(path.c_str(), &st) == 0 && st.st_size == blob.bytes;
  return BlobContent{blob.id, blob.bytes, whole ? path : std::string()};
}

std::string Store::read_blob(const BlobRef& blob, const std::string& what, bool keep) const {
  ensure_local(blob, what);
  const std::string path = blob_path(blob.id);
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw CorruptError(what + " is missing (blob " + blob.id + ")");
  std::string out;
  uint32_t crc = 0;
  int64_t total = 0;
  std::string chunk(kReadChunk, '\0');
  while (true) {
    ssize_t n = ::read(fd, chunk.data(), chunk.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      ::close(fd);
      throw CorruptError(store_io::errno_message(what + " cannot be read:", path));
    }
    if (n == 0) break;
    crc = store_io::crc32_update(crc, chunk.data(), static_cast<size_t>(n));
    total += n;
    if (total > blob.bytes) break;  // longer than recorded: damaged, stop reading
    if (keep) out.append(chunk.data(), static_cast<size_t>(n));
  }
  ::close(fd);
  if (total != blob.bytes) {
    throw CorruptError(what + " is damaged: expected " + std::to_string(blob.bytes) + " bytes, found " +
                       (total > blob.bytes ? "more" : std::to_string(total)));
  }
  if (crc != blob.crc) throw CorruptError(what + " is damaged: checksum mismatch");
  return out;
}

}  // namespace cartridges
