"""Blobs in an S3 object store (CARTRIDGES_BLOB_URL), against moto's real HTTP S3 endpoint:
the store uploads before it records, fetches on first use, removes after deleting; an
unreachable store is an UnavailableError that records nothing. Then the whole topology: two
replicas with their own data directories, one PostgreSQL database and one bucket, a datablock
trained through one and served by the other."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from cartridges import Client
from cartridges.blobs import open_blob_mirror
from cartridges.store import BLOB_URL_ENV, DATABASE_URL_ENV, core, open_store
from s3_server import S3Server

from .conftest import LiveServer, running_replicas, served_by, upload_text
from .tiny_hf_model import DOCUMENT, TINY_TRAIN_CONFIG


def _objects(s3: S3Server, blob_url: str) -> set[str]:
    bucket, prefix = blob_url[len("s3://"):].split("/", 1)
    listed = s3.client().list_objects_v2(Bucket=bucket, Prefix=prefix + "/")
    return {item["Key"].rsplit("/", 1)[1] for item in listed.get("Contents", [])}


def _put(store, owner, content: bytes) -> str:
    writer = store.begin_blob()
    writer.write(content)
    return store.create_file(owner, writer, "a.txt", "assistants").id


def test_blobs_are_uploaded_fetched_on_first_use_and_removed(tmp_path: Path, s3_server: S3Server,
                                                            s3_blob_url: str) -> None:
    store = open_store(tmp_path / "data", sync=False, blob_url=s3_blob_url)
    owner = core().Owner(store.create_user("alice").id, False)
    file_id = _put(store, owner, b"x" * 100_000)
    local = {p.name for p in (tmp_path / "data" / "blobs").iterdir() if p.is_file()}
    assert _objects(s3_server, s3_blob_url) == local and len(local) == 1

    # Another machine's cache (here: an emptied one) fetches the blob on first use, checked.
    for name in local:
        (tmp_path / "data" / "blobs" / name).unlink()
    assert Path(store.file_content_path(owner, file_id)).read_bytes() == b"x" * 100_000
    store.verify_file(owner, file_id)

    # A blob the object store lost is a CorruptError naming it, not a crash.
    second = _put(store, owner, b"second")
    (lost_name,) = _objects(s3_server, s3_blob_url) - local
    bucket, prefix = s3_blob_url[len("s3://"):].split("/", 1)
    s3_server.client().delete_object(Bucket=bucket, Key=f"{prefix}/{lost_name}")
    for path in (tmp_path / "data" / "blobs").iterdir():
        if path.is_file() and path.name not in local:
            path.unlink()
    with pytest.raises(core().CorruptError, match="missing from the object store"):
        store.verify_file(owner, second)
    # So is a download streamed straight out of the bucket (a 500), not an outage to retry (a 503).
    mirror = open_blob_mirror(s3_blob_url)
    with pytest.raises(core().CorruptError, match="missing from the object store"):
        mirror.read_range(lost_name, 0, 1)

    store.delete_file(owner, file_id)
    assert _objects(s3_server, s3_blob_url) == set()
    store.close()


def test_an_unreachable_object_store_records_nothing(tmp_path: Path, s3_blob_url: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    store = open_store(tmp_path / "data", sync=False, blob_url=s3_blob_url)
    owner = core().Owner(store.create_user("alice").id, False)
    store.ping()
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1")  # nothing listens there
    down = open_store(tmp_path / "data", sync=False, blob_url=s3_blob_url)
    with pytest.raises(core().UnavailableError, match="object store"):
        _put(down, owner, b"never stored")
    with pytest.raises(core().UnavailableError):
        down.ping()
    assert down.list_files(owner).data == []
    assert not [p for p in (tmp_path / "data" / "blobs").iterdir() if p.is_file()]
    assert not list((tmp_path / "data" / "blobs" / "tmp").iterdir())
    down.close()
    store.close()


@pytest.fixture
def replicas(tmp_path: Path, postgres_url: str, s3_server: S3Server, s3_blob_url: str,
             tiny_model_dir: Path) -> Iterator[tuple[LiveServer, LiveServer]]:
    """Two servers as on two machines: their own data directories, one database, one bucket."""
    env = {DATABASE_URL_ENV: postgres_url, BLOB_URL_ENV: s3_blob_url, "CARTRIDGES_WORKER_THREADS": "1",
           **s3_server.env}
    yield from running_replicas(LiveServer(tmp_path / "first", model=tiny_model_dir, env=env),
                                LiveServer(tmp_path / "second", model=tiny_model_dir, env=env))


def test_a_shared_directory_holds_the_blobs_as_a_bucket_does(tmp_path: Path) -> None:
    """file:///path: blobs are files of that directory; a cache emptied (another machine) fetches
    them back; deleting removes them; a directory that cannot be made is an UnavailableError at
    ping."""
    shared = tmp_path / "shared"
    store = open_store(tmp_path / "data", sync=False, blob_url=shared.as_uri())
    owner = core().Owner(store.create_user("alice").id, False)
    file_id = _put(store, owner, b"y" * 70_000)
    local = {p.name for p in (tmp_path / "data" / "blobs").iterdir() if p.is_file()}
    assert {p.name for p in shared.iterdir()} == local and len(local) == 1
    for name in local:
        (tmp_path / "data" / "blobs" / name).unlink()
    assert Path(store.file_content_path(owner, file_id)).read_bytes() == b"y" * 70_000
    store.delete_file(owner, file_id)
    assert list(shared.iterdir()) == []
    store.close()
    with pytest.raises(ValueError, match="file:///"):
        open_store(tmp_path / "data", blob_url="file://host/relative")
    (tmp_path / "a file").write_text("in the way")
    gone = open_store(tmp_path / "other", sync=False, blob_url=(tmp_path / "a file" / "blobs").as_uri())
    with pytest.raises(core().UnavailableError, match="object store"):
        gone.ping()
    gone.close()


def test_downloads_stream_out_of_the_blob_store_through_any_replica(
        tmp_path: Path, postgres_url: str, shared_blob_url: str, tiny_model_dir: Path) -> None:
    """A replica without the blob streams it out of the blob store, whole or by Range, and
    keeps no copy; a bad Range is refused in OpenAI's shape, as for a local file."""
    import base64

    env = {DATABASE_URL_ENV: postgres_url, BLOB_URL_ENV: shared_blob_url,
           **{k: v for k, v in os.environ.items() if k.startswith("AWS_")}}
    content = base64.b64encode(os.urandom(3 << 20))  # text: uploads are documents
    for first, second in running_replicas(LiveServer(tmp_path / "first", model=tiny_model_dir, env=env),
                                          LiveServer(tmp_path / "second", model=tiny_model_dir, env=env)):
        key = first.add_user("alice")
        file_id = first.openai(key).files.create(file=("data.txt", content), purpose="assistants").id
        http = second.http(key)
        whole = http.get(f"/v1/files/{file_id}/content")
        assert whole.status_code == 200 and whole.content == content
        assert whole.headers["content-length"] == str(len(content))
        assert whole.headers["content-disposition"].startswith('attachment; filename="data.txt"')
        part = http.get(f"/v1/files/{file_id}/content", headers={"Range": "bytes=1000-1999"})
        assert part.status_code == 206 and part.content == content[1000:2000]
        assert part.headers["content-range"] == f"bytes 1000-1999/{len(content)}"
        tail = http.get(f"/v1/files/{file_id}/content", headers={"Range": "bytes=-10"})
        assert tail.status_code == 206 and tail.content == content[-10:]
        bad = http.get(f"/v1/files/{file_id}/content", headers={"Range": "lines=1-2"})
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_range"
        outside = http.get(f"/v1/files/{file_id}/content", headers={"Range": f"bytes={len(content)}-"})
        assert outside.status_code == 416 and outside.json()["error"]["code"] == "range_not_satisfiable"
        assert second.blob_names() == set()  # streamed, never written to the second machine's disk
        # Another user sees nothing of it through either replica.
        stranger = second.http(second.add_user("mallory")).get(f"/v1/files/{file_id}/content")
        assert stranger.status_code == 404
        assert first.http(key).get(f"/v1/files/{file_id}/content").content == content  # its own copy


@pytest.mark.slow
def test_a_datablock_trained_through_one_replica_is_served_by_another(
        replicas: tuple[LiveServer, LiveServer]) -> None:
    first, second = replicas
    key = first.add_user("alice")
    file_id = upload_text(first.openai(key), DOCUMENT)
    assert second.openai(key).files.content(file_id).read() == DOCUMENT.encode()
    assert second.blob_names() == set()  # a download streams out of the bucket

    with Client(first.url, key) as client:
        block = client.datablocks.train([file_id], name="handbook", config=TINY_TRAIN_CONFIG)
    served_by(second, key, block["id"])
    # The cartridge came from the object store into the second machine's cache; the first
    # replica never loaded it, yet serves it too, and either one downloads it.
    assert second.blob_names()
    cartridge = second.http(key).get(f"/v1/datablocks/{block['id']}/content")
    assert cartridge.status_code == 200 and cartridge.content[:8] == first.http(key).get(
        f"/v1/datablocks/{block['id']}/content").content[:8]
    loaded = first.http(key).post("/preload", json=[block["id"]])
    assert loaded.status_code == 200, loaded.text

    # Killing a replica loses nothing: the other serves every record and blob.
    late = upload_text(first.openai(key), "written just before the crash", name="late.txt")
    first.stop(kill=True)
    survivor = second.openai(key)
    assert {f.id for f in survivor.files.list()} == {file_id, late}
    assert survivor.files.content(late).read() == b"written just before the crash"
    with Client(second.url, key) as client:
        assert [b["id"] for b in client.datablocks.list()] == [block["id"]]


@pytest.mark.slow
def test_an_object_store_outage_is_a_503_and_unhealthy_until_it_is_back(tmp_path: Path, tiny_model_dir: Path) -> None:
    s3 = S3Server().start()  # its own endpoint: this test stops it
    try:
        bucket = s3.fresh_bucket()
        replica = LiveServer(tmp_path / "data", model=tiny_model_dir,
                             env={BLOB_URL_ENV: f"s3://{bucket}/blobs", **s3.env}).start()
        try:
            key = replica.add_user("alice")
            files = replica.openai(key).files
            kept = files.create(file=("kept.txt", b"kept"), purpose="assistants")
            cached = replica.blob_names()
            with Client(replica.url, key) as client:
                document = upload_text(replica.openai(key), DOCUMENT)
                block = client.datablocks.train([document], name="handbook", config=TINY_TRAIN_CONFIG)
                assert client.datablocks.wait(block["id"], timeout=180, poll_interval=0.2,
                                              progress=False)["status"] == "succeeded"
            for name in replica.blob_names() - cached:  # the cartridge only in the object store
                (replica.data_dir / "blobs" / name).unlink()

            s3.stop()
            chat = replica.http(key).post("/v1/chat/completions", json={
                "model": block["id"], "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
            assert chat.status_code == 503 and chat.json()["error"]["code"] == "unavailable", chat.text
            refused = replica.http(key).post("/v1/files", files={"file": ("new.txt", b"new")},
                                             data={"purpose": "assistants"})
            assert refused.status_code == 503, refused.text
            assert refused.json()["error"]["code"] == "unavailable"
            health = replica.http(None).get("/health")
            assert health.status_code == 503 and "object store" in health.json()["reason"]
            # Nothing half-made: the refused upload left no record and no local file.
            assert {f.id for f in files.list()} == {kept.id, document}
            assert replica.tmp_names() == []
            assert files.content(kept.id).read() == b"kept"  # in this replica's cache
            assert replica.alive()

            s3.start()  # back (moto starts empty: the bucket is made again)
            s3.client().create_bucket(Bucket=bucket)
            assert replica.http(None).get("/health").status_code == 200
            assert files.create(file=("new.txt", b"new"), purpose="assistants").filename == "new.txt"
        finally:
            replica.stop()
    finally:
        s3.stop()


def test_the_local_cache_stays_within_its_budget_oldest_copies_first(tmp_path: Path, shared_blob_url: str) -> None:
    from cartridges.blobs import evict_cache, open_blob_mirror
    from cartridges.jobs import Supervisor

    mirror = open_blob_mirror(shared_blob_url)
    store = open_store(tmp_path / "data", sync=False, blob_mirror=mirror)
    owner = core().Owner(store.create_user("alice").id, False)
    contents = [bytes([65 + i]) * 100_000 for i in range(3)]
    ids = [_put(store, owner, content) for content in contents]
    blobs = tmp_path / "data" / "blobs"
    for path in (p for p in blobs.iterdir() if p.is_file()):  # written an hour apart, in order
        os.utime(path, (0, 1_000_000 + 3600 * contents.index(path.read_bytes())))
    assert evict_cache(blobs, 250_000) == 100_000
    assert sorted(p.read_bytes()[:1] for p in blobs.iterdir() if p.is_file()) == [b"B", b"C"]  # A, the oldest, went
    assert (blobs / "tmp").is_dir()
    for file_id, content in zip(ids, contents):  # the evicted copy is fetched again on use
        assert Path(store.file_content_path(owner, file_id)).read_bytes() == content

    # The server's supervisor does it every minute, and only where a blob store holds the blobs.
    Supervisor(store, store.data_dir, blob_mirror=mirror, blob_cache_bytes=0)._evict_blob_cache()
    assert [p for p in blobs.iterdir() if p.is_file()] == []
    plain = open_store(tmp_path / "plain", sync=False)
    _put(plain, core().Owner(plain.create_user("bob").id, False), b"the only copy")
    Supervisor(plain, plain.data_dir, blob_cache_bytes=0)._evict_blob_cache()
    assert len([p for p in (tmp_path / "plain" / "blobs").iterdir() if p.is_file()]) == 1
    plain.close()
    store.close()


def test_objects_that_no_record_names_are_swept_once_old(tmp_path: Path, shared_blob_url: str) -> None:
    """An upload whose server died before recording it leaves an object no record names: the
    sweep removes it once it is older than any upload in flight, and nothing else."""
    from cartridges.blobs import open_blob_mirror, sweep_orphans

    mirror = open_blob_mirror(shared_blob_url)
    store = open_store(tmp_path / "data", sync=False, blob_mirror=mirror)
    owner = core().Owner(store.create_user("alice").id, False)
    file_id = _put(store, owner, b"recorded")
    recorded = mirror.names("")
    (tmp_path / "orphan").write_bytes(b"uploaded, never recorded")
    mirror.upload("0123456789abcdef0123456789abcdef", str(tmp_path / "orphan"))
    mirror.upload("jobs/run1/train.ckpt", str(tmp_path / "orphan"))  # a job's checkpoint, not a blob
    assert sweep_orphans(mirror, store) == 0  # too young: it may be an upload being recorded
    assert sweep_orphans(mirror, store, min_age_s=0) == 1
    assert sorted(mirror.names("")) == sorted([*recorded, "jobs/run1/train.ckpt"])
    assert sorted(store.recorded_blobs()) == sorted(recorded)
    assert Path(store.file_content_path(owner, file_id)).read_bytes() == b"recorded"
    store.close()


def test_a_shared_directory_sweeps_the_temporary_files_of_uploads_cut_short(tmp_path: Path) -> None:
    """A server killed while copying a blob into a file:/// store leaves its temporary file: the
    sweep removes it once old, never one still being written, and no blob."""
    import os

    from cartridges.blobs import open_blob_mirror, sweep_orphans

    mirror = open_blob_mirror((tmp_path / "shared").as_uri())
    store = open_store(tmp_path / "data", sync=False, blob_mirror=mirror)
    owner = core().Owner(store.create_user("alice").id, False)
    _put(store, owner, b"recorded")
    recorded = mirror.names("")
    shared = tmp_path / "shared"
    (shared / "jobs" / "run1").mkdir(parents=True)
    stale = [shared / ".upload-abc123", shared / "jobs" / "run1" / ".upload-def456"]
    fresh = shared / ".upload-ghi789"
    for path in (*stale, fresh):
        path.write_bytes(b"half a blob")
    for path in stale:
        os.utime(path, (path.stat().st_atime - 7200, path.stat().st_mtime - 7200))
    assert mirror.names("") == recorded  # never listed as blobs
    assert sweep_orphans(mirror, store) == 2
    assert not any(p.exists() for p in stale) and fresh.exists() and mirror.names("") == recorded
    store.close()
