#include "store/schema.h"

namespace cartridges::schema {

// 1: users, API key hashes, blobs, files.
//  - blobs is the one table that names files under blobs/: the sweep keeps exactly these.
//    Datablocks (cartridge tensors) and job checkpoints reference blobs the same way.
//  - files.seq is the insertion order, the tiebreak of cursor pagination.
//  - Owned tables carry owner_id → users(id); later ones (datablocks, jobs) do the same.
static const char* kMigration1 = R"sql(
CREATE TABLE users (
  id         INTEGER PRIMARY KEY,
  name       TEXT NOT NULL UNIQUE,
  created_at INTEGER NOT NULL
);
CREATE TABLE api_keys (
  id         INTEGER PRIMARY KEY,
  user_id    INTEGER NOT NULL REFERENCES users(id) ON DELETE CASCADE,
  key_hash   TEXT NOT NULL UNIQUE,
  hint       TEXT NOT NULL,
  created_at INTEGER NOT NULL,
  revoked_at INTEGER
);
CREATE INDEX api_keys_user ON api_keys(user_id);
CREATE TABLE blobs (
  id         TEXT PRIMARY KEY,
  bytes      INTEGER NOT NULL,
  crc32      INTEGER NOT NULL,
  created_at INTEGER NOT NULL
);
CREATE TABLE files (
  seq            INTEGER PRIMARY KEY AUTOINCREMENT,
  id             TEXT NOT NULL UNIQUE,
  owner_id       INTEGER NOT NULL REFERENCES users(id),
  filename       TEXT NOT NULL,
  purpose        TEXT NOT NULL,
  bytes          INTEGER NOT NULL,
  created_at     INTEGER NOT NULL,
  status         TEXT NOT NULL CHECK (status IN ('uploaded', 'processed', 'error')),
  status_details TEXT,
  blob_id        TEXT NOT NULL REFERENCES blobs(id),
  text_blob_id   TEXT REFERENCES blobs(id)
);
CREATE INDEX files_owner_order ON files(owner_id, created_at, seq);
CREATE INDEX files_order ON files(created_at, seq);
)sql";

// 2: datablocks (trained cartridges and their training jobs).
//  - run_id is the server-wide unique part of the id "<owner>/<project>/<run_id>".
//  - training_files and config are JSON (an array of file ids, an object); progress and
//    metrics are JSON objects the job rewrites as it goes.
//  - No foreign key to files: deleting a training file leaves its datablocks working.
//  - blob_id is the trained cartridge (safetensors), set with status 'succeeded'.
//  - The trigger makes status move only forward whoever writes the row.
static const char* kMigration2 = R"sql(
CREATE TABLE datablocks (
  seq            INTEGER PRIMARY KEY AUTOINCREMENT,
  run_id         TEXT NOT NULL UNIQUE CHECK (length(run_id) >= 8 AND run_id NOT GLOB '*[^a-z0-9]*'),
  owner_id       INTEGER NOT NULL REFERENCES users(id),
  project        TEXT NOT NULL,
  model          TEXT NOT NULL,
  model_path     TEXT NOT NULL,
  fingerprint    TEXT NOT NULL DEFAULT '',
  training_files TEXT NOT NULL,
  config         TEXT NOT NULL,
  status         TEXT NOT NULL CHECK (status IN ('queued', 'running', 'succeeded', 'failed', 'cancelled')),
  progress       TEXT NOT NULL,
  metrics        TEXT NOT NULL,
  error_code     TEXT,
  error_message  TEXT,
  attempts       INTEGER NOT NULL DEFAULT 0,
  num_tokens     INTEGER NOT NULL,
  blob_id        TEXT REFERENCES blobs(id),
  created_at     INTEGER NOT NULL,
  started_at     INTEGER,
  finished_at    INTEGER,
  updated_at     INTEGER NOT NULL
);
CREATE INDEX datablocks_owner_order ON datablocks(owner_id, created_at, seq);
CREATE INDEX datablocks_order ON datablocks(created_at, seq);
CREATE INDEX datablocks_status ON datablocks(status);
CREATE TRIGGER datablocks_status_forward BEFORE UPDATE OF status ON datablocks
WHEN NOT (NEW.status = OLD.status
          OR (OLD.status = 'queued' AND NEW.status IN ('running', 'failed', 'cancelled'))
          OR (OLD.status = 'running' AND NEW.status IN ('succeeded', 'failed', 'cancelled')))
BEGIN
  SELECT RAISE(ABORT, 'datablock status may only move forward');
END;
)sql";

const std::vector<const char*>& migrations() {
  static const std::vector<const char*> all = {kMigration1, kMigration2};
  return all;
}

}  // namespace cartridges::schema
