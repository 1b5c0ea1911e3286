// Store datablocks: ids, isolation, forward-only status, deletion, job scratch directories,
// fault injection on the cartridge blob.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "cartridges/store.h"
#include "store/blob_io.h"
#include "test_database.h"

namespace fs = std::filesystem;
using namespace cartridges;

namespace {

// Every case runs on SQLite and on PostgreSQL (test_database.h).
class DatablocksTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("datablocks_test_" + std::to_string(::getpid()) + "_" + store_io::random_token(8, store_io::kLowerHex));
    database_ = std::make_unique<store_testing::TestDatabase>(GetParam(), dir_);
    if (!database_->skip_reason.empty()) GTEST_SKIP() << database_->skip_reason;
    store_ = open();
    alice_ = Owner::user(store_->create_user("alice").id);
    bob_ = Owner::user(store_->create_user("bob").id);
    file_ = put_file(alice_);
  }
  void TearDown() override {
    store_.reset();
    database_.reset();
    fs::remove_all(dir_);
  }

  std::unique_ptr<Store> open() {
    StoreOptions o;
    o.data_dir = dir_.string();
    o.database_url = database_->url;
    return std::make_unique<Store>(o);
  }

  std::string put_file(const Owner& owner) {
    auto w = store_->begin_blob();
    w->write("some text", 9);
    return store_->create_file(owner, *w, "doc.txt", "cartridge-training").id;
  }

  DatablockRecord create(const Owner& owner, const std::string& file, const std::string& project = "handbook") {
    NewDatablock spec;
    spec.project = project;
    spec.model = "tiny";
    spec.training_files = {file};
    spec.config = R"({"num_tokens": 16})";
    spec.num_tokens = 16;
    return store_->create_datablock(owner, spec);
  }

  // Runs a datablock to "succeeded" with `content` as its cartridge.
  DatablockRecord succeed(const Owner& owner, const std::string& id, const std::string& content) {
    store_->start_datablock(owner, id, "fp");
    auto w = store_->begin_blob();
    w->write(content.data(), content.size());
    return store_->succeed_datablock(owner, id, *w, R"({"stage":"done"})", R"({"loss":0.5})");
  }

  size_t blob_count() const {
    size_t n = 0;
    for (const auto& e : fs::directory_iterator(dir_ / "blobs")) n += e.is_regular_file();
    return n;
  }

  fs::path dir_;
  std::unique_ptr<store_testing::TestDatabase> database_;
  std::unique_ptr<Store> store_;
  Owner alice_, bob_;
  std::string file_;
};

INSTANTIATE_TEST_SUITE_P(Backends, DatablocksTest, ::testing::Values("sqlite", "postgresql"),
                         [](const auto& info) { return info.param; });

TEST_P(DatablocksTest, CreatedQueuedWithAFullId) {
  DatablockRecord d = create(alice_, file_);
  EXPECT_EQ(d.status, "queued");
  EXPECT_EQ(d.run_id.size(), 12u);
  EXPECT_EQ(d.run_id.find_first_not_of("abcdefghijklmnopqrstuvwxyz0123456789"), std::string::npos);
  EXPECT_EQ(d.id(), "alice/handbook/" + d.run_id);
  EXPECT_EQ(d.training_files, std::vector<std::string>{file_});
  EXPECT_EQ(d.config, R"({"num_tokens": 16})");
  EXPECT_EQ(d.progress, R"({"stage":"queued","completed":0,"total":0})");
  EXPECT_FALSE(d.started_at.has_value());
  EXPECT_FALSE(d.bytes.has_value());
  EXPECT_EQ(store_->get_datablock(alice_, d.run_id).run_id, d.run_id);
  EXPECT_EQ(store_->get_datablock(alice_, d.id()).run_id, d.run_id);
  // A full id must match owner and project.
  EXPECT_THROW(store_->get_datablock(alice_, "alice/other/" + d.run_id), NotFoundError);
  EXPECT_THROW(store_->get_datablock(alice_, "bob/handbook/" + d.run_id), NotFoundError);
  EXPECT_THROW(store_->get_datablock(alice_, "/handbook/" + d.run_id), NotFoundError);
  EXPECT_THROW(store_->get_datablock(alice_, "a/b/c/" + d.run_id), NotFoundError);
  EXPECT_NE(create(alice_, file_).run_id, d.run_id);
}

TEST_P(DatablocksTest, BadSpecsAreRefused) {
  EXPECT_THROW(create(alice_, file_, "bad name"), std::invalid_argument);
  EXPECT_THROW(create(alice_, file_, std::string(65, 'x')), std::invalid_argument);
  EXPECT_THROW(create(alice_, "file-doesnotexist"), NotFoundError);
  NewDatablock spec;
  spec.training_files = {file_};
  spec.num_tokens = 4;
  spec.config = "[1]";
  EXPECT_THROW(store_->create_datablock(alice_, spec), std::invalid_argument);
  spec.config = "{}";
  spec.training_files = {};
  EXPECT_THROW(store_->create_datablock(alice_, spec), std::invalid_argument);
}

TEST_P(DatablocksTest, OwnersAreIsolated) {
  DatablockRecord d = create(alice_, file_);
  // Bob cannot train on Alice's file, nor see, change or delete Alice's datablock.
  EXPECT_THROW(create(bob_, file_), NotFoundError);
  for (const std::string& id : {d.run_id, d.id()}) {
    EXPECT_THROW(store_->get_datablock(bob_, id), NotFoundError);
    EXPECT_THROW(store_->start_datablock(bob_, id, "fp"), NotFoundError);
    EXPECT_THROW(store_->update_datablock_progress(bob_, id, "{}", "{}"), NotFoundError);
    EXPECT_THROW(store_->fail_datablock(bob_, id, "x", "y"), NotFoundError);
    EXPECT_THROW(store_->cancel_datablock(bob_, id), NotFoundError);
    EXPECT_THROW(store_->job_dir(bob_, id), NotFoundError);
    EXPECT_THROW(store_->datablock_cartridge_path(bob_, id), NotFoundError);
    EXPECT_THROW(store_->delete_datablock(bob_, id), NotFoundError);
  }
  EXPECT_THROW(store_->list_datablocks(bob_, DatablockQuery{std::nullopt, d.run_id}), NotFoundError);
  EXPECT_TRUE(store_->list_datablocks(bob_, {}).data.empty());
  // Same message for "someone else's" and "missing": nothing leaks.
  std::string foreign, missing;
  try { store_->get_datablock(bob_, d.run_id); } catch (const NotFoundError& e) { foreign = e.what(); }
  try { store_->get_datablock(bob_, "zzzzzzzzzzzz"); } catch (const NotFoundError& e) { missing = e.what(); }
  EXPECT_EQ(foreign.substr(0, 20), missing.substr(0, 20));
  // The admin sees it.
  EXPECT_EQ(store_->get_datablock(Owner::administrator(), d.id()).owner_name, "alice");
  EXPECT_EQ(store_->list_datablocks(Owner::administrator(), {}).data.size(), 1u);
  EXPECT_EQ(store_->get_datablock(alice_, d.run_id).status, "queued");
}

TEST_P(DatablocksTest, StatusMovesOnlyForward) {
  DatablockRecord d = create(alice_, file_);
  // queued: cannot succeed without running, cannot report progress.
  auto w = store_->begin_blob();
  EXPECT_THROW(store_->succeed_datablock(alice_, d.run_id, *w, "{}", "{}"), ConflictError);
  EXPECT_THROW(store_->update_datablock_progress(alice_, d.run_id, "{}", "{}"), ConflictError);
  DatablockRecord running = store_->start_datablock(alice_, d.run_id, "fp-1");
  EXPECT_EQ(running.status, "running");
  EXPECT_EQ(running.attempts, 1);
  EXPECT_EQ(running.fingerprint, "fp-1");
  ASSERT_TRUE(running.started_at.has_value());
  // A resume stays running and counts an attempt; started_at is kept.
  DatablockRecord resumed = store_->start_datablock(alice_, d.run_id, "fp-1");
  EXPECT_EQ(resumed.attempts, 2);
  EXPECT_EQ(resumed.started_at, running.started_at);
  store_->update_datablock_progress(alice_, d.run_id, R"({"stage":"training","completed":3,"total":9})",
                                    R"({"loss":1.5})");
  EXPECT_EQ(store_->get_datablock(alice_, d.run_id).metrics, R"({"loss":1.5})");
  EXPECT_THROW(store_->update_datablock_progress(alice_, d.run_id, "not json", "{}"), std::invalid_argument);
  DatablockRecord failed = store_->fail_datablock(alice_, d.run_id, "interrupted", "the server stopped");
  EXPECT_EQ(failed.status, "failed");
  EXPECT_EQ(failed.error_code, "interrupted");
  EXPECT_TRUE(failed.finished_at.has_value());
  // Terminal: nothing moves it any more.
  EXPECT_THROW(store_->start_datablock(alice_, d.run_id, "fp"), ConflictError);
  EXPECT_THROW(store_->cancel_datablock(alice_, d.run_id), ConflictError);
  EXPECT_THROW(store_->fail_datablock(alice_, d.run_id, "x", "y"), ConflictError);
  EXPECT_THROW(store_->update_datablock_progress(alice_, d.run_id, "{}", "{}"), ConflictError);
  EXPECT_THROW(store_->job_dir(alice_, d.run_id), ConflictError);
  EXPECT_THROW(store_->datablock_cartridge_path(alice_, d.run_id), ConflictError);

  DatablockRecord queued = create(alice_, file_);
  EXPECT_EQ(store_->cancel_datablock(alice_, queued.run_id).status, "cancelled");
  EXPECT_THROW(store_->start_datablock(alice_, queued.run_id, "fp"), ConflictError);

  DatablockRecord done = succeed(alice_, create(alice_, file_).run_id, "cartridge bytes");
  EXPECT_EQ(done.status, "succeeded");
  EXPECT_EQ(done.bytes, 15);
  EXPECT_THROW(store_->cancel_datablock(alice_, done.run_id), ConflictError);
  EXPECT_THROW(store_->start_datablock(alice_, done.run_id, "fp"), ConflictError);
}

TEST_P(DatablocksTest, StartRecordsWhatTheConfigLeftToTheCorpus) {
  NewDatablock spec;
  spec.model = "tiny";
  spec.training_files = {file_};
  spec.config = R"({"num_tokens": null})";
  spec.num_tokens = 0;  // decided by the job once it has read the files
  DatablockRecord d = store_->create_datablock(alice_, spec);
  EXPECT_EQ(d.num_tokens, 0);
  spec.num_tokens = -1;
  EXPECT_THROW(store_->create_datablock(alice_, spec), std::invalid_argument);
  EXPECT_THROW(store_->start_datablock(alice_, d.run_id, "fp", "not json", 304), std::invalid_argument);
  EXPECT_EQ(store_->get_datablock(alice_, d.run_id).status, "queued");  // a refused start changes nothing
  DatablockRecord started = store_->start_datablock(alice_, d.run_id, "fp", R"({"num_tokens":304})", 304);
  EXPECT_EQ(started.num_tokens, 304);
  EXPECT_EQ(started.config, R"({"num_tokens":304})");
  // A resume that passes neither keeps them.
  DatablockRecord resumed = store_->start_datablock(alice_, d.run_id, "fp");
  EXPECT_EQ(resumed.num_tokens, 304);
  EXPECT_EQ(resumed.config, R"({"num_tokens":304})");
  EXPECT_EQ(resumed.attempts, 2);
}

// Replicas on other machines: a running job's claimant keeps it while its heartbeat is
// fresh; its own claimant may resume it at once; anyone may once the lease has run out.
TEST_P(DatablocksTest, ARunningJobIsClaimedByOneWorkerAtATime) {
  const std::string id = create(alice_, file_).run_id;
  DatablockRecord started = store_->start_datablock(alice_, id, "fp", "", 0, "host-a:/data", 30);
  EXPECT_EQ(started.claimant, "host-a:/data");
  try {
    store_->start_datablock(alice_, id, "fp", "", 0, "host-b:/data", 30);
    FAIL() << "expected ConflictError";
  } catch (const ConflictError& e) {
    EXPECT_NE(std::string(e.what()).find("host-a:/data"), std::string::npos) << e.what();
  }
  EXPECT_EQ(store_->get_datablock(alice_, id).attempts, 1);
  EXPECT_EQ(store_->start_datablock(alice_, id, "fp", "", 0, "host-a:/data", 30).attempts, 2);
  // A lease of 0 s has run out already: the job is taken over.
  DatablockRecord taken = store_->start_datablock(alice_, id, "fp", "", 0, "host-b:/data", 0);
  EXPECT_EQ(taken.claimant, "host-b:/data");
  EXPECT_EQ(taken.attempts, 3);
}

TEST_P(DatablocksTest, TheDatabaseItselfRefusesABackwardStatus) {
  DatablockRecord d = succeed(alice_, create(alice_, file_).run_id, "x");
  store_.reset();
  std::string error = database_->exec("UPDATE datablocks SET status = 'running' WHERE run_id = '" + d.run_id + "'");
  EXPECT_NE(error.find("forward"), std::string::npos) << error;
}

TEST_P(DatablocksTest, ListsWithStatusFilterAndCursor) {
  std::vector<std::string> ids;
  for (int i = 0; i < 5; ++i) ids.push_back(create(alice_, file_).run_id);
  store_->cancel_datablock(alice_, ids[1]);
  create(bob_, put_file(bob_));
  DatablockPage all = store_->list_datablocks(alice_, {});
  ASSERT_EQ(all.data.size(), 5u);
  EXPECT_EQ(all.data.front().run_id, ids[4]);  // newest first
  EXPECT_FALSE(all.has_more);
  DatablockQuery q;
  q.status = "cancelled";
  ASSERT_EQ(store_->list_datablocks(alice_, q).data.size(), 1u);
  q = DatablockQuery{};
  q.limit = 2;
  q.descending = false;
  std::vector<std::string> walked;
  while (true) {
    DatablockPage page = store_->list_datablocks(alice_, q);
    for (const auto& d : page.data) walked.push_back(d.run_id);
    if (!page.has_more) break;
    q.after = page.data.back().id();  // full ids work as cursors too
  }
  EXPECT_EQ(walked, ids);
  q.limit = 0;
  EXPECT_THROW(store_->list_datablocks(alice_, q), std::invalid_argument);
}

TEST_P(DatablocksTest, DeleteRemovesRowBlobAndScratch) {
  DatablockRecord done = succeed(alice_, create(alice_, file_).run_id, "tensors");
  const size_t with_cartridge = blob_count();
  DatablockRecord running = create(alice_, file_);
  store_->start_datablock(alice_, running.run_id, "fp");
  fs::path scratch = store_->job_dir(alice_, running.run_id);
  std::ofstream(scratch / "checkpoint") << "state";
  store_->delete_datablock(alice_, running.id());
  EXPECT_FALSE(fs::exists(scratch));
  // The job notices on its next write.
  EXPECT_THROW(store_->update_datablock_progress(alice_, running.run_id, "{}", "{}"), NotFoundError);
  store_->delete_datablock(alice_, done.run_id);
  EXPECT_EQ(blob_count(), with_cartridge - 1);
  EXPECT_THROW(store_->get_datablock(alice_, done.run_id), NotFoundError);
  EXPECT_THROW(store_->delete_datablock(alice_, done.run_id), NotFoundError);
}

TEST_P(DatablocksTest, DeletingATrainingFileKeepsTheDatablock) {
  DatablockRecord done = succeed(alice_, create(alice_, file_).run_id, "self-contained");
  store_->delete_file(alice_, file_);
  DatablockRecord after = store_->get_datablock(alice_, done.run_id);
  EXPECT_EQ(after.training_files, std::vector<std::string>{file_});
  std::ifstream in(store_->datablock_cartridge_path(alice_, done.run_id));
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(in), {}), "self-contained");
  store_->verify_datablock(alice_, done.run_id);
}

TEST_P(DatablocksTest, ScratchDirectoriesLiveOnlyWithTheirJob) {
  DatablockRecord a = create(alice_, file_);
  DatablockRecord b = create(alice_, file_);
  store_->start_datablock(alice_, a.run_id, "fp");
  fs::path scratch_a = store_->job_dir(alice_, a.run_id);
  fs::path scratch_b = store_->job_dir(alice_, b.run_id);
  std::ofstream(scratch_a / "synthesis.pt") << "partial";
  EXPECT_TRUE(fs::is_directory(scratch_b));
  store_->fail_datablock(alice_, b.run_id, "file_not_processed", "file in error");
  EXPECT_FALSE(fs::exists(scratch_b));
  // A crash that leaves a directory of an ended or unknown job behind: the sweep removes it,
  // and keeps the live job's checkpoint.
  fs::create_directories(dir_ / "jobs" / b.run_id);
  fs::create_directories(dir_ / "jobs" / "unknownrun01");
  store_.reset();
  store_ = open();
  EXPECT_EQ(store_->swept_at_open(), 2);
  EXPECT_TRUE(fs::exists(scratch_a / "synthesis.pt"));
  EXPECT_FALSE(fs::exists(dir_ / "jobs" / b.run_id));
}

TEST_P(DatablocksTest, CrashBeforeRecordingACartridgeLeavesNothingVisible) {
  DatablockRecord d = create(alice_, file_);
  store_->start_datablock(alice_, d.run_id, "fp");
  const size_t before = blob_count();
  // The worker died while writing the cartridge (a temporary) or just after renaming it into
  // place but before recording it.
  store_.reset();
  std::ofstream(dir_ / "blobs" / "tmp" / "leftover") << "half a cartridge";
  std::ofstream(dir_ / "blobs" / "0123456789abcdef0123456789abcdef") << "renamed, not recorded";
  store_ = open();
  EXPECT_GE(store_->swept_at_open(), 2);
  EXPECT_EQ(blob_count(), before);
  DatablockRecord after = store_->get_datablock(alice_, d.run_id);
  EXPECT_EQ(after.status, "running");
  EXPECT_FALSE(after.bytes.has_value());
  EXPECT_THROW(store_->datablock_cartridge_path(alice_, d.run_id), ConflictError);
}

TEST_P(DatablocksTest, DamagedCartridgesAreReportedAndOthersStillRead) {
  DatablockRecord truncated = succeed(alice_, create(alice_, file_).run_id, "0123456789");
  DatablockRecord flipped = succeed(alice_, create(alice_, file_).run_id, "abcdefghij");
  DatablockRecord removed = succeed(alice_, create(alice_, file_).run_id, "klmnopqrst");
  DatablockRecord healthy = succeed(alice_, create(alice_, file_).run_id, "healthy!");
  auto path_of = [&](const DatablockRecord& d) { return store_->datablock_cartridge_path(alice_, d.run_id); };
  fs::resize_file(path_of(truncated), 4);
  {
    std::fstream io(path_of(flipped), std::ios::in | std::ios::out | std::ios::binary);
    io.seekp(3);
    io.put('X');
  }
  fs::remove(path_of(removed));

  EXPECT_THROW(store_->datablock_cartridge_path(alice_, truncated.run_id), CorruptError);
  EXPECT_THROW(store_->verify_datablock(alice_, truncated.run_id), CorruptError);
  EXPECT_NO_THROW(store_->datablock_cartridge_path(alice_, flipped.run_id));  // same size: only the CRC tells
  try {
    store_->verify_datablock(alice_, flipped.run_id);
    FAIL() << "expected CorruptError";
  } catch (const CorruptError& e) {
    EXPECT_NE(std::string(e.what()).find("checksum"), std::string::npos) << e.what();
  }
  EXPECT_THROW(store_->datablock_cartridge_path(alice_, removed.run_id), CorruptError);
  EXPECT_THROW(store_->verify_datablock(alice_, removed.run_id), CorruptError);
  store_->verify_datablock(alice_, healthy.run_id);
  // Damaged datablocks are still listed and can be deleted.
  EXPECT_EQ(store_->list_datablocks(alice_, {}).data.size(), 4u);
  store_->delete_datablock(alice_, removed.run_id);
  store_->delete_datablock(alice_, truncated.run_id);
  EXPECT_EQ(store_->list_datablocks(alice_, {}).data.size(), 2u);
}

}  // namespace

TEST_P(DatablocksTest, ImportedCartridgesAreSucceededAtOnce) {
  NewDatablock spec;
  spec.project = "imported";
  spec.model = "tiny";
  spec.config = R"({"imported_from": "peft"})";
  spec.num_tokens = 8;
  const size_t before = blob_count();
  auto w = store_->begin_blob();
  w->write("tensors", 7);
  DatablockRecord d = store_->import_datablock(alice_, spec, "fp", *w, R"({"stage":"done"})", "{}");
  EXPECT_EQ(d.status, "succeeded");
  EXPECT_EQ(d.id(), "alice/imported/" + d.run_id);
  EXPECT_TRUE(d.training_files.empty());
  EXPECT_EQ(d.fingerprint, "fp");
  EXPECT_TRUE(d.started_at.has_value() && d.finished_at.has_value());
  EXPECT_EQ(blob_count(), before + 1);
  EXPECT_EQ(store_->list_datablocks(alice_, {std::string("queued"), std::nullopt, 100, true}).data.size(), 0u);
  EXPECT_THROW(store_->get_datablock(bob_, d.run_id), NotFoundError);
  store_->delete_datablock(alice_, d.run_id);
  EXPECT_EQ(blob_count(), before);
  // A bad spec leaves no row and no blob behind.
  spec.project = "bad name";
  auto bad = store_->begin_blob();
  bad->write("x", 1);
  EXPECT_THROW(store_->import_datablock(alice_, spec, "fp", *bad, "{}", "{}"), std::invalid_argument);
  EXPECT_EQ(blob_count(), before);
  EXPECT_EQ(store_->list_datablocks(alice_, {}).data.size(), 0u);
}
