// The store's PostgreSQL connection (libpq): one database that several replicas share.
#include <libpq-fe.h>
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <set>
#include <stdexcept>
#include <vector>

#include "cartridges/store.h"
#include "store/sql.h"

namespace cartridges::sql {

namespace {

// Advisory lock keys ("cart" and "schm" in ASCII): every writing transaction takes the first,
// migrations the second.
constexpr int64_t kWriteLock = 0x63617274;
constexpr int64_t kSchemaLock = 0x7363686d;
constexpr unsigned kTextOid = 25;

// "?1 ... ?12" → "$1 ... $12" outside quoted literals and identifiers; records which
// parameters the statement names (an unnamed one is sent typed as text, which PostgreSQL
// needs for a parameter it cannot infer).
std::string rewrite_parameters(const std::string& sql, std::set<int>& named) {
  std::string out;
  out.reserve(sql.size());
  char quote = 0;
  for (size_t i = 0; i < sql.size(); ++i) {
    char c = sql[i];
    if (quote) {
      out += c;
      if (c == quote) quote = 0;  // a doubled quote reopens at the next character
      continue;
    }
    if (c == '\'' || c == '"') {
      quote = c;
      out += c;
      continue;
    }
    if (c == '?') {
      size_t j = i + 1;
      while (j < sql.size() && sql[j] >= '0' && sql[j] <= '9') ++j;
      if (j == i + 1) throw std::invalid_argument("the store's SQL uses numbered parameters (?1), not '?'");
      named.insert(std::stoi(sql.substr(i + 1, j - i - 1)));
      out += '$';
      out.append(sql, i + 1, j - i - 1);
      i = j - 1;
      continue;
    }
    out += c;
  }
  return out;
}

bool connection_lost(const char* sqlstate) {
  if (!sqlstate) return true;
  const std::string s = sqlstate;
  // 08: connection exceptions; 57P0x: the server shutting down or starting; 53: out of
  // resources (too many connections); 57014 / 55P03: a statement or lock timeout.
  return s.rfind("08", 0) == 0 || s.rfind("57P0", 0) == 0 || s.rfind("53", 0) == 0 || s == "57014" || s == "55P03";
}

class PgResult {
 public:
  explicit PgResult(PGresult* r = nullptr) : r_(r) {}
  ~PgResult() { PQclear(r_); }
  PgResult(const PgResult&) = delete;
  PgResult& operator=(const PgResult&) = delete;
  PgResult& operator=(PgResult&& other) noexcept {
    std::swap(r_, other.r_);
    return *this;
  }
  PGresult* get() const { return r_; }

 private:
  PGresult* r_;
};

class PgConnection;

class PgCursor final : public Cursor {
 public:
  PgCursor(PgConnection& db, const std::string& sql) : db_(db), sql_(rewrite_parameters(sql, named_)) {}

  void bind_int64(int index, int64_t value) override { slot(index) = std::to_string(value); }
  void bind_text(int index, const std::string& value) override { slot(index) = value; }
  void bind_null(int index) override { slot(index) = std::nullopt; }
  bool step() override;
  bool is_null(int column) const override { return PQgetisnull(result_.get(), row_, column) != 0; }
  int64_t int64(int column) const override {
    const char* v = PQgetvalue(result_.get(), row_, column);
    return std::strtoll(v, nullptr, 10);
  }
  std::string text(int column) const override {
    return std::string(PQgetvalue(result_.get(), row_, column),
                       static_cast<size_t>(PQgetlength(result_.get(), row_, column)));
  }
  int64_t changes() const override {
    const char* n = PQcmdTuples(result_.get());
    return n && *n ? std::strtoll(n, nullptr, 10) : 0;
  }

 private:
  std::optional<std::string>& slot(int index) {
    if (index < 1) throw std::invalid_argument("parameters are numbered from 1");
    if (static_cast<size_t>(index) > params_.size()) params_.resize(static_cast<size_t>(index));
    return params_[static_cast<size_t>(index) - 1];
  }

  PgConnection& db_;
  std::set<int> named_;
  std::string sql_;
  std::vector<std::optional<std::string>> params_;
  PgResult result_;
  bool ran_ = false;
  int row_ = -1;
};

class PgConnection final : public Connection {
 public:
  PgConnection(const std::string& url, const StoreOptions& options) {
    describe_ = "PostgreSQL";
    char* error = nullptr;
    if (PQconninfoOption* info = PQconninfoParse(url.c_str(), &error)) {
      std::string host, port, db;
      for (PQconninfoOption* o = info; o->keyword; ++o) {
        if (!o->val) continue;
        const std::string k = o->keyword;
        if (k == "host") host = o->val;
        if (k == "port") port = o->val;
        if (k == "dbname") db = o->val;
      }
      PQconninfoFree(info);
      describe_ = "postgresql://" + host + (port.empty() ? "" : ":" + port) + "/" + db;
    } else {
      std::string message = error ? error : "unparsable";
      PQfreemem(error);
      throw std::invalid_argument("invalid PostgreSQL URL: " + message);
    }
    // The URL's own settings win over these defaults (it expands in place of "dbname"). A
    // database cut off by the network (no reset ever arrives) is noticed by TCP keepalives
    // within about 25 s while a call waits, and by the TCP user timeout while data it sent goes
    // unacknowledged: the call then fails as UnavailableError (a 503) instead of hanging for
    // the kernel's retransmission time (15 minutes or more) with the store's lock held.
    const std::string timeout = std::to_string(std::max(1, options.busy_timeout_ms / 1000));
    const std::string user_timeout_ms = std::to_string(std::max(30000, 6 * options.busy_timeout_ms));
    const char* keywords[] = {"connect_timeout", "application_name", "keepalives", "keepalives_idle",
                              "keepalives_interval", "keepalives_count", "tcp_user_timeout", "dbname", nullptr};
    const char* values[] = {timeout.c_str(), "cartridges", "1", "10", "5", "3", user_timeout_ms.c_str(), url.c_str(),
                            nullptr};
    conn_ = PQconnectdbParams(keywords, values, 1);
    if (!conn_ || PQstatus(conn_) != CONNECTION_OK) {
      std::string message = conn_ ? PQerrorMessage(conn_) : "out of memory";
      PQfinish(conn_);
      conn_ = nullptr;
      throw UnavailableError("cannot reach the database " + describe_ + ": " + trim(message));
    }
    busy_timeout_ms_ = options.busy_timeout_ms;
    try {
      configure();
    } catch (...) {
      PQfinish(conn_);  // the destructor does not run for a constructor that throws
      throw;
    }
  }
  ~PgConnection() override { PQfinish(conn_); }

  Dialect dialect() const override { return Dialect::postgresql; }
  std::unique_ptr<Cursor> prepare(const std::string& sql) override { return std::make_unique<PgCursor>(*this, sql); }
  void exec(const std::string& sql) override {
    ensure_connected();
    PgResult r(reply_to(PQsendQuery(conn_, sql.c_str())));
    check(r.get(), "sql failed");
  }
  void begin() override {
    exec("BEGIN");
    in_transaction_ = true;
    try {
      exec("SELECT pg_advisory_xact_lock(" + std::to_string(kWriteLock) + ")");
    } catch (...) {
      rollback();
      throw;
    }
  }
  void commit() override {
    exec("COMMIT");
    in_transaction_ = false;
  }
  void rollback() noexcept override {
    in_transaction_ = false;
    if (!abandoned_ && PQstatus(conn_) == CONNECTION_OK) quietly("ROLLBACK");
  }
  void lock_schema() override { exec("SELECT pg_advisory_lock(" + std::to_string(kSchemaLock) + ")"); }
  void unlock_schema() noexcept override {
    if (!abandoned_ && PQstatus(conn_) == CONNECTION_OK) {
      quietly("SELECT pg_advisory_unlock(" + std::to_string(kSchemaLock) + ")");
    }
  }
  int64_t schema_version() override {
    exec("CREATE TABLE IF NOT EXISTS cartridges_schema (version BIGINT NOT NULL)");
    PgCursor s(*this, "SELECT max(version) FROM cartridges_schema");
    s.step();
    return s.is_null(0) ? 0 : s.int64(0);
  }
  void set_schema_version(int64_t version) override {
    exec("DELETE FROM cartridges_schema; INSERT INTO cartridges_schema (version) VALUES (" +
         std::to_string(version) + ")");
  }
  std::string describe() const override { return describe_; }

  // Reconnects a connection the server dropped, or one given up on while it waited for a
  // reply, unless a transaction was running on it (its work is lost: the caller's call fails
  // and the next one starts afresh).
  void ensure_connected() {
    if (!abandoned_ && PQstatus(conn_) == CONNECTION_OK) return;
    if (in_transaction_) throw UnavailableError("lost the connection to the database " + describe_);
    PQreset(conn_);
    if (PQstatus(conn_) != CONNECTION_OK) {
      throw UnavailableError("cannot reach the database " + describe_ + ": " + trim(PQerrorMessage(conn_)));
    }
    abandoned_ = false;
    configure();
  }

  PGresult* run(const std::string& sql, const std::vector<std::optional<std::string>>& params,
                const std::set<int>& named) {
    ensure_connected();
    int count = static_cast<int>(params.size());
    if (!named.empty()) count = std::max(count, *named.rbegin());
    std::vector<const char*> values(static_cast<size_t>(count), nullptr);
    std::vector<unsigned> types(static_cast<size_t>(count), 0);
    for (int i = 0; i < count; ++i) {
      if (static_cast<size_t>(i) < params.size() && params[static_cast<size_t>(i)]) {
        values[static_cast<size_t>(i)] = params[static_cast<size_t>(i)]->c_str();
      }
      if (!named.count(i + 1)) types[static_cast<size_t>(i)] = kTextOid;
    }
    PGresult* r =
        reply_to(PQsendQueryParams(conn_, sql.c_str(), count, types.data(), values.data(), nullptr, nullptr, 0));
    check(r, "statement failed");
    return r;
  }

 private:
  // The server cancels a statement after this long, and the client gives up on a reply a little
  // later (`reply_to`).
  int statement_timeout_ms() const { return std::max(30000, 6 * busy_timeout_ms_); }

  void configure() {
    PQsetNoticeProcessor(conn_, [](void*, const char*) {}, nullptr);
    // A lock held elsewhere waits as long as SQLite's busy timeout; a statement that hangs
    // (a stalled server) fails instead of hanging the caller.
    PgResult r(reply_to(PQsendQuery(conn_, ("SET lock_timeout = " + std::to_string(busy_timeout_ms_) +
                                            "; SET statement_timeout = " + std::to_string(statement_timeout_ms()))
                                               .c_str())));
    check(r.get(), "cannot configure the session");
  }

  // The reply to the query just sent (`sent`: PQsendQuery's answer), as PQexec gives it (the
  // last result, or the first that failed), waited for at most the statement timeout and two
  // seconds more. A live server has answered by then, if only with the cancellation of its
  // statement; a server process that stopped with its host up (a hung backend, a paused
  // machine) has not, and neither TCP keepalives nor the TCP user timeout notice it, since the
  // host's kernel still acknowledges every packet. The connection is then given up on and the
  // call fails as UnavailableError, a 503, instead of hanging with the store's lock held. Its
  // socket is shut down at once, so that the server process, if it resumes, reads the end of
  // the connection and ends, rolling back what it held, rather than idling in its transaction
  // until this store's next call reconnects.
  PGresult* reply_to(int sent) {
    if (!sent) return nullptr;  // `check` reports PQerrorMessage
    using Clock = std::chrono::steady_clock;
    const Clock::time_point deadline = Clock::now() + std::chrono::milliseconds(statement_timeout_ms() + 2000);
    PGresult* reply = nullptr;
    for (;;) {
      while (PQisBusy(conn_)) {
        const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
        pollfd socket{PQsocket(conn_), POLLIN, 0};
        const int ready = left > 0 ? poll(&socket, 1, static_cast<int>(left)) : 0;
        if (ready < 0 && errno == EINTR) continue;
        if (ready == 0) {
          PQclear(reply);
          abandoned_ = true;
          shutdown(PQsocket(conn_), SHUT_RDWR);
          throw UnavailableError("database " + describe_ + " unavailable: no reply in " +
                                 std::to_string((statement_timeout_ms() + 2000) / 1000) +
                                 " s (its server process may be stalled)");
        }
        if (ready < 0 || !PQconsumeInput(conn_)) break;  // PQgetResult reports the lost connection
      }
      PGresult* next = PQgetResult(conn_);
      if (!next) return reply;
      const ExecStatusType status = PQresultStatus(reply);
      if (reply && status != PGRES_COMMAND_OK && status != PGRES_TUPLES_OK) {
        PQclear(next);  // the first failure is the reply
      } else {
        PQclear(reply);
        reply = next;
      }
    }
  }

  // Runs a statement whose failure only matters to the server (a rollback, an unlock).
  void quietly(const std::string& sql) noexcept {
    try {
      PQclear(reply_to(PQsendQuery(conn_, sql.c_str())));
    } catch (...) {
    }
  }

  // Throws the StoreError subclass for a failed result; the result is freed on throw.
  void check(PGresult* r, const std::string& context) {
    ExecStatusType status = r ? PQresultStatus(r) : PGRES_FATAL_ERROR;
    if (status == PGRES_COMMAND_OK || status == PGRES_TUPLES_OK) return;
    std::string message = trim(r ? PQresultErrorMessage(r) : PQerrorMessage(conn_));
    const char* state = r ? PQresultErrorField(r, PG_DIAG_SQLSTATE) : nullptr;
    const std::string sqlstate = state ? state : "";
    PQclear(r);
    message = context + ": " + message;
    if (PQstatus(conn_) != CONNECTION_OK || connection_lost(state)) {
      throw UnavailableError("database " + describe_ + " unavailable: " + message);
    }
    if (sqlstate == "23505") throw ConflictError(message);
    if (sqlstate.rfind("XX00", 0) == 0) throw CorruptError("database damaged: " + message);
    throw StoreError(message);
  }

  static std::string trim(std::string s) {
    while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
    return s;
  }

  std::string describe_;
  PGconn* conn_ = nullptr;
  int busy_timeout_ms_ = 5000;
  bool in_transaction_ = false;
  bool abandoned_ = false;  // a reply was given up on: the connection is reset before its next use
};

bool PgCursor::step() {
  if (!ran_) {
    result_ = PgResult(db_.run(sql_, params_, named_));
    ran_ = true;
  }
  return ++row_ < PQntuples(result_.get());
}

}  // namespace

std::unique_ptr<Connection> open_postgres(const std::string& url, const StoreOptions& options) {
  return std::make_unique<PgConnection>(url, options);
}

}  // namespace cartridges::sql
