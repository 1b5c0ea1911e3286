#pragma once
// The database a store test runs on: the store suites are parametrized over both backends.
//   "sqlite":     the store's own file, data_dir/store.db
//   "postgresql": a fresh database on the server named by CARTRIDGES_TEST_POSTGRES_URL (an
//                 admin URL; `make test` starts a throwaway server, tests/postgres_server.py),
//                 dropped when the test ends. Without the variable those cases are skipped
//                 with the reason.

#include <libpq-fe.h>
#include <sqlite3.h>

#include <cstdlib>
#include <filesystem>
#include <string>

#include "store/blob_io.h"

namespace cartridges::store_testing {

class TestDatabase {
 public:
  TestDatabase(const std::string& backend, const std::filesystem::path& dir) : backend_(backend), dir_(dir) {
    if (backend != "postgresql") return;
    const char* admin = std::getenv("CARTRIDGES_TEST_POSTGRES_URL");
    if (!admin || !*admin) {
      skip_reason = "CARTRIDGES_TEST_POSTGRES_URL is not set (make test starts a PostgreSQL server)";
      return;
    }
    admin_url_ = admin;
    name_ = "t_" + store_io::random_token(16, store_io::kLowerHex);
    std::string error = run(admin_url_, "CREATE DATABASE " + name_);
    if (!error.empty()) {
      skip_reason = "cannot create a test database: " + error;
      name_.clear();
      return;
    }
    url = admin_url_.substr(0, admin_url_.rfind('/') + 1) + name_;
  }
  ~TestDatabase() {
    if (!name_.empty()) run(admin_url_, "DROP DATABASE IF EXISTS " + name_ + " WITH (FORCE)");
  }
  TestDatabase(const TestDatabase&) = delete;
  TestDatabase& operator=(const TestDatabase&) = delete;

  bool postgres() const { return backend_ == "postgresql"; }

  // Runs SQL on the database directly, outside the store (for tests that tamper with it);
  // returns "" or the error message.
  std::string exec(const std::string& sql) const {
    if (postgres()) return run(url, sql);
    sqlite3* db = nullptr;
    std::string error;
    if (sqlite3_open((dir_ / "store.db").c_str(), &db) != SQLITE_OK ||
        sqlite3_exec(db, sql.c_str(), nullptr, nullptr, nullptr) != SQLITE_OK) {
      error = sqlite3_errmsg(db);
    }
    sqlite3_close(db);
    return error;
  }

  std::string skip_reason;  // non-empty: this backend cannot be tested here
  std::string url;          // StoreOptions::database_url ("" for SQLite in the data directory)

 private:
  static std::string run(const std::string& conninfo, const std::string& sql) {
    PGconn* conn = PQconnectdb(conninfo.c_str());
    std::string error;
    if (PQstatus(conn) != CONNECTION_OK) {
      error = PQerrorMessage(conn);
    } else {
      PGresult* r = PQexec(conn, sql.c_str());
      if (PQresultStatus(r) != PGRES_COMMAND_OK && PQresultStatus(r) != PGRES_TUPLES_OK) error = PQresultErrorMessage(r);
      PQclear(r);
    }
    PQfinish(conn);
    return error;
  }

  std::string backend_;
  std::filesystem::path dir_;
  std::string admin_url_;
  std::string name_;
};

}  // namespace cartridges::store_testing
