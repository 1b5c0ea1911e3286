// Store: users and keys, files with owners, pagination, durability rules, fault injection.
#include "cartridges/store.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <random>
#include <set>
#include <thread>

#include "store/blob_io.h"
#include "test_database.h"

namespace fs = std::filesystem;
using namespace cartridges;

namespace {

// Every case runs on SQLite and on PostgreSQL (test_database.h).
class StoreTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("store_test_" + std::to_string(::getpid()) + "_" + store_io::random_token(8, store_io::kLowerHex));
    database_ = std::make_unique<store_testing::TestDatabase>(GetParam(), dir_);
    if (!database_->skip_reason.empty()) GTEST_SKIP() << database_->skip_reason;
  }
  void TearDown() override {
    database_.reset();
    fs::remove_all(dir_);
  }

  std::unique_ptr<Store> open(bool check = true) {
    StoreOptions o;
    o.data_dir = dir_.string();
    o.database_url = database_->url;
    o.check_at_open = check;
    return std::make_unique<Store>(o);
  }

  FileRecord put(Store& s, const Owner& owner, const std::string& content, const std::string& name = "a.txt",
                 const std::string& purpose = "assistants") {
    auto w = s.begin_blob();
    w->write(content.data(), content.size());
    return s.create_file(owner, *w, name, purpose);
  }

  static std::string slurp(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  }

  // Regular files under blobs/ (not tmp/).
  std::set<std::string> blob_names() const {
    std::set<std::string> out;
    for (const auto& e : fs::directory_iterator(dir_ / "blobs")) {
      if (e.is_regular_file()) out.insert(e.path().filename().string());
    }
    return out;
  }

  fs::path dir_;
  std::unique_ptr<store_testing::TestDatabase> database_;
};

INSTANTIATE_TEST_SUITE_P(Backends, StoreTest, ::testing::Values("sqlite", "postgresql"),
                         [](const auto& info) { return info.param; });

TEST(StoreIo, Crc32MatchesKnownVector) {
  const std::string s = "123456789";
  EXPECT_EQ(store_io::crc32_update(0, s.data(), s.size()), 0xCBF43926u);
  // Continuing over pieces equals one pass (exercises the 8-byte path and the tail).
  std::string long_text(1000, 'x');
  for (size_t i = 0; i < long_text.size(); ++i) long_text[i] = static_cast<char>(i * 31);
  uint32_t whole = store_io::crc32_update(0, long_text.data(), long_text.size());
  uint32_t parts = store_io::crc32_update(0, long_text.data(), 13);
  parts = store_io::crc32_update(parts, long_text.data() + 13, long_text.size() - 13);
  EXPECT_EQ(whole, parts);
}

TEST(StoreIo, RandomTokenUsesAlphabet) {
  std::string t = store_io::random_token(200, "ab");
  EXPECT_EQ(t.size(), 200u);
  EXPECT_EQ(t.find_first_not_of("ab"), std::string::npos);
  EXPECT_NE(store_io::random_token(24, store_io::kAlphanumeric), store_io::random_token(24, store_io::kAlphanumeric));
}

TEST_P(StoreTest, MigratesAndReopens) {
  {
    auto s = open();
    EXPECT_EQ(s->schema_version(), 3);
    s->create_user("alice");
  }
  auto s = open();
  EXPECT_EQ(s->schema_version(), 3);
  ASSERT_TRUE(s->find_user("alice"));
  EXPECT_FALSE(s->find_user("bob"));
}

TEST_P(StoreTest, RefusesNewerSchema) {
  open().reset();
  ASSERT_EQ(database_->exec(database_->postgres() ? "UPDATE cartridges_schema SET version = 99"
                                                  : "PRAGMA user_version = 99"),
            "");
  try {
    open();
    FAIL() << "expected StoreError";
  } catch (const StoreError& e) {
    EXPECT_NE(std::string(e.what()).find("newer"), std::string::npos) << e.what();
  }
}

// Replicas: several stores open the same database at once (the migrations run once, under
// the schema lock) and write concurrently; each sees the others' records.
TEST_P(StoreTest, StoresOpenedAtOnceShareTheDatabase) {
  constexpr int kStores = 4;
  constexpr int kUsersEach = 10;
  std::vector<std::unique_ptr<Store>> stores(kStores);
  std::vector<std::string> errors(kStores);
  {
    std::vector<std::thread> threads;
    for (int i = 0; i < kStores; ++i) {
      threads.emplace_back([&, i] {
        try {
          stores[static_cast<size_t>(i)] = open();
          for (int u = 0; u < kUsersEach; ++u) {
            stores[static_cast<size_t>(i)]->create_user("s" + std::to_string(i) + "u" + std::to_string(u));
          }
        } catch (const std::exception& e) {
          errors[static_cast<size_t>(i)] = e.what();
        }
      });
    }
    for (auto& t : threads) t.join();
  }
  for (const auto& e : errors) EXPECT_EQ(e, "");
  std::set<int64_t> ids;
  for (const auto& s : stores) {
    ASSERT_TRUE(s);
    EXPECT_EQ(s->schema_version(), 3);
    auto users = s->list_users();
    EXPECT_EQ(users.size(), static_cast<size_t>(kStores * kUsersEach));
    for (const auto& u : users) ids.insert(u.id);
  }
  EXPECT_EQ(ids.size(), static_cast<size_t>(kStores * kUsersEach));
  // A file recorded through one store is read through another (same data directory).
  Owner a = Owner::user(stores[0]->find_user("s0u0")->id);
  FileRecord f = put(*stores[0], a, "shared");
  EXPECT_EQ(slurp(stores[3]->file_content_path(a, f.id)), "shared");
  stores[2]->delete_file(a, f.id);
  EXPECT_THROW(stores[1]->get_file(a, f.id), NotFoundError);
}

TEST(StoreDatabaseUrl, UnreachableServerIsUnavailableAndBadUrlsAreRefused) {
  const fs::path dir = fs::temp_directory_path() / ("store_url_test_" + std::to_string(::getpid()));
  StoreOptions o;
  o.data_dir = dir.string();
  o.database_url = "postgresql://nobody:secret@127.0.0.1:1/nothing";
  try {
    Store s(o);
    FAIL() << "expected UnavailableError";
  } catch (const UnavailableError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("cannot reach the database postgresql://127.0.0.1:1/nothing"), std::string::npos) << what;
    EXPECT_EQ(what.find("secret"), std::string::npos) << "the password leaked: " << what;
  }
  o.database_url = "mysql://somewhere/db";
  EXPECT_THROW(Store{o}, std::invalid_argument);
  // sqlite:///path names the SQLite file.
  o.database_url = "sqlite://" + (dir / "elsewhere.db").string();
  {
    Store s(o);
    s.create_user("alice");
  }
  EXPECT_TRUE(fs::exists(dir / "elsewhere.db"));
  EXPECT_FALSE(fs::exists(dir / "store.db"));
  fs::remove_all(dir);
}

TEST_P(StoreTest, UsersAndKeys) {
  auto s = open();
  User alice = s->create_user("alice");
  EXPECT_THROW(s->create_user("alice"), ConflictError);
  EXPECT_THROW(s->create_user("bad name"), std::invalid_argument);
  EXPECT_THROW(s->create_user(""), std::invalid_argument);
  const std::string hash(64, 'a');
  ApiKeyInfo key = s->add_key(alice.id, hash, "sk-cart-abc");
  EXPECT_EQ(key.user_name, "alice");
  EXPECT_THROW(s->add_key(alice.id, hash, "dup"), ConflictError);
  EXPECT_THROW(s->add_key(alice.id + 100, std::string(64, 'b'), "x"), NotFoundError);
  auto found = s->user_for_key(hash);
  ASSERT_TRUE(found);
  EXPECT_EQ(found->id, alice.id);
  EXPECT_FALSE(s->user_for_key(std::string(64, 'c')));
  ASSERT_EQ(s->list_keys().size(), 1u);
  s->revoke_key(key.id);
  EXPECT_FALSE(s->user_for_key(hash));
  EXPECT_TRUE(s->list_keys()[0].revoked_at.has_value());
  EXPECT_THROW(s->revoke_key(key.id), NotFoundError);
  EXPECT_EQ(s->list_users().size(), 1u);
}

TEST_P(StoreTest, FileRoundTrip) {
  auto s = open();
  Owner a = Owner::user(s->create_user("a").id);
  FileRecord f = put(*s, a, "hello world", "notes.txt", "cartridge-training");
  EXPECT_EQ(f.id.rfind("file-", 0), 0u);
  EXPECT_EQ(f.id.size(), 5u + 24u);
  EXPECT_EQ(f.bytes, 11);
  EXPECT_EQ(f.status, "uploaded");
  EXPECT_EQ(slurp(s->file_content_path(a, f.id)), "hello world");
  s->verify_file(a, f.id);
  EXPECT_THROW(s->file_text(a, f.id), ConflictError);  // not processed yet
  s->set_file_processed(a, f.id, std::nullopt);
  EXPECT_EQ(s->file_text(a, f.id), "hello world");  // the content is the text
  s->set_file_processed(a, f.id, std::string("extracted"));
  EXPECT_EQ(s->file_text(a, f.id), "extracted");
  EXPECT_EQ(s->get_file(a, f.id).status, "processed");
  EXPECT_EQ(blob_names().size(), 2u);  // content + text
  s->set_file_error(a, f.id, "bad bytes");
  FileRecord e = s->get_file(a, f.id);
  EXPECT_EQ(e.status, "error");
  EXPECT_EQ(e.status_details.value_or(""), "bad bytes");
  EXPECT_EQ(blob_names().size(), 1u);  // the old text is gone
  s->delete_file(a, f.id);
  EXPECT_THROW(s->get_file(a, f.id), NotFoundError);
  EXPECT_TRUE(blob_names().empty());
  EXPECT_TRUE(fs::is_empty(dir_ / "blobs" / "tmp"));
}

TEST_P(StoreTest, OwnersAreIsolated) {
  auto s = open();
  Owner a = Owner::user(s->create_user("a").id);
  Owner b = Owner::user(s->create_user("b").id);
  FileRecord f = put(*s, a, "secret");
  s->set_file_processed(a, f.id, std::nullopt);
  auto message = [&](auto&& fn) -> std::string {
    try {
      fn();
    } catch (const NotFoundError& e) {
      return e.what();
    }
    return "no error";
  };
  // B gets exactly what a missing id gets.
  const std::string missing = "file-doesnotexist0000000000";
  auto expect_same = [&](auto call) {
    std::string foreign = message([&] { call(f.id); });
    std::string absent = message([&] { call(missing); });
    EXPECT_NE(foreign, "no error");
    EXPECT_EQ(foreign.replace(foreign.find(f.id), f.id.size(), missing), absent);
  };
  expect_same([&](const std::string& id) { s->get_file(b, id); });
  expect_same([&](const std::string& id) { s->file_content_path(b, id); });
  expect_same([&](const std::string& id) { s->file_text(b, id); });
  expect_same([&](const std::string& id) { s->verify_file(b, id); });
  expect_same([&](const std::string& id) { s->set_file_error(b, id, "x"); });
  expect_same([&](const std::string& id) { s->set_file_processed(b, id, std::string("x")); });
  expect_same([&](const std::string& id) { s->delete_file(b, id); });
  expect_same([&](const std::string& id) {
    FileQuery q;
    q.after = id;
    s->list_files(b, q);
  });
  EXPECT_TRUE(s->list_files(b, {}).data.empty());
  EXPECT_EQ(s->list_files(a, {}).data.size(), 1u);
  EXPECT_EQ(blob_names().size(), 1u);  // B's failed set_file_processed left no text blob
  // The admin sees and acts on everything.
  Owner admin = Owner::administrator();
  EXPECT_EQ(s->get_file(admin, f.id).owner_id, a.user_id);
  EXPECT_EQ(s->list_files(admin, {}).data.size(), 1u);
  s->delete_file(admin, f.id);
  EXPECT_THROW(s->get_file(a, f.id), NotFoundError);
}

TEST_P(StoreTest, CursorPagination) {
  auto s = open();
  Owner a = Owner::user(s->create_user("a").id);
  std::vector<std::string> ids;
  for (int i = 0; i < 7; ++i) ids.push_back(put(*s, a, "x" + std::to_string(i), "f.txt", i % 2 ? "assistants" : "cartridge-training").id);
  // Ascending walk in pages of 3.
  std::vector<std::string> seen;
  FileQuery q;
  q.limit = 3;
  q.descending = false;
  while (true) {
    FilePage p = s->list_files(a, q);
    for (auto& f : p.data) seen.push_back(f.id);
    if (!p.has_more) break;
    q.after = p.data.back().id;
  }
  EXPECT_EQ(seen, ids);
  // Descending is the reverse.
  FileQuery d;
  FilePage all = s->list_files(a, d);
  ASSERT_EQ(all.data.size(), 7u);
  EXPECT_FALSE(all.has_more);
  EXPECT_EQ(all.data.front().id, ids.back());
  d.after = ids[3];
  d.limit = 2;
  FilePage page = s->list_files(a, d);
  ASSERT_EQ(page.data.size(), 2u);
  EXPECT_EQ(page.data[0].id, ids[2]);
  EXPECT_TRUE(page.has_more);
  // Purpose filter.
  FileQuery p;
  p.purpose = "assistants";
  EXPECT_EQ(s->list_files(a, p).data.size(), 3u);
  FileQuery st;
  st.status = "uploaded";
  EXPECT_EQ(s->list_files(a, st).data.size(), 7u);
  FileQuery bad;
  bad.limit = 0;
  EXPECT_THROW(s->list_files(a, bad), std::invalid_argument);
}

TEST_P(StoreTest, AbortedAndDroppedWritesLeaveNothing) {
  auto s = open();
  {
    auto w = s->begin_blob();
    w->write("partial", 7);
    EXPECT_FALSE(fs::is_empty(dir_ / "blobs" / "tmp"));
  }  // dropped without commit
  auto w = s->begin_blob();
  w->write("partial", 7);
  w->abort();
  EXPECT_THROW(w->write("x", 1), StoreError);
  EXPECT_TRUE(fs::is_empty(dir_ / "blobs" / "tmp"));
  EXPECT_TRUE(blob_names().empty());
  s->close();
  EXPECT_THROW(s->list_users(), StoreError);
}

TEST_P(StoreTest, SweepRemovesLeftoversOfACrash) {
  std::string kept_id;
  Owner a;
  {
    auto s = open();
    a = Owner::user(s->create_user("a").id);
    kept_id = put(*s, a, "keep me").id;
  }
  // What a crash can leave: a temporary mid-write, and a blob renamed but never recorded.
  std::ofstream(dir_ / "blobs" / "tmp" / "deadbeef") << "half a file";
  std::ofstream(dir_ / "blobs" / "0123456789abcdef0123456789abcdef") << "unrecorded";
  auto s = open();
  EXPECT_EQ(s->swept_at_open(), 2);
  EXPECT_TRUE(fs::is_empty(dir_ / "blobs" / "tmp"));
  EXPECT_EQ(blob_names().size(), 1u);
  EXPECT_EQ(slurp(s->file_content_path(a, kept_id)), "keep me");
}

TEST_P(StoreTest, NoSweepWhileAnotherStoreIsOpen) {
  auto first = open();
  auto w = first->begin_blob();
  w->write("in flight", 9);
  auto second = open();  // must not remove the first one's write in progress
  EXPECT_EQ(second->swept_at_open(), 0);
  Owner a = Owner::user(second->create_user("a").id);
  FileRecord f = first->create_file(a, *w, "x.txt", "assistants");
  EXPECT_EQ(slurp(second->file_content_path(a, f.id)), "in flight");
}

// ---- fault injection: damaged blobs and databases give clear errors, never a crash ----

TEST_P(StoreTest, DamagedBlobsAreReportedAndOthersStillRead) {
  auto s = open();
  Owner a = Owner::user(s->create_user("a").id);
  FileRecord truncated = put(*s, a, "0123456789");
  FileRecord flipped = put(*s, a, "abcdefghij");
  FileRecord removed = put(*s, a, "klmnopqrst");
  FileRecord healthy = put(*s, a, "healthy!");
  for (const auto* f : {&truncated, &flipped, &removed, &healthy}) s->set_file_processed(a, f->id, std::nullopt);

  auto path_of = [&](const FileRecord& f) { return s->file_content_path(a, f.id); };
  fs::resize_file(path_of(truncated), 4);
  {
    std::fstream io(path_of(flipped), std::ios::in | std::ios::out | std::ios::binary);
    io.seekp(3);
    io.put('X');
  }
  fs::remove(path_of(removed));

  EXPECT_THROW(s->file_content_path(a, truncated.id), CorruptError);
  EXPECT_THROW(s->verify_file(a, truncated.id), CorruptError);
  EXPECT_THROW(s->file_text(a, truncated.id), CorruptError);
  // Same size, wrong bytes: only the checksum can tell.
  EXPECT_NO_THROW(s->file_content_path(a, flipped.id));
  try {
    s->verify_file(a, flipped.id);
    FAIL() << "expected CorruptError";
  } catch (const CorruptError& e) {
    EXPECT_NE(std::string(e.what()).find("checksum"), std::string::npos) << e.what();
  }
  EXPECT_THROW(s->file_text(a, flipped.id), CorruptError);
  EXPECT_THROW(s->file_content_path(a, removed.id), CorruptError);
  EXPECT_THROW(s->file_text(a, removed.id), CorruptError);

  EXPECT_EQ(s->file_text(a, healthy.id), "healthy!");
  s->verify_file(a, healthy.id);
  EXPECT_EQ(s->list_files(a, {}).data.size(), 4u);
  // A damaged file can still be deleted.
  s->delete_file(a, removed.id);
  EXPECT_EQ(s->list_files(a, {}).data.size(), 3u);
}

TEST_P(StoreTest, TruncatedDatabaseIsAClearError) {
  if (database_->postgres()) GTEST_SKIP() << "damage to SQLite's own file";
  {
    auto s = open();
    for (int i = 0; i < 50; ++i) s->create_user("user" + std::to_string(i));
  }
  const fs::path db = dir_ / "store.db";
  fs::resize_file(db, fs::file_size(db) / 2);
  EXPECT_THROW(
      {
        auto s = open();
        s->list_users();
      },
      StoreError);
}

TEST_P(StoreTest, GarbageDatabaseIsACorruptError) {
  if (database_->postgres()) GTEST_SKIP() << "damage to SQLite's own file";
  open().reset();
  {
    std::ofstream out(dir_ / "store.db", std::ios::binary | std::ios::trunc);
    std::mt19937 rng(7);
    for (int i = 0; i < 8192; ++i) out.put(static_cast<char>(rng()));
  }
  try {
    open();
    FAIL() << "expected CorruptError";
  } catch (const CorruptError& e) {
    EXPECT_NE(std::string(e.what()).find("store.db"), std::string::npos) << e.what();
  }
}

TEST_P(StoreTest, DamagedPageFoundByTheCheckAtOpen) {
  if (database_->postgres()) GTEST_SKIP() << "damage to SQLite's own file";
  {
    auto s = open();
    Owner a = Owner::user(s->create_user("a").id);
    for (int i = 0; i < 200; ++i) put(*s, a, "x", "file" + std::to_string(i) + ".txt");
  }
  // Overwrite the middle of page 3 onwards (a b-tree page, not the header).
  const fs::path db = dir_ / "store.db";
  ASSERT_GT(fs::file_size(db), 4u * 4096u);
  {
    std::fstream io(db, std::ios::in | std::ios::out | std::ios::binary);
    io.seekp(2 * 4096 + 8);
    for (int i = 0; i < 2000; ++i) io.put(static_cast<char>(0xA5));
  }
  EXPECT_THROW(open(), StoreError);
  // Without the check the store opens; reads that hit the damage fail with a StoreError.
  auto s = open(/*check=*/false);
  EXPECT_THROW(
      {
        auto a = s->find_user("a");
        ASSERT_TRUE(a);
        s->list_files(Owner::user(a->id), {});
      },
      StoreError);
}

}  // namespace
