// The store's SQLite connection: the embedded default, one file in the data directory.
#include <sqlite3.h>

#include "cartridges/store.h"
#include "store/sql.h"

namespace cartridges::sql {

namespace {

// Throws the StoreError subclass matching SQLite's result code: ConflictError for a unique
// constraint, CorruptError for a damaged database file, StoreError otherwise.
[[noreturn]] void fail(sqlite3* db, int rc, const std::string& context) {
  std::string message = context + ": " + (db ? sqlite3_errmsg(db) : sqlite3_errstr(rc));
  int primary = rc & 0xFF;
  if (rc == SQLITE_CONSTRAINT_UNIQUE || rc == SQLITE_CONSTRAINT_PRIMARYKEY) throw ConflictError(message);
  if (primary == SQLITE_CORRUPT || primary == SQLITE_NOTADB) throw CorruptError("database damaged: " + message);
  throw StoreError(message);
}

class SqliteCursor final : public Cursor {
 public:
  SqliteCursor(sqlite3* db, const std::string& sql) : db_(db) {
    int rc = sqlite3_prepare_v2(db, sql.c_str(), static_cast<int>(sql.size()), &stmt_, nullptr);
    if (rc != SQLITE_OK) fail(db, sqlite3_extended_errcode(db), "prepare failed");
  }
  ~SqliteCursor() override { sqlite3_finalize(stmt_); }

  void bind_int64(int index, int64_t value) override { check(sqlite3_bind_int64(stmt_, index, value)); }
  void bind_text(int index, const std::string& value) override {
    check(sqlite3_bind_text(stmt_, index, value.data(), static_cast<int>(value.size()), SQLITE_TRANSIENT));
  }
  void bind_null(int index) override { check(sqlite3_bind_null(stmt_, index)); }

  bool step() override {
    int rc = sqlite3_step(stmt_);
    if (rc == SQLITE_ROW) return true;
    if (rc == SQLITE_DONE) {
      changes_ = sqlite3_changes(db_);
      return false;
    }
    fail(db_, sqlite3_extended_errcode(db_), "statement failed");
  }
  bool is_null(int column) const override { return sqlite3_column_type(stmt_, column) == SQLITE_NULL; }
  int64_t int64(int column) const override { return sqlite3_column_int64(stmt_, column); }
  std::string text(int column) const override {
    const auto* p = reinterpret_cast<const char*>(sqlite3_column_text(stmt_, column));
    return p ? std::string(p, static_cast<size_t>(sqlite3_column_bytes(stmt_, column))) : std::string();
  }
  int64_t changes() const override { return changes_; }

 private:
  void check(int rc) {
    if (rc != SQLITE_OK) fail(db_, sqlite3_extended_errcode(db_), "bind failed");
  }

  sqlite3* db_;
  sqlite3_stmt* stmt_ = nullptr;
  int64_t changes_ = 0;
};

class SqliteConnection final : public Connection {
 public:
  SqliteConnection(const std::string& path, const StoreOptions& options) : path_(path) {
    int rc = sqlite3_open_v2(path.c_str(), &db_, SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE, nullptr);
    if (rc != SQLITE_OK) {
      // The handle exists even on failure (unless out of memory) and must be closed.
      std::string message = db_ ? sqlite3_errmsg(db_) : sqlite3_errstr(rc);
      sqlite3_close_v2(db_);
      db_ = nullptr;
      throw StoreError("cannot open database: " + message);
    }
    sqlite3_extended_result_codes(db_, 1);
    sqlite3_busy_timeout(db_, options.busy_timeout_ms);
    exec("PRAGMA journal_mode = WAL");
    exec("PRAGMA foreign_keys = ON");
    exec(options.sync ? "PRAGMA synchronous = FULL" : "PRAGMA synchronous = OFF");
    if (options.check_at_open) {
      SqliteCursor check(db_, "PRAGMA quick_check");
      std::string problems;
      while (check.step()) {
        std::string row = check.text(0);
        if (row != "ok") problems += (problems.empty() ? "" : "; ") + row;
      }
      if (!problems.empty()) throw CorruptError("database damaged: " + problems);
    }
  }
  ~SqliteConnection() override { sqlite3_close_v2(db_); }

  Dialect dialect() const override { return Dialect::sqlite; }
  std::unique_ptr<Cursor> prepare(const std::string& sql) override { return std::make_unique<SqliteCursor>(db_, sql); }
  void exec(const std::string& sql) override {
    char* error = nullptr;
    int rc = sqlite3_exec(db_, sql.c_str(), nullptr, nullptr, &error);
    sqlite3_free(error);
    if (rc != SQLITE_OK) fail(db_, sqlite3_extended_errcode(db_), "sql failed");
  }
  void begin() override { exec("BEGIN IMMEDIATE"); }
  void commit() override { exec("COMMIT"); }
  void rollback() noexcept override { sqlite3_exec(db_, "ROLLBACK", nullptr, nullptr, nullptr); }
  // BEGIN IMMEDIATE already serializes the migration's writers.
  void lock_schema() override {}
  void unlock_schema() noexcept override {}
  int64_t schema_version() override {
    SqliteCursor s(db_, "PRAGMA user_version");
    s.step();
    return s.int64(0);
  }
  void set_schema_version(int64_t version) override { exec("PRAGMA user_version = " + std::to_string(version)); }
  std::string describe() const override { return path_; }

 private:
  std::string path_;
  sqlite3* db_ = nullptr;
};

}  // namespace

std::unique_ptr<Connection> open_sqlite(const std::string& path, const StoreOptions& options) {
  return std::make_unique<SqliteConnection>(path, options);
}

}  // namespace cartridges::sql
