#pragma once
// The store's database connection, one interface over two engines: SQLite (the embedded
// default, a file in the data directory) and PostgreSQL (a server that several replicas
// share). The store's SQL is written once, in the subset both accept, with numbered
// parameters ?1, ?2, ... (rewritten to $1, $2, ... for PostgreSQL). Errors surface as the
// StoreError subclasses of cartridges/store.h.

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

namespace cartridges {
struct StoreOptions;
}

namespace cartridges::sql {

enum class Dialect { sqlite, postgresql };

// One statement's execution: parameters bound, then rows stepped through.
class Cursor {
 public:
  virtual ~Cursor() = default;
  virtual void bind_int64(int index, int64_t value) = 0;
  virtual void bind_text(int index, const std::string& value) = 0;
  virtual void bind_null(int index) = 0;
  // true while a row is available; false when done. The statement runs on the first call.
  virtual bool step() = 0;
  virtual bool is_null(int column) const = 0;
  virtual int64_t int64(int column) const = 0;
  virtual std::string text(int column) const = 0;
  // Rows inserted, updated or deleted by the statement (after it ran).
  virtual int64_t changes() const = 0;
};

class Connection {
 public:
  virtual ~Connection() = default;
  virtual Dialect dialect() const = 0;
  virtual std::unique_ptr<Cursor> prepare(const std::string& sql) = 0;
  // One or more statements without parameters or rows.
  virtual void exec(const std::string& sql) = 0;
  // A write transaction. Writers are serialized store-wide (SQLite: BEGIN IMMEDIATE;
  // PostgreSQL: a transaction-scoped advisory lock), so every read-then-write the store does
  // inside one sees no other writer, on one replica or many.
  virtual void begin() = 0;
  virtual void commit() = 0;
  virtual void rollback() noexcept = 0;
  // The schema version and the lock that migrations run under (several replicas may start
  // at once against one PostgreSQL database).
  virtual void lock_schema() = 0;
  virtual void unlock_schema() noexcept = 0;
  virtual int64_t schema_version() = 0;
  virtual void set_schema_version(int64_t version) = 0;  // inside the migration's transaction
  // The database named for messages: a file path, or host/database (never a password).
  virtual std::string describe() const = 0;
};

// Opens the SQLite file at `path` (created if missing) with the options' sync, busy timeout
// and integrity check.
std::unique_ptr<Connection> open_sqlite(const std::string& path, const StoreOptions& options);
// Connects to a PostgreSQL server by a libpq URL (postgresql://user:password@host:port/db);
// UnavailableError when it cannot be reached.
std::unique_ptr<Connection> open_postgres(const std::string& url, const StoreOptions& options);

// A statement as the store writes it: `Stmt(db, "... ?1 ...").bind(1, x).run()`.
class Stmt {
 public:
  Stmt(Connection& db, const std::string& sql) : cursor_(db.prepare(sql)) {}

  Stmt& bind(int index, int64_t value) {
    cursor_->bind_int64(index, value);
    return *this;
  }
  Stmt& bind(int index, const std::string& value) {
    cursor_->bind_text(index, value);
    return *this;
  }
  Stmt& bind(int index, const std::optional<std::string>& value) {
    if (value) return bind(index, *value);
    cursor_->bind_null(index);
    return *this;
  }
  bool step() { return cursor_->step(); }
  // Runs a statement whose rows, if any, are not needed.
  void run() {
    while (step()) {
    }
  }
  int64_t changes() const { return cursor_->changes(); }

  int64_t int64(int column) const { return cursor_->int64(column); }
  std::string text(int column) const { return cursor_->text(column); }
  std::optional<std::string> opt_text(int column) const {
    if (cursor_->is_null(column)) return std::nullopt;
    return cursor_->text(column);
  }
  std::optional<int64_t> opt_int64(int column) const {
    if (cursor_->is_null(column)) return std::nullopt;
    return cursor_->int64(column);
  }

 private:
  std::unique_ptr<Cursor> cursor_;
};

// begin() ... commit(); rolls back when destroyed uncommitted.
class Transaction {
 public:
  explicit Transaction(Connection& db) : db_(db) { db_.begin(); }
  ~Transaction() {
    if (!done_) db_.rollback();
  }
  Transaction(const Transaction&) = delete;
  Transaction& operator=(const Transaction&) = delete;
  void commit() {
    db_.commit();
    done_ = true;
  }

 private:
  Connection& db_;
  bool done_ = false;
};

}  // namespace cartridges::sql
