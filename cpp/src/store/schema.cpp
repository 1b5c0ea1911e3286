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

const std::vector<const char*>& migrations() {
  static const std::vector<const char*> all = {kMigration1};
  return all;
}

}  // namespace cartridges::schema
