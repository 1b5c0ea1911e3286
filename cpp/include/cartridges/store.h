#pragma once
// Persistent state of the service: one database (SQLite in the data directory, or a
// PostgreSQL server that several replicas share: StoreOptions::database_url) and a
// directory of blobs.
//
// Layout under StoreOptions::data_dir:
//   store.db (+ -wal, -shm)  metadata when no database_url names another database; WAL mode,
//                            foreign keys on, migrations numbered in code and applied at
//                            open (PRAGMA user_version = last applied; in PostgreSQL the
//                            table cartridges_schema, under an advisory lock)
//   store.lock               flock: shared while a Store is open; the sweep at open runs
//                            only when no other Store (any process) has the directory open
//   blobs/<blob_id>          immutable contents, recorded in table `blobs` (size, CRC-32)
//   blobs/tmp/<random>       writes in flight; a blob becomes visible only after
//                            fsync(file) → rename → fsync(dir) → INSERT, and is removed
//                            only after its row is deleted. The sweep at open removes
//                            every temporary and every blob no row points to, so a crash
//                            at any point never leaves a visible partial object.
//   jobs/<run_id>/           scratch space of a datablock's training job (checkpoints),
//                            handed out only while the job is queued or running; removed
//                            when the job ends or its datablock is deleted, and by the
//                            sweep at open for every job that is not live any more.
//
// Isolation: every call on a user's objects takes an Owner. A user's Owner sees only that
// user's objects; an object of another user is answered exactly like a missing one
// (NotFoundError with the same message). Only an admin Owner sees every user's objects.
//
// Thread safety: a Store may be shared by threads (one connection behind a mutex). A
// BlobWriter is used by one thread at a time.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace cartridges {

namespace sql {
class Connection;
}

// Every failure of the store. Subclasses say what the caller can do about it.
class StoreError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};
// Unknown id, or an object owned by someone else (indistinguishable on purpose).
class NotFoundError : public StoreError {
 public:
  using StoreError::StoreError;
};
// The object exists but its state forbids the action (e.g. a duplicate user name, the text
// of a file that is not processed yet).
class ConflictError : public StoreError {
 public:
  using StoreError::StoreError;
};
// Something on disk is damaged: a blob missing, truncated or failing its checksum.
class CorruptError : public StoreError {
 public:
  using StoreError::StoreError;
};

// The database cannot be reached now (a PostgreSQL server down, a connection lost, a lock or
// statement timeout); retrying later may succeed. Nothing was changed by the failed call.
class UnavailableError : public StoreError {
 public:
  using StoreError::StoreError;
};

// A remote home for blobs (an object store such as S3), with the data directory's blobs/ as
// its local cache. Implemented in Python over a maintained client (cartridges/blobs.py). Every
// failure to reach it is an UnavailableError.
class BlobMirror {
 public:
  virtual ~BlobMirror() = default;
  // Copies a committed local blob file to the remote; returns when it is durable there.
  virtual void upload(const std::string& blob_id, const std::string& local_path) = 0;
  // Fetches a blob into local_path; false when the remote has no such blob.
  virtual bool download(const std::string& blob_id, const std::string& local_path) = 0;
  // Removes a blob from the remote (no error when it is not there).
  virtual void remove(const std::string& blob_id) = 0;
  // Checks that the remote answers.
  virtual void check() = 0;
};

// Where a stored blob's bytes are read from: the local file when blobs/ holds it whole, else
// (with a blob mirror) the mirror's object of that id, which a reader streams from there.
struct BlobContent {
  std::string blob_id;
  int64_t bytes = 0;
  std::string local_path;  // "" when only the mirror has it
};

struct StoreOptions {
  // Directory holding store.db and blobs/; created if missing. Required.
  std::string data_dir;
  // Where the metadata lives: "" (SQLite at data_dir/store.db), "sqlite:///abs/path.db" (SQLite
  // at that file) or "postgresql://user:password@host:port/db" (or "postgres://...").
  std::string database_url;
  // fsync each blob before its rename and the directory after it. Default true; turn it off
  // only for throwaway stores (bulk loads in benchmarks), never for a server.
  bool sync = true;
  // How long a statement waits for a lock held by another process, in ms. Default 5000.
  int busy_timeout_ms = 5000;
  // Run `PRAGMA quick_check` at open and refuse a damaged database (SQLite). Default true.
  bool check_at_open = true;
  // When set, every blob is uploaded here before it is recorded and removed here after its
  // record; blobs/ keeps the blobs this process wrote or read, and a recorded blob missing from
  // it is fetched on first use. Replicas on different machines then share the blobs.
  std::shared_ptr<BlobMirror> blob_mirror;
};

// Who is asking. Built by the HTTP layer from the API key; the store enforces it.
struct Owner {
  int64_t user_id = 0;
  bool admin = false;  // acts on every user's objects; objects it creates belong to user_id
  static Owner user(int64_t id) { return Owner{id, false}; }
  static Owner administrator(int64_t id = 0) { return Owner{id, true}; }
};

struct User {
  int64_t id = 0;
  std::string name;  // [A-Za-z0-9._-]{1,64}
  int64_t created_at = 0;
};

struct ApiKeyInfo {
  int64_t id = 0;
  int64_t user_id = 0;
  std::string user_name;
  std::string hint;  // a displayable prefix of the key, never the key
  int64_t created_at = 0;
  std::optional<int64_t> revoked_at;
};

struct FileRecord {
  std::string id;  // "file-" + 24 characters [A-Za-z0-9]
  int64_t owner_id = 0;
  std::string filename;
  std::string purpose;
  int64_t bytes = 0;
  int64_t created_at = 0;   // Unix seconds
  std::string status;       // "uploaded" | "processed" | "error"
  std::optional<std::string> status_details;
};

struct FileQuery {
  std::optional<std::string> purpose;  // only files with this purpose
  std::optional<std::string> status;   // only files in this status
  std::optional<std::string> after;    // page starts after this id (NotFoundError if unseen)
  int64_t limit = 10000;               // 1..10000
  bool descending = true;              // by created_at, then insertion order
};

struct FilePage {
  std::vector<FileRecord> data;
  bool has_more = false;
};

// A datablock: a cartridge trained by a background job (docs/api.md §2). Its status only moves
// forward: queued → running → succeeded | failed | cancelled (running → running is a resume).
struct DatablockRecord {
  std::string run_id;      // [a-z0-9]{12}, unique on the server
  int64_t owner_id = 0;
  std::string owner_name;
  std::string project;     // [A-Za-z0-9._-]{1,64}
  std::string model;       // base model id
  std::string model_path;  // where the worker loads the base model from ("": the default model)
  std::string fingerprint; // base-model fingerprint; "" until the job has loaded the model
  std::vector<std::string> training_files;
  std::string config;      // JSON object: the full training config
  std::string status;      // "queued" | "running" | "succeeded" | "failed" | "cancelled"
  std::string progress;    // JSON object, written by the job
  std::string metrics;     // JSON object, written by the job
  std::optional<std::string> error_code;     // set when failed
  std::optional<std::string> error_message;
  int64_t attempts = 0;    // times a worker started the job (a resume counts)
  int64_t num_tokens = 0;  // cartridge length in tokens; 0 until the job decides it from the corpus
  std::optional<int64_t> bytes;  // size of the stored cartridge once succeeded
  int64_t created_at = 0;
  std::optional<int64_t> started_at;
  std::optional<int64_t> finished_at;
  int64_t updated_at = 0;  // last write by anyone: the job's heartbeat
  std::string claimant;    // who started the job last ("<host>:<data_dir>"; "" before)

  // "<owner>/<project>/<run_id>", the identifier clients use.
  std::string id() const { return owner_name + "/" + project + "/" + run_id; }
};

struct NewDatablock {
  std::string project = "default";
  std::string model;
  std::string model_path;
  std::vector<std::string> training_files;  // each must be the owner's file (NotFoundError)
  std::string config = "{}";                // JSON object
  int64_t num_tokens = 0;                   // 0: the job decides it from the corpus (start_datablock)
};

struct DatablockQuery {
  std::optional<std::string> status;  // only datablocks in this status
  std::optional<std::string> after;   // page starts after this datablock (NotFoundError if unseen)
  int64_t limit = 10000;              // 1..10000
  bool descending = true;             // by created_at, then insertion order
};

struct DatablockPage {
  std::vector<DatablockRecord> data;
  bool has_more = false;
};

// A blob being written: bytes go to blobs/tmp/<random>. Store::create_file (or another
// committing call) makes it permanent; destroying an uncommitted writer removes it.
class BlobWriter {
 public:
  ~BlobWriter();
  BlobWriter(const BlobWriter&) = delete;
  BlobWriter& operator=(const BlobWriter&) = delete;

  void write(const char* data, size_t size);
  // Removes the temporary file; the writer is unusable afterwards. Idempotent.
  void abort();
  int64_t bytes() const { return bytes_; }
  uint32_t crc32() const { return crc_; }
  bool open() const { return fd_ >= 0; }

 private:
  friend class Store;
  BlobWriter(std::string tmp_path, bool sync);
  // fsync + close; the temporary file stays until renamed by the store.
  void finish();

  std::string tmp_path_;
  bool sync_;
  int fd_ = -1;
  int64_t bytes_ = 0;
  uint32_t crc_ = 0;
};

class Store {
 public:
  // Opens (creating if needed) the store in options.data_dir, applies pending migrations and
  // sweeps leftovers. Throws StoreError with the reason when the database is unreadable.
  explicit Store(StoreOptions options);
  ~Store();
  Store(const Store&) = delete;
  Store& operator=(const Store&) = delete;

  // Closes the database and releases the directory; any later call throws StoreError.
  void close();
  const StoreOptions& options() const { return options_; }
  int schema_version();
  // Checks that the database (and the blob mirror, if any) answer, re-establishing a dropped
  // connection (UnavailableError when they do not).
  void ping();
  // How many leftovers (temporaries, unrecorded blobs) the sweep at open removed.
  int64_t swept_at_open() const { return swept_; }
  // The ids of every recorded blob (a file's content or text, a cartridge), in one query: a blob
  // mirror's object that is not among them, and is older than any upload in flight, is an
  // orphan.
  std::vector<std::string> recorded_blobs();

  // ---- users and API keys (keys are stored as hashes only) ----
  User create_user(const std::string& name);  // ConflictError if the name is taken
  std::optional<User> find_user(const std::string& name);
  std::vector<User> list_users();
  // key_hash: hex SHA-256 of the key, computed by the caller; hint: a displayable prefix.
  ApiKeyInfo add_key(int64_t user_id, const std::string& key_hash, const std::string& hint);
  // The user of a key that exists and is not revoked.
  std::optional<User> user_for_key(const std::string& key_hash);
  std::vector<ApiKeyInfo> list_keys();
  void revoke_key(int64_t key_id);  // NotFoundError if unknown or already revoked

  // ---- blobs ----
  std::unique_ptr<BlobWriter> begin_blob();

  // ---- files ----
  // Commits the writer's blob and records a file with status "uploaded".
  FileRecord create_file(const Owner& owner, BlobWriter& content, const std::string& filename,
                         const std::string& purpose);
  FileRecord get_file(const Owner& owner, const std::string& id);
  FilePage list_files(const Owner& owner, const FileQuery& query);
  // Removes the record, then the blobs (content and text).
  void delete_file(const Owner& owner, const std::string& id);
  // status → "processed". text: the extracted text, stored as its own blob; nullopt when the
  // content itself is the text (UTF-8 .txt/.md).
  void set_file_processed(const Owner& owner, const std::string& id, const std::optional<std::string>& text);
  // status → "error" with a human-readable reason.
  void set_file_error(const Owner& owner, const std::string& id, const std::string& details);
  // Path of the content blob, after checking it exists with the recorded size (CorruptError).
  std::string file_content_path(const Owner& owner, const std::string& id);
  // Where the content blob can be read without fetching it first: the local file, or with a
  // mirror the object to stream (a download that never lands on this machine's disk).
  BlobContent file_content(const Owner& owner, const std::string& id);
  // Reads the content blob whole and checks its CRC-32 (CorruptError).
  void verify_file(const Owner& owner, const std::string& id);
  // The text that training and chat use; ConflictError unless processed, CorruptError if damaged.
  std::string file_text(const Owner& owner, const std::string& id);

  // ---- datablocks ----
  // Wherever a datablock id is taken, both "<owner>/<project>/<run_id>" and the bare run_id
  // are accepted; a full id whose owner or project does not match is NotFoundError.
  // Records a queued datablock with a fresh run_id; ValueError-like std::invalid_argument for
  // a bad project name or JSON, NotFoundError for a training file the owner cannot see.
  DatablockRecord create_datablock(const Owner& owner, const NewDatablock& spec);
  DatablockRecord get_datablock(const Owner& owner, const std::string& id);
  DatablockPage list_datablocks(const Owner& owner, const DatablockQuery& query);
  // Removes the row and the cartridge blob in one transaction (then the file and the job's
  // scratch directory), whatever the status: a live job notices on its next write and stops.
  void delete_datablock(const Owner& owner, const std::string& id);
  // queued → running (or running → running when a job resumes); counts an attempt and
  // records the base-model fingerprint and the claimant. ConflictError from any other status,
  // and for a running job whose claimant is another one and whose last write is less than
  // `lease_s` seconds old (its worker is alive elsewhere). A non-empty `config` (JSON object)
  // and a positive `num_tokens` replace the record's: the job has decided what the config
  // left to the corpus.
  DatablockRecord start_datablock(const Owner& owner, const std::string& id, const std::string& fingerprint,
                                  const std::string& config = "", int64_t num_tokens = 0,
                                  const std::string& claimant = "", int64_t lease_s = 0);
  // Progress and metrics (JSON objects) of a running job. ConflictError unless running: a
  // job that was cancelled stops when its write is refused.
  void update_datablock_progress(const Owner& owner, const std::string& id, const std::string& progress,
                                 const std::string& metrics);
  // running → succeeded: commits the cartridge blob and records it with final progress and
  // metrics; the job's scratch directory is removed.
  DatablockRecord succeed_datablock(const Owner& owner, const std::string& id, BlobWriter& cartridge,
                                    const std::string& progress, const std::string& metrics);
  // A datablock whose cartridge was made elsewhere (a PEFT adapter, a research .pt): created
  // already succeeded with that cartridge, in one transaction, so no job ever sees it queued.
  // `spec.training_files` may be empty.
  DatablockRecord import_datablock(const Owner& owner, const NewDatablock& spec, const std::string& fingerprint,
                                   BlobWriter& cartridge, const std::string& progress, const std::string& metrics);
  // queued | running → failed with a code and message.
  DatablockRecord fail_datablock(const Owner& owner, const std::string& id, const std::string& code,
                                 const std::string& message);
  // queued | running → cancelled.
  DatablockRecord cancel_datablock(const Owner& owner, const std::string& id);
  // The job's scratch directory (created if needed); ConflictError unless queued or running.
  std::string job_dir(const Owner& owner, const std::string& id);
  // Path of the stored cartridge after checking its size (CorruptError); ConflictError
  // unless succeeded.
  std::string datablock_cartridge_path(const Owner& owner, const std::string& id);
  // As file_content, for the cartridge of a succeeded datablock.
  BlobContent datablock_content(const Owner& owner, const std::string& id);
  // Reads the cartridge blob whole and checks its CRC-32 (CorruptError).
  void verify_datablock(const Owner& owner, const std::string& id);

 private:
  struct BlobRef {
    std::string id;
    int64_t bytes;
    uint32_t crc;
  };
  sql::Connection& db();  // the open connection, or StoreError
  void migrate();
  int64_t sweep();
  BlobRef commit_blob(BlobWriter& writer);  // rename into blobs/ (not yet recorded)
  void remove_blob_file(const std::string& blob_id);
  std::string blob_path(const std::string& blob_id) const;
  // Reads a blob whole, checking size and CRC-32 (CorruptError); returns it when keep.
  std::string read_blob(const BlobRef& blob, const std::string& what, bool keep) const;
  // Fetches a recorded blob missing from blobs/ from the mirror, if there is one.
  void ensure_local(const BlobRef& blob, const std::string& what) const;
  // Path of a blob after checking it exists with its recorded size (CorruptError naming `what`).
  std::string checked_blob_path(const BlobRef& blob, const std::string& what) const;
  // The local file when it is whole, else the mirror's object; without a mirror, as
  // checked_blob_path.
  BlobContent content_of(const BlobRef& blob, const std::string& what) const;
  void insert_blob_locked(const BlobRef& blob);  // records a committed blob (inside a transaction)
  // Locked helpers.
  FileRecord get_file_locked(const Owner& owner, const std::string& id);
  BlobRef file_blob_locked(const Owner& owner, const std::string& id, bool text);
  DatablockRecord get_datablock_locked(const Owner& owner, const std::string& id);
  // running → succeeded with a committed cartridge blob (inside a transaction).
  DatablockRecord record_cartridge_locked(const Owner& owner, const std::string& id, const BlobRef& blob,
                                          const std::string& progress, const std::string& metrics);
  // Inserts a queued datablock row under a fresh run id (inside a transaction); returns the id.
  std::string insert_datablock_locked(const Owner& owner, const NewDatablock& spec);
  BlobRef datablock_blob_locked(const Owner& owner, const std::string& id);
  // Moves a datablock from one of `from` to `to`, setting the extra assignments (SQL with
  // ?3 = now). NotFoundError or ConflictError (naming the current status) when it cannot.
  DatablockRecord transition_locked(const Owner& owner, const std::string& id, const std::vector<std::string>& from,
                                    const std::string& to, const std::string& assignments,
                                    const std::vector<std::string>& texts = {});
  std::string job_dir_path(const std::string& run_id) const;
  void remove_job_dir(const std::string& run_id);
  int64_t sweep_job_dirs();

  StoreOptions options_;
  std::mutex mutex_;
  std::unique_ptr<sql::Connection> db_;
  int lock_fd_ = -1;
  int64_t swept_ = 0;
};

}  // namespace cartridges
