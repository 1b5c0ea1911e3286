#pragma once
// A thin RAII layer over the SQLite C API: statements, transactions, errors as StoreError.

#include <sqlite3.h>

#include <cstdint>
#include <optional>
#include <string>

namespace cartridges::sql {

// Throws the StoreError subclass matching SQLite's result code: ConflictError for a unique
// constraint, CorruptError for a damaged database file, StoreError otherwise.
[[noreturn]] void fail(sqlite3* db, int rc, const std::string& context);

void exec(sqlite3* db, const char* sql);

class Stmt {
 public:
  Stmt(sqlite3* db, const char* sql);
  ~Stmt();
  Stmt(const Stmt&) = delete;
  Stmt& operator=(const Stmt&) = delete;

  Stmt& bind(int index, int64_t value);
  Stmt& bind(int index, const std::string& value);
  Stmt& bind(int index, const std::optional<std::string>& value);
  // true while a row is available; false when done.
  bool step();
  // Runs a statement that returns no rows.
  void run() { while (step()) {} }

  int64_t int64(int column) const;
  std::string text(int column) const;
  std::optional<std::string> opt_text(int column) const;
  std::optional<int64_t> opt_int64(int column) const;

 private:
  sqlite3* db_;
  sqlite3_stmt* stmt_ = nullptr;
};

// BEGIN IMMEDIATE ... COMMIT; rolls back when destroyed uncommitted.
class Transaction {
 public:
  explicit Transaction(sqlite3* db);
  ~Transaction();
  void commit();

 private:
  sqlite3* db_;
  bool done_ = false;
};

}  // namespace cartridges::sql
