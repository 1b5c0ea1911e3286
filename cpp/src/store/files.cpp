// The store's files: uploaded content, its extracted text and processing status.
// See cartridges/store.h for the rules (ids, owners, blobs).
#include <mutex>
#include <stdexcept>

#include "cartridges/store.h"
#include "store/blob_io.h"
#include "store/common.h"
#include "store/sql.h"

namespace cartridges {

namespace {

using sql::Stmt;
using sql::Transaction;
using store_common::BlobGuard;
using store_common::now;

constexpr size_t kFileIdChars = 24;

std::string file_not_found(const std::string& id) { return "No such file: '" + id + "'"; }

// The columns FileRecord reads, in order, and the reader.
constexpr const char* kFileColumns =
    "id, owner_id, filename, purpose, bytes, created_at, status, status_details";

FileRecord read_file_row(const Stmt& s) {
  FileRecord f;
  f.id = s.text(0);
  f.owner_id = s.int64(1);
  f.filename = s.text(2);
  f.purpose = s.text(3);
  f.bytes = s.int64(4);
  f.created_at = s.int64(5);
  f.status = s.text(6);
  f.status_details = s.opt_text(7);
  return f;
}

}  // namespace

FileRecord Store::create_file(const Owner& owner, BlobWriter& content, const std::string& filename,
                              const std::string& purpose) {
  if (filename.empty() || purpose.empty()) throw std::invalid_argument("filename and purpose are required");
  BlobRef blob = commit_blob(content);
  BlobGuard guard(blob_path(blob.id));
  FileRecord f;
  f.id = "file-" + store_io::random_token(kFileIdChars, store_io::kAlphanumeric);
  f.owner_id = owner.user_id;
  f.filename = filename;
  f.purpose = purpose;
  f.bytes = blob.bytes;
  f.created_at = now();
  f.status = "uploaded";
  std::lock_guard<std::mutex> lock(mutex_);
  Transaction tx(db());
  insert_blob_locked(blob);
  Stmt(*db_,
       "INSERT INTO files (id, owner_id, filename, purpose, bytes, created_at, status, blob_id) "
       "VALUES (?1, ?2, ?3, ?4, ?5, ?6, 'uploaded', ?7)")
      .bind(1, f.id)
      .bind(2, f.owner_id)
      .bind(3, f.filename)
      .bind(4, f.purpose)
      .bind(5, f.bytes)
      .bind(6, f.created_at)
      .bind(7, blob.id)
      .run();
  tx.commit();
  guard.disarm();
  return f;
}

FileRecord Store::get_file_locked(const Owner& owner, const std::string& id) {
  Stmt s(db(), (std::string("SELECT ") + kFileColumns + " FROM files WHERE id = ?1 AND (?2 OR owner_id = ?3)").c_str());
  s.bind(1, id).bind(2, int64_t{owner.admin}).bind(3, owner.user_id);
  if (!s.step()) throw NotFoundError(file_not_found(id));
  return read_file_row(s);
}

FileRecord Store::get_file(const Owner& owner, const std::string& id) {
  std::lock_guard<std::mutex> lock(mutex_);
  return get_file_locked(owner, id);
}

FilePage Store::list_files(const Owner& owner, const FileQuery& query) {
  store_common::check_list_limit(query.limit);
  std::lock_guard<std::mutex> lock(mutex_);
  std::optional<std::pair<int64_t, int64_t>> cursor;
  if (query.after) {
    Stmt c(db(), "SELECT created_at, seq FROM files WHERE id = ?1 AND (?2 OR owner_id = ?3)");
    c.bind(1, *query.after).bind(2, int64_t{owner.admin}).bind(3, owner.user_id);
    if (!c.step()) throw NotFoundError(file_not_found(*query.after));
    cursor = std::make_pair(c.int64(0), c.int64(1));
  }
  // Separate statements for users and admin let SQLite use the matching index.
  std::string sql = std::string("SELECT ") + kFileColumns + " FROM files WHERE TRUE";
  if (!owner.admin) sql += " AND owner_id = ?1";
  if (query.purpose) sql += " AND purpose = ?2";
  if (query.status) sql += " AND status = ?3";
  sql += store_common::page_clause("", cursor.has_value(), query.descending);
  Stmt s(*db_, sql.c_str());
  if (!owner.admin) s.bind(1, owner.user_id);
  if (query.purpose) s.bind(2, *query.purpose);
  if (query.status) s.bind(3, *query.status);
  if (cursor) s.bind(4, cursor->first).bind(5, cursor->second);
  s.bind(6, query.limit + 1);
  FilePage page;
  while (s.step()) page.data.push_back(read_file_row(s));
  if (static_cast<int64_t>(page.data.size()) > query.limit) {
    page.data.pop_back();
    page.has_more = true;
  }
  return page;
}

void Store::delete_file(const Owner& owner, const std::string& id) {
  std::vector<std::string> blob_ids;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    Transaction tx(db());
    Stmt s(*db_, "SELECT blob_id, text_blob_id FROM files WHERE id = ?1 AND (?2 OR owner_id = ?3)");
    s.bind(1, id).bind(2, int64_t{owner.admin}).bind(3, owner.user_id);
    if (!s.step()) throw NotFoundError(file_not_found(id));
    blob_ids.push_back(s.text(0));
    if (auto text = s.opt_text(1)) blob_ids.push_back(*text);
    Stmt(*db_, "DELETE FROM files WHERE id = ?1").bind(1, id).run();
    for (const auto& b : blob_ids) Stmt(*db_, "DELETE FROM blobs WHERE id = ?1").bind(1, b).run();
    tx.commit();
  }
  for (const auto& b : blob_ids) remove_blob_file(b);
}

void Store::set_file_processed(const Owner& owner, const std::string& id, const std::optional<std::string>& text) {
  std::optional<BlobRef> blob;
  std::optional<BlobGuard> guard;
  if (text) {
    auto writer = begin_blob();
    writer->write(text->data(), text->size());
    blob = commit_blob(*writer);
    guard.emplace(blob_path(blob->id));
  }
  std::optional<std::string> old_text;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    Transaction tx(db());
    Stmt s(*db_, "SELECT text_blob_id FROM files WHERE id = ?1 AND (?2 OR owner_id = ?3)");
    s.bind(1, id).bind(2, int64_t{owner.admin}).bind(3, owner.user_id);
    if (!s.step()) throw NotFoundError(file_not_found(id));  // e.g. deleted while processing
    old_text = s.opt_text(0);
    std::optional<std::string> new_text;
    if (blob) {
      insert_blob_locked(*blob);
      new_text = blob->id;
    }
    Stmt(*db_, "UPDATE files SET status = 'processed', status_details = NULL, text_blob_id = ?2 WHERE id = ?1")
        .bind(1, id)
        .bind(2, new_text)
        .run();
    if (old_text) Stmt(*db_, "DELETE FROM blobs WHERE id = ?1").bind(1, *old_text).run();
    tx.commit();
  }
  if (guard) guard->disarm();
  if (old_text) remove_blob_file(*old_text);
}

void Store::set_file_error(const Owner& owner, const std::string& id, const std::string& details) {
  std::optional<std::string> old_text;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    Transaction tx(db());
    Stmt s(*db_, "SELECT text_blob_id FROM files WHERE id = ?1 AND (?2 OR owner_id = ?3)");
    s.bind(1, id).bind(2, int64_t{owner.admin}).bind(3, owner.user_id);
    if (!s.step()) throw NotFoundError(file_not_found(id));
    old_text = s.opt_text(0);
    Stmt(*db_, "UPDATE files SET status = 'error', status_details = ?2, text_blob_id = NULL WHERE id = ?1")
        .bind(1, id)
        .bind(2, details)
        .run();
    if (old_text) Stmt(*db_, "DELETE FROM blobs WHERE id = ?1").bind(1, *old_text).run();
    tx.commit();
  }
  if (old_text) remove_blob_file(*old_text);
}

Store::BlobRef Store::file_blob_locked(const Owner& owner, const std::string& id, bool text) {
  Stmt s(db(),
         "SELECT f.status, b.id, b.bytes, b.crc32 FROM files f "
         "JOIN blobs b ON b.id = (CASE WHEN ?4 THEN COALESCE(f.text_blob_id, f.blob_id) ELSE f.blob_id END) "
         "WHERE f.id = ?1 AND (?2 OR f.owner_id = ?3)");
  s.bind(1, id).bind(2, int64_t{owner.admin}).bind(3, owner.user_id).bind(4, int64_t{text});
  if (!s.step()) throw NotFoundError(file_not_found(id));
  std::string status = s.text(0);
  if (text && status != "processed") {
    throw ConflictError("file '" + id + "' is not processed (status: " + status + ")");
  }
  return BlobRef{s.text(1), s.int64(2), static_cast<uint32_t>(s.int64(3))};
}

std::string Store::file_content_path(const Owner& owner, const std::string& id) {
  BlobRef blob;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    blob = file_blob_locked(owner, id, false);
  }
  return checked_blob_path(blob, "content of file '" + id + "'");
}

BlobContent Store::file_content(const Owner& owner, const std::string& id) {
  BlobRef blob;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    blob = file_blob_locked(owner, id, false);
  }
  return content_of(blob, "content of file '" + id + "'");
}

void Store::verify_file(const Owner& owner, const std::string& id) {
  BlobRef blob;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    blob = file_blob_locked(owner, id, false);
  }
  read_blob(blob, "content of file '" + id + "'", /*keep=*/false);
}

std::string Store::file_text(const Owner& owner, const std::string& id) {
  BlobRef blob;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    blob = file_blob_locked(owner, id, true);
  }
  return read_blob(blob, "text of file '" + id + "'", /*keep=*/true);
}

}  // namespace cartridges
