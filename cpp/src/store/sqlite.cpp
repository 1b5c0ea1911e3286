#include "store/sqlite.h"

#include "cartridges/store.h"

namespace cartridges::sql {

void fail(sqlite3* db, int rc, const std::string& context) {
  std::string message = context + ": " + (db ? sqlite3_errmsg(db) : sqlite3_errstr(rc));
  int primary = rc & 0xFF;
  if (rc == SQLITE_CONSTRAINT_UNIQUE || rc == SQLITE_CONSTRAINT_PRIMARYKEY) throw ConflictError(message);
  if (primary == SQLITE_CORRUPT || primary == SQLITE_NOTADB) throw CorruptError("database damaged: " + message);
  throw StoreError(message);
}

void exec(sqlite3* db, const char* sql) {
  char* error = nullptr;
  int rc = sqlite3_exec(db, sql, nullptr, nullptr, &error);
  sqlite3_free(error);
  if (rc != SQLITE_OK) fail(db, sqlite3_extended_errcode(db), "sql failed");
}

Stmt::Stmt(sqlite3* db, const char* sql) : db_(db) {
  int rc = sqlite3_prepare_v2(db, sql, -1, &stmt_, nullptr);
  if (rc != SQLITE_OK) fail(db, sqlite3_extended_errcode(db), "prepare failed");
}

Stmt::~Stmt() { sqlite3_finalize(stmt_); }

Stmt& Stmt::bind(int index, int64_t value) {
  if (sqlite3_bind_int64(stmt_, index, value) != SQLITE_OK) fail(db_, sqlite3_extended_errcode(db_), "bind failed");
  return *this;
}

Stmt& Stmt::bind(int index, const std::string& value) {
  int rc = sqlite3_bind_text(stmt_, index, value.data(), static_cast<int>(value.size()), SQLITE_TRANSIENT);
  if (rc != SQLITE_OK) fail(db_, sqlite3_extended_errcode(db_), "bind failed");
  return *this;
}

Stmt& Stmt::bind(int index, const std::optional<std::string>& value) {
  if (value) return bind(index, *value);
  if (sqlite3_bind_null(stmt_, index) != SQLITE_OK) fail(db_, sqlite3_extended_errcode(db_), "bind failed");
  return *this;
}

bool Stmt::step() {
  int rc = sqlite3_step(stmt_);
  if (rc == SQLITE_ROW) return true;
  if (rc == SQLITE_DONE) return false;
  fail(db_, sqlite3_extended_errcode(db_), "statement failed");
}

int64_t Stmt::int64(int column) const { return sqlite3_column_int64(stmt_, column); }

std::string Stmt::text(int column) const {
  const auto* p = reinterpret_cast<const char*>(sqlite3_column_text(stmt_, column));
  return p ? std::string(p, static_cast<size_t>(sqlite3_column_bytes(stmt_, column))) : std::string();
}

std::optional<std::string> Stmt::opt_text(int column) const {
  if (sqlite3_column_type(stmt_, column) == SQLITE_NULL) return std::nullopt;
  return text(column);
}

std::optional<int64_t> Stmt::opt_int64(int column) const {
  if (sqlite3_column_type(stmt_, column) == SQLITE_NULL) return std::nullopt;
  return int64(column);
}

Transaction::Transaction(sqlite3* db) : db_(db) { exec(db_, "BEGIN IMMEDIATE"); }

Transaction::~Transaction() {
  if (!done_) sqlite3_exec(db_, "ROLLBACK", nullptr, nullptr, nullptr);
}

void Transaction::commit() {
  exec(db_, "COMMIT");
  done_ = true;
}

}  // namespace cartridges::sql
