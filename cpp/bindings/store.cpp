// Python bindings: store.
#include <pybind11/stl.h>

#include "cartridges/store.h"
#include "common.h"

namespace cartridges::bindings {

namespace {

using StoreClass = py::class_<Store, std::shared_ptr<Store>>;

// StoreError (RuntimeError) and its subclasses NotFoundError, ConflictError, CorruptError,
// UnavailableError.
void bind_store_errors(py::module_& m) {
  // Translators run newest first, so the subclasses are registered after their base.
  auto& store_error = py::register_exception<StoreError>(m, "StoreError", PyExc_RuntimeError);
  py::register_exception<NotFoundError>(m, "NotFoundError", store_error.ptr());
  py::register_exception<ConflictError>(m, "ConflictError", store_error.ptr());
  py::register_exception<CorruptError>(m, "CorruptError", store_error.ptr());
  py::register_exception<UnavailableError>(m, "UnavailableError", store_error.ptr());
}

// BlobMirror implemented in Python (cartridges/blobs.py). Whatever the Python side raises
// becomes an UnavailableError naming it: the store cannot tell a network failure from others.
class PyBlobMirror : public BlobMirror {
 public:
  void upload(const std::string& blob_id, const std::string& local_path) override {
    guarded([&] { PYBIND11_OVERRIDE_PURE(void, BlobMirror, upload, blob_id, local_path); });
  }
  bool download(const std::string& blob_id, const std::string& local_path) override {
    bool found = false;
    guarded([&] { found = download_py(blob_id, local_path); });
    return found;
  }
  void remove(const std::string& blob_id) override {
    guarded([&] { PYBIND11_OVERRIDE_PURE(void, BlobMirror, remove, blob_id); });
  }
  void check() override {
    guarded([&] { PYBIND11_OVERRIDE_PURE(void, BlobMirror, check, ); });
  }

 private:
  bool download_py(const std::string& blob_id, const std::string& local_path) {
    PYBIND11_OVERRIDE_PURE(bool, BlobMirror, download, blob_id, local_path);
  }
  template <typename F>
  static void guarded(F&& call) {
    try {
      call();
    } catch (py::error_already_set& e) {
      std::string message;
      {
        py::gil_scoped_acquire gil;
        message = e.what();
      }
      // The exception's type and message, without the Python traceback pybind11 appends.
      message = message.substr(0, message.find("\n\nAt:"));
      throw UnavailableError("the object store failed: " + message);
    }
  }
};

void bind_blob_mirror(py::module_& m) {
  py::class_<BlobMirror, PyBlobMirror, std::shared_ptr<BlobMirror>>(
      m, "BlobMirror",
      "Subclass to keep the store's blobs in a remote object store: upload(blob_id, local_path), "
      "download(blob_id, local_path) -> bool (False: no such blob), remove(blob_id), check().")
      .def(py::init<>())
      .def("upload", &BlobMirror::upload, py::arg("blob_id"), py::arg("local_path"))
      .def("download", &BlobMirror::download, py::arg("blob_id"), py::arg("local_path"))
      .def("remove", &BlobMirror::remove, py::arg("blob_id"))
      .def("check", &BlobMirror::check);
}

// What the store's calls take and return: owners, users, keys, file records and pages.
void bind_store_records(py::module_& m) {
  py::class_<Owner>(m, "Owner", "Who is asking: a user, or the admin (acts on every user's objects).")
      .def(py::init([](int64_t user_id, bool admin) { return Owner{user_id, admin}; }), py::arg("user_id"),
           py::arg("admin") = false)
      .def_readonly("user_id", &Owner::user_id)
      .def_readonly("admin", &Owner::admin)
      .def("__repr__", [](const Owner& o) {
        return "Owner(user_id=" + std::to_string(o.user_id) + (o.admin ? ", admin=True)" : ")");
      });

  py::class_<User>(m, "User")
      .def_readonly("id", &User::id)
      .def_readonly("name", &User::name)
      .def_readonly("created_at", &User::created_at);

  py::class_<ApiKeyInfo>(m, "ApiKeyInfo")
      .def_readonly("id", &ApiKeyInfo::id)
      .def_readonly("user_id", &ApiKeyInfo::user_id)
      .def_readonly("user_name", &ApiKeyInfo::user_name)
      .def_readonly("hint", &ApiKeyInfo::hint)
      .def_readonly("created_at", &ApiKeyInfo::created_at)
      .def_readonly("revoked_at", &ApiKeyInfo::revoked_at);

  py::class_<BlobContent>(m, "BlobContent",
                          "Where a stored blob's bytes are read from: local_path, or (empty) the blob mirror's "
                          "object blob_id.")
      .def_readonly("blob_id", &BlobContent::blob_id)
      .def_readonly("bytes", &BlobContent::bytes)
      .def_readonly("local_path", &BlobContent::local_path);

  py::class_<FileRecord>(m, "FileRecord")
      .def_readonly("id", &FileRecord::id)
      .def_readonly("owner_id", &FileRecord::owner_id)
      .def_readonly("filename", &FileRecord::filename)
      .def_readonly("purpose", &FileRecord::purpose)
      .def_readonly("bytes", &FileRecord::bytes)
      .def_readonly("created_at", &FileRecord::created_at)
      .def_readonly("status", &FileRecord::status)
      .def_readonly("status_details", &FileRecord::status_details);

  py::class_<FilePage>(m, "FilePage")
      .def_readonly("data", &FilePage::data)
      .def_readonly("has_more", &FilePage::has_more);

}

// Datablock records and pages, and the writer of a new blob.
void bind_datablock_records(py::module_& m) {
  py::class_<DatablockRecord>(m, "DatablockRecord", "A datablock row; JSON columns are JSON strings.")
      .def_property_readonly("id", &DatablockRecord::id)
      .def_readonly("run_id", &DatablockRecord::run_id)
      .def_readonly("owner_id", &DatablockRecord::owner_id)
      .def_readonly("owner_name", &DatablockRecord::owner_name)
      .def_readonly("project", &DatablockRecord::project)
      .def_readonly("model", &DatablockRecord::model)
      .def_readonly("model_path", &DatablockRecord::model_path)
      .def_readonly("fingerprint", &DatablockRecord::fingerprint)
      .def_readonly("training_files", &DatablockRecord::training_files)
      .def_readonly("config", &DatablockRecord::config)
      .def_readonly("status", &DatablockRecord::status)
      .def_readonly("progress", &DatablockRecord::progress)
      .def_readonly("metrics", &DatablockRecord::metrics)
      .def_readonly("error_code", &DatablockRecord::error_code)
      .def_readonly("error_message", &DatablockRecord::error_message)
      .def_readonly("attempts", &DatablockRecord::attempts)
      .def_readonly("num_tokens", &DatablockRecord::num_tokens)
      .def_readonly("bytes", &DatablockRecord::bytes)
      .def_readonly("created_at", &DatablockRecord::created_at)
      .def_readonly("started_at", &DatablockRecord::started_at)
      .def_readonly("finished_at", &DatablockRecord::finished_at)
      .def_readonly("updated_at", &DatablockRecord::updated_at)
      .def_readonly("claimant", &DatablockRecord::claimant);

  py::class_<DatablockPage>(m, "DatablockPage")
      .def_readonly("data", &DatablockPage::data)
      .def_readonly("has_more", &DatablockPage::has_more);

  py::class_<BlobWriter>(m, "BlobWriter", "A blob being written to a temporary file; Store.create_file commits it.")
      .def(
          "write",
          [](BlobWriter& w, py::buffer data) {
            py::buffer_info info = data.request();
            if (info.ndim > 1 || (info.ndim == 1 && info.strides[0] != info.itemsize)) {
              throw py::value_error("BlobWriter.write: a contiguous bytes-like object");
            }
            py::gil_scoped_release release;
            w.write(static_cast<const char*>(info.ptr), static_cast<size_t>(info.size * info.itemsize));
          },
          py::arg("data"))
      .def("abort", &BlobWriter::abort, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("bytes", &BlobWriter::bytes)
      .def_property_readonly("open", &BlobWriter::open);

}

// Opening and closing, users and API keys, blob writers.
void bind_store_users_and_blobs(StoreClass& store) {
  store
      .def(py::init([](const std::string& data_dir, bool sync, bool check_at_open, const std::string& database_url,
                       std::shared_ptr<BlobMirror> blob_mirror) {
             StoreOptions options;
             options.data_dir = data_dir;
             options.database_url = database_url;
             options.blob_mirror = std::move(blob_mirror);
             options.sync = sync;
             options.check_at_open = check_at_open;
             py::gil_scoped_release release;
             return std::make_shared<Store>(options);
           }),
           py::arg("data_dir"), py::arg("sync") = true, py::arg("check_at_open") = true, py::arg("database_url") = "",
           py::arg("blob_mirror") = nullptr,
           py::keep_alive<1, 6>(),  // the Python mirror (its overrides) lives as long as the store
           "Opens the store: blobs under data_dir, records in SQLite there unless database_url names another\n"
           "database (sqlite:///path.db, or postgresql://user:password@host:port/db shared by replicas).\n"
           "With a blob_mirror, blobs live in it and data_dir/blobs is their local cache.")
      .def("close", &Store::close, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("data_dir", [](const Store& s) { return s.options().data_dir; })
      .def_property_readonly("schema_version", &Store::schema_version)
      .def("ping", &Store::ping, py::call_guard<py::gil_scoped_release>(),
           "Checks that the database and the blob mirror answer; UnavailableError when they do not.")
      .def_property_readonly("swept_at_open", &Store::swept_at_open)
      .def("recorded_blobs", &Store::recorded_blobs, py::call_guard<py::gil_scoped_release>(),
           "The ids of every recorded blob; a blob mirror's object that is not among them is an orphan once old.")
      .def("create_user", &Store::create_user, py::arg("name"), py::call_guard<py::gil_scoped_release>())
      .def("find_user", &Store::find_user, py::arg("name"), py::call_guard<py::gil_scoped_release>())
      .def("list_users", &Store::list_users, py::call_guard<py::gil_scoped_release>())
      .def("add_key", &Store::add_key, py::arg("user_id"), py::arg("key_hash"), py::arg("hint"),
           py::call_guard<py::gil_scoped_release>())
      .def("user_for_key", &Store::user_for_key, py::arg("key_hash"), py::call_guard<py::gil_scoped_release>())
      .def("list_keys", &Store::list_keys, py::call_guard<py::gil_scoped_release>())
      .def("revoke_key", &Store::revoke_key, py::arg("key_id"), py::call_guard<py::gil_scoped_release>())
      .def("begin_blob", &Store::begin_blob, py::call_guard<py::gil_scoped_release>());
}

// Files: create, read, list, delete, processing status, content.
void bind_store_files(StoreClass& store) {
  store
      .def("create_file", &Store::create_file, py::arg("owner"), py::arg("content"), py::arg("filename"),
           py::arg("purpose"), py::call_guard<py::gil_scoped_release>())
      .def("get_file", &Store::get_file, py::arg("owner"), py::arg("file_id"), py::call_guard<py::gil_scoped_release>())
      .def(
          "list_files",
          [](Store& s, const Owner& owner, std::optional<std::string> purpose, std::optional<std::string> status,
             std::optional<std::string> after, int64_t limit, bool descending) {
            FileQuery q{std::move(purpose), std::move(status), std::move(after), limit, descending};
            py::gil_scoped_release release;
            return s.list_files(owner, q);
          },
          py::arg("owner"), py::kw_only(), py::arg("purpose") = py::none(), py::arg("status") = py::none(),
          py::arg("after") = py::none(), py::arg("limit") = 10000, py::arg("descending") = true)
      .def("delete_file", &Store::delete_file, py::arg("owner"), py::arg("file_id"),
           py::call_guard<py::gil_scoped_release>())
      .def("set_file_processed", &Store::set_file_processed, py::arg("owner"), py::arg("file_id"),
           py::arg("text") = py::none(), py::call_guard<py::gil_scoped_release>())
      .def("set_file_error", &Store::set_file_error, py::arg("owner"), py::arg("file_id"), py::arg("details"),
           py::call_guard<py::gil_scoped_release>())
      .def("file_content_path", &Store::file_content_path, py::arg("owner"), py::arg("file_id"),
           py::call_guard<py::gil_scoped_release>())
      .def("file_content", &Store::file_content, py::arg("owner"), py::arg("file_id"),
           py::call_guard<py::gil_scoped_release>())
      .def("verify_file", &Store::verify_file, py::arg("owner"), py::arg("file_id"),
           py::call_guard<py::gil_scoped_release>())
      .def(
          "file_text",
          [](Store& s, const Owner& owner, const std::string& id) {
            std::string text;
            {
              py::gil_scoped_release release;
              text = s.file_text(owner, id);
            }
            return py::str(text);  // stored text is UTF-8
          },
          py::arg("owner"), py::arg("file_id"));
}

// Datablocks: create, read, list, delete, the job's transitions, the cartridge.
void bind_store_datablocks(StoreClass& store) {
  store
      .def(
          "create_datablock",
          [](Store& s, const Owner& owner, std::string project, std::string model, std::string model_path,
             std::vector<std::string> training_files, std::string config, int64_t num_tokens) {
            NewDatablock spec{std::move(project), std::move(model), std::move(model_path), std::move(training_files),
                              std::move(config), num_tokens};
            py::gil_scoped_release release;
            return s.create_datablock(owner, spec);
          },
          py::arg("owner"), py::kw_only(), py::arg("project"), py::arg("model"), py::arg("model_path"),
          py::arg("training_files"), py::arg("config"), py::arg("num_tokens"))
      .def("get_datablock", &Store::get_datablock, py::arg("owner"), py::arg("datablock_id"),
           py::call_guard<py::gil_scoped_release>())
      .def(
          "list_datablocks",
          [](Store& s, const Owner& owner, std::optional<std::string> status, std::optional<std::string> after,
             int64_t limit, bool descending) {
            DatablockQuery q{std::move(status), std::move(after), limit, descending};
            py::gil_scoped_release release;
            return s.list_datablocks(owner, q);
          },
          py::arg("owner"), py::kw_only(), py::arg("status") = py::none(), py::arg("after") = py::none(),
          py::arg("limit") = 10000, py::arg("descending") = true)
      .def("delete_datablock", &Store::delete_datablock, py::arg("owner"), py::arg("datablock_id"),
           py::call_guard<py::gil_scoped_release>())
      .def("start_datablock", &Store::start_datablock, py::arg("owner"), py::arg("datablock_id"),
           py::arg("fingerprint"), py::arg("config") = "", py::arg("num_tokens") = 0, py::arg("claimant") = "",
           py::arg("lease_s") = 0, py::call_guard<py::gil_scoped_release>())
      .def("update_datablock_progress", &Store::update_datablock_progress, py::arg("owner"), py::arg("datablock_id"),
           py::arg("progress"), py::arg("metrics"), py::call_guard<py::gil_scoped_release>())
      .def("succeed_datablock", &Store::succeed_datablock, py::arg("owner"), py::arg("datablock_id"),
           py::arg("cartridge"), py::arg("progress"), py::arg("metrics"), py::call_guard<py::gil_scoped_release>())
      .def(
          "import_datablock",
          [](Store& s, const Owner& owner, std::string project, std::string model, std::string model_path,
             std::string config, int64_t num_tokens, std::string fingerprint, BlobWriter& cartridge,
             std::string progress, std::string metrics, std::vector<std::string> training_files) {
            NewDatablock spec{std::move(project),        std::move(model),  std::move(model_path),
                              std::move(training_files), std::move(config), num_tokens};
            py::gil_scoped_release release;
            return s.import_datablock(owner, spec, fingerprint, cartridge, progress, metrics);
          },
          py::arg("owner"), py::kw_only(), py::arg("project"), py::arg("model"), py::arg("model_path"),
          py::arg("config"), py::arg("num_tokens"), py::arg("fingerprint"), py::arg("cartridge"),
          py::arg("progress"), py::arg("metrics"), py::arg("training_files") = std::vector<std::string>{})
      .def("fail_datablock", &Store::fail_datablock, py::arg("owner"), py::arg("datablock_id"), py::arg("code"),
           py::arg("message"), py::call_guard<py::gil_scoped_release>())
      .def("cancel_datablock", &Store::cancel_datablock, py::arg("owner"), py::arg("datablock_id"),
           py::call_guard<py::gil_scoped_release>())
      .def("job_dir", &Store::job_dir, py::arg("owner"), py::arg("datablock_id"),
           py::call_guard<py::gil_scoped_release>())
      .def("datablock_cartridge_path", &Store::datablock_cartridge_path, py::arg("owner"), py::arg("datablock_id"),
           py::call_guard<py::gil_scoped_release>())
      .def("datablock_content", &Store::datablock_content, py::arg("owner"), py::arg("datablock_id"),
           py::call_guard<py::gil_scoped_release>())
      .def("verify_datablock", &Store::verify_datablock, py::arg("owner"), py::arg("datablock_id"),
           py::call_guard<py::gil_scoped_release>());
}

}  // namespace

void bind_store(py::module_& m) {
  bind_store_errors(m);
  bind_blob_mirror(m);
  bind_store_records(m);
  bind_datablock_records(m);
  StoreClass store(m, "Store", "SQLite metadata + blob directory; every call takes the owner.");
  bind_store_users_and_blobs(store);
  bind_store_files(store);
  bind_store_datablocks(store);
}

}  // namespace cartridges::bindings
