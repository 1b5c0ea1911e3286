// The store's datablocks: trained cartridges and the state of their training jobs.
// See cartridges/store.h for the rules (ids, forward-only status, scratch directories).
#include <sys/stat.h>

#include <algorithm>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <unordered_set>

#include "cartridges/store.h"
#include "store/blob_io.h"
#include "store/common.h"
#include "store/sql.h"

namespace cartridges {

namespace {

using sql::Stmt;
using sql::Transaction;

constexpr size_t kRunIdChars = 12;
const std::string kLowerAlphanumeric = "abcdefghijklmnopqrstuvwxyz0123456789";

std::string datablock_not_found(const std::string& id) { return "No such datablock: '" + id + "'"; }

// The columns DatablockRecord reads, in order, and the reader.
constexpr const char* kDatablockSelect =
    "SELECT d.run_id, d.owner_id, u.name, d.project, d.model, d.model_path, d.fingerprint, d.training_files, "
    "d.config, d.status, d.progress, d.metrics, d.error_code, d.error_message, d.attempts, d.num_tokens, b.bytes, "
    "d.created_at, d.started_at, d.finished_at, d.updated_at, d.claimant "
    "FROM datablocks d JOIN users u ON u.id = d.owner_id LEFT JOIN blobs b ON b.id = d.blob_id ";

DatablockRecord read_datablock_row(const Stmt& s) {
  DatablockRecord d;
  d.run_id = s.text(0);
  d.owner_id = s.int64(1);
  d.owner_name = s.text(2);
  d.project = s.text(3);
  d.model = s.text(4);
  d.model_path = s.text(5);
  d.fingerprint = s.text(6);
  d.training_files = nlohmann::json::parse(s.text(7)).get<std::vector<std::string>>();
  d.config = s.text(8);
  d.status = s.text(9);
  d.progress = s.text(10);
  d.metrics = s.text(11);
  d.error_code = s.opt_text(12);
  d.error_message = s.opt_text(13);
  d.attempts = s.int64(14);
  d.num_tokens = s.int64(15);
  d.bytes = s.opt_int64(16);
  d.created_at = s.int64(17);
  d.started_at = s.opt_int64(18);
  d.finished_at = s.opt_int64(19);
  d.updated_at = s.int64(20);
  d.claimant = s.text(21);
  return d;
}

// "<owner>/<project>/<run_id>" or a bare run_id. Anything else matches nothing.
struct DatablockRef {
  std::string run_id;
  std::string owner_name;  // "" for a bare run_id
  std::string project;

  static DatablockRef parse(const std::string& id) {
    size_t first = id.find('/');
    if (first == std::string::npos) return {id, "", ""};
    size_t second = id.find('/', first + 1);
    if (second == std::string::npos || id.find('/', second + 1) != std::string::npos || first == 0) return {};
    return {id.substr(second + 1), id.substr(0, first), id.substr(first + 1, second - first - 1)};
  }
};

// WHERE clause resolving a DatablockRef for an owner; binds ?1..?5 (see bind_ref).
constexpr const char* kRefWhere =
    "WHERE d.run_id = ?1 AND (?2 OR d.owner_id = ?3) AND (?4 = '' OR (u.name = ?4 AND d.project = ?5)) ";

void bind_ref(Stmt& s, const Owner& owner, const DatablockRef& ref) {
  s.bind(1, ref.run_id).bind(2, int64_t{owner.admin}).bind(3, owner.user_id).bind(4, ref.owner_name).bind(5, ref.project);
}

std::string checked_json_object(const std::string& text, const char* what) {
  if (!nlohmann::json::accept(text) || !nlohmann::json::parse(text).is_object()) {
    throw std::invalid_argument(std::string(what) + " must be a JSON object");
  }
  return text;
}

bool is_terminal(const std::string& status) { return status != "queued" && status != "running"; }

const char* kQueuedProgress = R"({"stage":"queued","completed":0,"total":0})";

}  // namespace

std::string Store::job_dir_path(const std::string& run_id) const { return options_.data_dir + "/jobs/" + run_id; }

void Store::remove_job_dir(const std::string& run_id) {
  std::error_code ignored;  // a leftover is removed by the next sweep
  std::filesystem::remove_all(job_dir_path(run_id), ignored);
}

int64_t Store::sweep_job_dirs() {
  std::vector<std::string> names;
  for (const auto& entry : std::filesystem::directory_iterator(options_.data_dir + "/jobs")) {
    names.push_back(entry.path().filename().string());
  }
  std::unordered_set<std::string> live;
  {
    Stmt s(*db_, "SELECT run_id FROM datablocks WHERE status IN ('queued', 'running')");
    while (s.step()) live.insert(s.text(0));
  }
  int64_t removed = 0;
  for (const auto& name : names) {
    if (live.count(name)) continue;
    std::error_code error;
    if (std::filesystem::remove_all(job_dir_path(name), error) > 0 && !error) ++removed;
  }
  return removed;
}

DatablockRecord Store::create_datablock(const Owner& owner, const NewDatablock& spec) {
  if (spec.training_files.empty()) throw std::invalid_argument("a datablock needs at least one training file");
  std::lock_guard<std::mutex> lock(mutex_);
  Transaction tx(db());
  const std::string run_id = insert_datablock_locked(owner, spec);
  DatablockRecord record = get_datablock_locked(owner, run_id);
  tx.commit();
  return record;
}

DatablockRecord Store::import_datablock(const Owner& owner, const NewDatablock& spec, const std::string& fingerprint,
                                        BlobWriter& cartridge, const std::string& progress,
                                        const std::string& metrics) {
  checked_json_object(progress, "progress");
  checked_json_object(metrics, "metrics");
  BlobRef blob = commit_blob(cartridge);
  store_common::BlobGuard guard(blob_path(blob.id));
  DatablockRecord record;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    Transaction tx(db());
    const std::string run_id = insert_datablock_locked(owner, spec);
    // The status trigger allows only forward steps: queued → running → succeeded.
    transition_locked(owner, run_id, {"queued"}, "running", ", started_at = ?3, fingerprint = ?4", {fingerprint});
    record = record_cartridge_locked(owner, run_id, blob, progress, metrics);
    tx.commit();
  }
  guard.disarm();
  return record;
}

std::string Store::insert_datablock_locked(const Owner& owner, const NewDatablock& spec) {
  store_common::check_name(spec.project, "project name");
  checked_json_object(spec.config, "config");
  if (spec.num_tokens < 0) throw std::invalid_argument("num_tokens must be non-negative (0: decided by the job)");
  for (const auto& file_id : spec.training_files) {
    Stmt f(*db_, "SELECT 1 FROM files WHERE id = ?1 AND (?2 OR owner_id = ?3)");
    f.bind(1, file_id).bind(2, int64_t{owner.admin}).bind(3, owner.user_id);
    if (!f.step()) throw NotFoundError("No such file: '" + file_id + "'");
  }
  const int64_t created = store_common::now();
  for (int attempt = 0;; ++attempt) {
    const std::string run_id = store_io::random_token(kRunIdChars, kLowerAlphanumeric);
    try {
      Stmt(*db_,
           "INSERT INTO datablocks (run_id, owner_id, project, model, model_path, training_files, config, status, "
           "progress, metrics, num_tokens, created_at, updated_at) "
           "VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, 'queued', ?8, '{}', ?9, ?10, ?10)")
          .bind(1, run_id)
          .bind(2, owner.user_id)
          .bind(3, spec.project)
          .bind(4, spec.model)
          .bind(5, spec.model_path)
          .bind(6, nlohmann::json(spec.training_files).dump())
          .bind(7, spec.config)
          .bind(8, std::string(kQueuedProgress))
          .bind(9, spec.num_tokens)
          .bind(10, created)
          .run();
      return run_id;
    } catch (const ConflictError&) {
      if (attempt >= 3) throw;  // 36^12 ids: a repeated collision is not chance
    }
  }
}

DatablockRecord Store::get_datablock_locked(const Owner& owner, const std::string& id) {
  Stmt s(db(), (std::string(kDatablockSelect) + kRefWhere).c_str());
  bind_ref(s, owner, DatablockRef::parse(id));
  if (!s.step()) throw NotFoundError(datablock_not_found(id));
  return read_datablock_row(s);
}

DatablockRecord Store::get_datablock(const Owner& owner, const std::string& id) {
  std::lock_guard<std::mutex> lock(mutex_);
  return get_datablock_locked(owner, id);
}

DatablockPage Store::list_datablocks(const Owner& owner, const DatablockQuery& query) {
  store_common::check_list_limit(query.limit);
  std::lock_guard<std::mutex> lock(mutex_);
  std::optional<std::pair<int64_t, int64_t>> cursor;
  if (query.after) {
    Stmt c(db(), (std::string("SELECT d.created_at, d.seq FROM datablocks d JOIN users u ON u.id = d.owner_id ") +
                  kRefWhere)
                     .c_str());
    bind_ref(c, owner, DatablockRef::parse(*query.after));
    if (!c.step()) throw NotFoundError(datablock_not_found(*query.after));
    cursor = std::make_pair(c.int64(0), c.int64(1));
  }
  std::string where = "WHERE TRUE";
  if (!owner.admin) where += " AND d.owner_id = ?1";
  if (query.status) where += " AND d.status = ?2";
  Stmt s(*db_, (kDatablockSelect + where + store_common::page_clause("d.", cursor.has_value(), query.descending)).c_str());
  if (!owner.admin) s.bind(1, owner.user_id);
  if (query.status) s.bind(2, *query.status);
  if (cursor) s.bind(4, cursor->first).bind(5, cursor->second);
  s.bind(6, query.limit + 1);
  DatablockPage page;
  while (s.step()) page.data.push_back(read_datablock_row(s));
  if (static_cast<int64_t>(page.data.size()) > query.limit) {
    page.data.pop_back();
    page.has_more = true;
  }
  return page;
}

void Store::delete_datablock(const Owner& owner, const std::string& id) {
  std::string run_id;
  std::optional<std::string> blob_id;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    Transaction tx(db());
    run_id = get_datablock_locked(owner, id).run_id;
    Stmt s(*db_, "SELECT blob_id FROM datablocks WHERE run_id = ?1");
    s.bind(1, run_id).step();
    blob_id = s.opt_text(0);
    Stmt(*db_, "DELETE FROM datablocks WHERE run_id = ?1").bind(1, run_id).run();
    if (blob_id) Stmt(*db_, "DELETE FROM blobs WHERE id = ?1").bind(1, *blob_id).run();
    tx.commit();
  }
  if (blob_id) remove_blob_file(*blob_id);
  remove_job_dir(run_id);
}

DatablockRecord Store::transition_locked(const Owner& owner, const std::string& id,
                                         const std::vector<std::string>& from, const std::string& to,
                                         const std::string& assignments, const std::vector<std::string>& texts) {
  DatablockRecord current = get_datablock_locked(owner, id);
  if (std::find(from.begin(), from.end(), current.status) == from.end()) {
    throw ConflictError("datablock '" + current.id() + "' is " + current.status + "; it cannot become " + to);
  }
  Stmt update(*db_, ("UPDATE datablocks SET status = ?2, updated_at = ?3" + assignments + " WHERE run_id = ?1").c_str());
  update.bind(1, current.run_id).bind(2, to).bind(3, store_common::now());
  for (size_t i = 0; i < texts.size(); ++i) update.bind(static_cast<int>(i) + 4, texts[i]);
  update.run();
  return get_datablock_locked(owner, current.run_id);
}

DatablockRecord Store::start_datablock(const Owner& owner, const std::string& id, const std::string& fingerprint,
                                       const std::string& config, int64_t num_tokens, const std::string& claimant,
                                       int64_t lease_s) {
  if (!config.empty()) checked_json_object(config, "config");
  if (num_tokens < 0) throw std::invalid_argument("num_tokens must be non-negative (0: unchanged)");
  std::lock_guard<std::mutex> lock(mutex_);
  Transaction tx(db());
  {
    // Checked and claimed in one transaction: writers are serialized, so of two workers that
    // start one job at once (two replicas), exactly one claims it.
    DatablockRecord current = get_datablock_locked(owner, id);
    if (current.status == "running" && !current.claimant.empty() && current.claimant != claimant &&
        store_common::now() - current.updated_at < lease_s) {
      throw ConflictError("datablock '" + current.id() + "' is running in another worker (" + current.claimant + ")");
    }
  }
  DatablockRecord record = transition_locked(owner, id, {"queued", "running"}, "running",
                                             ", attempts = attempts + 1, started_at = COALESCE(started_at, ?3), "
                                             "fingerprint = ?4, claimant = ?5",
                                             {fingerprint, claimant});
  if (!config.empty() || num_tokens > 0) {
    // What the config left to the corpus, decided now that the job has read its files.
    Stmt(*db_, "UPDATE datablocks SET config = CASE WHEN ?2 = '' THEN config ELSE ?2 END, "
              "num_tokens = CASE WHEN ?3 > 0 THEN ?3 ELSE num_tokens END WHERE run_id = ?1")
        .bind(1, record.run_id)
        .bind(2, config)
        .bind(3, num_tokens)
        .run();
    record = get_datablock_locked(owner, record.run_id);
  }
  tx.commit();
  return record;
}

void Store::update_datablock_progress(const Owner& owner, const std::string& id, const std::string& progress,
                                      const std::string& metrics) {
  checked_json_object(progress, "progress");
  checked_json_object(metrics, "metrics");
  std::lock_guard<std::mutex> lock(mutex_);
  Transaction tx(db());
  transition_locked(owner, id, {"running"}, "running", ", progress = ?4, metrics = ?5", {progress, metrics});
  tx.commit();
}

DatablockRecord Store::succeed_datablock(const Owner& owner, const std::string& id, BlobWriter& cartridge,
                                         const std::string& progress, const std::string& metrics) {
  checked_json_object(progress, "progress");
  checked_json_object(metrics, "metrics");
  BlobRef blob = commit_blob(cartridge);
  store_common::BlobGuard guard(blob_path(blob.id));
  DatablockRecord record;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    Transaction tx(db());
    record = record_cartridge_locked(owner, id, blob, progress, metrics);
    tx.commit();
  }
  guard.disarm();
  remove_job_dir(record.run_id);
  return record;
}

DatablockRecord Store::record_cartridge_locked(const Owner& owner, const std::string& id, const BlobRef& blob,
                                               const std::string& progress, const std::string& metrics) {
  insert_blob_locked(blob);
  return transition_locked(owner, id, {"running"}, "succeeded",
                           ", finished_at = ?3, progress = ?4, metrics = ?5, blob_id = ?6",
                           {progress, metrics, blob.id});
}

DatablockRecord Store::fail_datablock(const Owner& owner, const std::string& id, const std::string& code,
                                      const std::string& message) {
  DatablockRecord record;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    Transaction tx(db());
    record = transition_locked(owner, id, {"queued", "running"}, "failed",
                               ", finished_at = ?3, error_code = ?4, error_message = ?5", {code, message});
    tx.commit();
  }
  remove_job_dir(record.run_id);
  return record;
}

DatablockRecord Store::cancel_datablock(const Owner& owner, const std::string& id) {
  DatablockRecord record;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    Transaction tx(db());
    record = transition_locked(owner, id, {"queued", "running"}, "cancelled", ", finished_at = ?3");
    tx.commit();
  }
  remove_job_dir(record.run_id);
  return record;
}

std::string Store::job_dir(const Owner& owner, const std::string& id) {
  std::lock_guard<std::mutex> lock(mutex_);
  DatablockRecord record = get_datablock_locked(owner, id);
  if (is_terminal(record.status)) {
    throw ConflictError("datablock '" + record.id() + "' is " + record.status + "; its job has ended");
  }
  const std::string path = job_dir_path(record.run_id);
  store_io::make_dirs(path);
  return path;
}

Store::BlobRef Store::datablock_blob_locked(const Owner& owner, const std::string& id) {
  DatablockRecord record = get_datablock_locked(owner, id);
  Stmt s(*db_, "SELECT b.id, b.bytes, b.crc32 FROM datablocks d JOIN blobs b ON b.id = d.blob_id WHERE d.run_id = ?1");
  s.bind(1, record.run_id);
  if (record.status != "succeeded" || !s.step()) {
    throw ConflictError("datablock '" + record.id() + "' has no cartridge (status: " + record.status + ")");
  }
  return BlobRef{s.text(0), s.int64(1), static_cast<uint32_t>(s.int64(2))};
}

std::string Store::datablock_cartridge_path(const Owner& owner, const std::string& id) {
  BlobRef blob;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    blob = datablock_blob_locked(owner, id);
  }
  return checked_blob_path(blob, "cartridge of datablock '" + id + "'");
}

BlobContent Store::datablock_content(const Owner& owner, const std::string& id) {
  BlobRef blob;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    blob = datablock_blob_locked(owner, id);
  }
  return content_of(blob, "cartridge of datablock '" + id + "'");
}

void Store::verify_datablock(const Owner& owner, const std::string& id) {
  BlobRef blob;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    blob = datablock_blob_locked(owner, id);
  }
  read_blob(blob, "cartridge of datablock '" + id + "'", /*keep=*/false);
}

}  // namespace cartridges
