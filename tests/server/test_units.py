"""In-process pieces: settings, filenames, extraction, the keys command."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cartridges.cli import main
from cartridges.server.extraction import ExtractionError, extract_text
from cartridges.jobs.worker import int8_activations_from_env
from cartridges.server.settings import MAX_UPLOAD_BYTES, Settings
from cartridges.server.uploads import safe_filename
from tests.server.conftest import make_pdf


def test_settings_precedence() -> None:
    assert Settings.from_env({}) == Settings()
    assert (Settings().host, Settings().port, Settings().data_dir) == ("127.0.0.1", 8000, Path("cartridges-data"))
    assert Settings().max_upload_bytes == MAX_UPLOAD_BYTES == 512 << 20
    env = {"CARTRIDGES_PORT": "9001", "CARTRIDGES_DATA_DIR": "/d", "CARTRIDGES_MAX_UPLOAD_BYTES": "10",
           "CARTRIDGES_ADMIN_KEY": "adm", "CARTRIDGES_MODEL": "m.gguf"}
    s = Settings.from_env(env, port=None, data_dir="/cli")
    assert (s.port, s.data_dir, s.max_upload_bytes, s.admin_key, s.model) == (9001, Path("/cli"), 10, "adm", "m.gguf")
    with pytest.raises(ValueError, match="CARTRIDGES_PORT"):
        Settings.from_env({"CARTRIDGES_PORT": "eighty"})
    assert Settings().int8_activations
    assert not Settings.from_env({"CARTRIDGES_INT8_ACTIVATIONS": "0"}).int8_activations
    assert Settings.from_env({"CARTRIDGES_INT8_ACTIVATIONS": "0"}, int8_activations=True).int8_activations
    with pytest.raises(ValueError, match="CARTRIDGES_INT8_ACTIVATIONS"):
        Settings.from_env({"CARTRIDGES_INT8_ACTIVATIONS": "maybe"})
    # ... and training workers get it from the supervisor in the same variable.
    assert int8_activations_from_env({}) and int8_activations_from_env({"CARTRIDGES_INT8_ACTIVATIONS": "1"})
    assert not int8_activations_from_env({"CARTRIDGES_INT8_ACTIVATIONS": "0"})


def test_training_workers_load_the_model_where_the_settings_say(tmp_path: Path) -> None:
    """training_device "auto" follows the server's device; the local backend's workers get the
    decided device in their environment, Ray tasks none (they train on the GPUs Ray gives them)."""
    from cartridges.jobs import Supervisor
    from cartridges.jobs.worker import WORKER_DEVICE_ENV

    gpu = "cuda" if torch.cuda.is_available() else "cpu"
    assert Settings().training_device == "auto" and Settings().worker_device() == gpu
    assert Settings(device="cpu").worker_device() == "cpu"
    assert Settings(device="cpu", training_device="cuda").worker_device() == "cuda"
    assert Settings(device="cuda", training_device="cpu").worker_device() == "cpu"
    assert Settings.from_env({"CARTRIDGES_TRAINING_DEVICE": "cpu"}).training_device == "cpu"
    with pytest.raises(ValueError, match="CARTRIDGES_TRAINING_DEVICE"):
        Settings.from_env({"CARTRIDGES_TRAINING_DEVICE": "tpu"})
    local = Supervisor(None, tmp_path, worker_device="cuda", worker_threads=3)
    assert local.worker_settings()[WORKER_DEVICE_ENV] == "cuda"
    assert local.worker_settings()["CARTRIDGES_WORKER_THREADS"] == "3"
    assert Supervisor(None, tmp_path).worker_settings()[WORKER_DEVICE_ENV] == "cpu"
    ray = Supervisor(None, tmp_path, backend="ray", worker_device="cuda")
    assert WORKER_DEVICE_ENV not in ray.worker_settings()


def test_store_urls_are_checked_with_the_settings_and_never_show_a_password() -> None:
    """A URL that cannot be read is refused before the server starts, naming its variable."""
    with pytest.raises(ValueError, match="CARTRIDGES_DATABASE_URL: not a PostgreSQL URL") as refused:
        Settings.from_env({"CARTRIDGES_DATABASE_URL": "postgresql://alice:s3cret@db:port/cartridges"})
    assert "s3cret" not in str(refused.value) and "alice:***@db" in str(refused.value)
    with pytest.raises(ValueError, match="database_url") as refused:
        Settings.from_env({}, database_url="postgres://alice:s3cret@[db/cartridges")
    assert "s3cret" not in str(refused.value)
    with pytest.raises(ValueError, match="CARTRIDGES_BLOB_URL"):
        Settings.from_env({"CARTRIDGES_BLOB_URL": "file://elsewhere/blobs"})
    good = Settings.from_env({"CARTRIDGES_DATABASE_URL": "postgresql://alice:s3cret@db:5432/cartridges",
                              "CARTRIDGES_BLOB_URL": "file:///srv/blobs", "CARTRIDGES_WORKER_GPUS": "0.5"})
    assert (good.blob_url, good.worker_gpus) == ("file:///srv/blobs", 0.5)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [("a/b/c.txt", "c.txt"), ("C:\\x\\y.md", "y.md"), ("..", ""), ("a\u200b\x7f.csv", "a.csv"),
     ("\u00e9" * 200 + ".json", "\u00e9" * 125 + ".json")],
)
def test_safe_filename(raw: str, expected: str) -> None:
    assert safe_filename(raw) == expected
    assert len(safe_filename(raw).encode()) <= 255


def test_extraction(tmp_path: Path) -> None:
    def extract(name: str, content: bytes) -> str | None:
        path = tmp_path / name
        path.write_bytes(content)
        return extract_text(str(path), name)

    assert extract("a.txt", "caf\u00e9".encode()) is None  # the content is the text
    assert extract("a.json", b'{"k": ["v", 1]}') == '{\n  "k": [\n    "v",\n    1\n  ]\n}'
    assert extract("a.jsonl", b'{"a":1}\n\n{"b":2}\n') == '{"a": 1}\n{"b": 2}'
    assert extract("a.csv", b"name,n\nx,1\ny,2\n") == "name: x | n: 1\nname: y | n: 2"
    assert "Hello PDF" in (extract("a.pdf", make_pdf("Hello PDF")) or "")
    # The offset of a bad byte is reported even when it falls across read chunks.
    big = b"a" * ((1 << 20) - 1) + "\u00e9".encode()[:1] + b"b"
    with pytest.raises(ExtractionError, match=f"offset {(1 << 20) - 1}"):
        extract("big.txt", big)
    with pytest.raises(ExtractionError, match="offset 3"):
        extract("end.md", b"abc" + "\u00e9".encode()[:1])


def test_keys_command(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    data = str(tmp_path / "data")
    assert main(["keys", "--data-dir", data, "create", "--user", "carol"]) == 0
    key = capsys.readouterr().out.strip()
    assert key.startswith("sk-cart-") and len(key) >= 8 + 32
    assert main(["keys", "create", "--user", "carol", "--data-dir", data]) == 0
    second = capsys.readouterr().out.strip()
    assert second != key
    assert main(["keys", "list", "--data-dir", data]) == 0
    listing = capsys.readouterr().out
    assert "carol" in listing and key not in listing and key[:12] in listing
    assert main(["keys", "revoke", "1", "--data-dir", data]) == 0
    assert main(["keys", "revoke", "1", "--data-dir", data]) == 1
    assert main(["keys", "create", "--user", "admin", "--data-dir", data]) == 2
    assert main(["keys", "create", "--user", "bad name", "--data-dir", data]) == 2
    # A mistyped directory is an error, not an empty store made there; a bad setting is named.
    typo = tmp_path / "dta"
    assert main(["keys", "list", "--data-dir", str(typo)]) == 1 and not typo.exists()
    assert "no store at" in capsys.readouterr().err
    (tmp_path / "a-file").write_text("x")
    assert main(["keys", "create", "--user", "dan", "--data-dir", str(tmp_path / "a-file")]) == 1
    assert capsys.readouterr().err.startswith("error: ")
    monkeypatch.setenv("CARTRIDGES_PORT", "abc")
    assert main(["keys", "list", "--data-dir", data]) == 2
    assert "CARTRIDGES_PORT" in capsys.readouterr().err
    monkeypatch.delenv("CARTRIDGES_PORT")

    from cartridges.server.keys import hash_key
    from cartridges.store import open_store

    store = open_store(data)
    try:
        assert store.user_for_key(hash_key(key)) is None  # revoked
        assert store.user_for_key(hash_key(second)).name == "carol"
        stored = (Path(data) / "store.db").read_bytes() + b"".join(p.read_bytes() for p in Path(data).glob("store.db-wal"))
        assert key.encode() not in stored and second.encode() not in stored  # only hashes are kept
    finally:
        store.close()


def test_serve_help_lists_options(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = capsys.readouterr().out
    for option in ("--host", "--port", "--data-dir", "--model"):
        assert option in out


def test_train_help_describes_every_config_field(capsys: pytest.CaptureFixture[str]) -> None:
    """Every TrainConfig field is a flag of `cartridges train`, and its help says what it does
    (the first sentence of the field's docstring), not only its default."""
    from cartridges.selfstudy.config import TrainConfig, field_summaries

    summaries = field_summaries()
    assert set(summaries) == set(TrainConfig.model_fields)
    assert summaries["epochs"] == "Passes over the conversations."
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for name in TrainConfig.model_fields:
        assert "--" + name.replace("_", "-") in out
    assert "--epochs N Passes over the conversations. (default: 2, or 1 for a corpus over 8192 tokens)" in out
    assert "--warmup WARMUP Share of the run's optimizer steps" in out


def test_train_command_refuses_a_bad_config_without_a_traceback(tmp_path: Path, capsys) -> None:
    from cartridges.cli import main

    (tmp_path / "doc.txt").write_text("Some text.")
    assert main(["train", str(tmp_path / "doc.txt"), "--out", str(tmp_path / "c.safetensors"), "--lr", "-1"]) == 2
    err = capsys.readouterr().err
    assert "error: learning_rate: Input should be greater than 0" in err and "Traceback" not in err


@pytest.mark.parametrize("status,code", [("succeeded", 0), ("failed", 1)])
def test_datablocks_train_wait_exits_with_the_job_outcome(monkeypatch, capsys, status: str, code: int) -> None:
    import cartridges.client
    from cartridges.cli import main

    class Blocks:
        def train(self, files, **kw):
            return {"id": "alice/default/abc", "status": "queued"}

        def wait(self, block_id):
            return {"id": block_id, "status": status}

    class FakeClient:
        def __init__(self, url, key):
            self.datablocks = Blocks()

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(cartridges.client, "Client", FakeClient)
    assert main(["datablocks", "--api-key", "k", "train", "file-x", "--wait"]) == code
    assert f'"status": "{status}"' in capsys.readouterr().out


def test_bootstrap_creates_default_user_once(tmp_path: Path) -> None:
    import io

    from cartridges.server import keys
    from cartridges.store import open_store

    store = open_store(tmp_path / "data")
    try:
        out = io.StringIO()
        keys.bootstrap(store, None, out)
        printed = out.getvalue().rsplit(" ", 1)[-1].strip()
        assert printed.startswith("sk-cart-")
        assert store.user_for_key(keys.hash_key(printed)).name == "default"
        again = io.StringIO()
        keys.bootstrap(store, "sk-cart-other", again)
        assert again.getvalue() == "" and len(store.list_keys()) == 1
    finally:
        store.close()


def test_datablocks_wait_rides_out_a_server_restart_and_the_cli_names_an_unreachable_server(capsys) -> None:
    """wait() asks again while the server cannot be reached or answers 503 (a restart), and
    gives up on any other error; the CLI says which server it could not reach, no traceback."""
    import httpx

    from cartridges.cli import main
    from cartridges.client import APIError, Client

    answers = iter([httpx.ConnectError("refused"), httpx.Response(503, json={"error": {"message": "db away"}}),
                    httpx.Response(200, json={"id": "a/b/c", "status": "succeeded"}),
                    httpx.Response(404, json={"error": {"message": "No datablock", "code": "not_found"}}),
                    httpx.Response(200, text="<html>not us</html>")])

    def handler(request: httpx.Request) -> httpx.Response:
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    with Client("http://server.invalid", "key") as client:
        client._http = httpx.Client(base_url="http://server.invalid/v1", transport=httpx.MockTransport(handler))
        assert client.datablocks.wait("a/b/c", poll_interval=0.01, progress=False)["status"] == "succeeded"
        with pytest.raises(APIError, match="No datablock"):
            client.datablocks.wait("a/b/c", poll_interval=0.01, progress=False)
        with pytest.raises(APIError, match="is it a cartridges server"):
            client.datablocks.retrieve("a/b/c")

    assert main(["datablocks", "--base-url", "http://127.0.0.1:9", "--api-key", "k", "list"]) == 1
    assert "cannot reach the server at http://127.0.0.1:9" in capsys.readouterr().err


def test_a_new_part_counts_its_time_left_from_its_own_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two parts whose first stage is the same: the second's `eta_seconds` is at its own rate,
    not at one diluted by the first part's time."""
    import cartridges_core as core

    from cartridges.jobs import progress as progress_module
    from cartridges.jobs.progress import JobProgress

    clock = [100.0]
    monkeypatch.setattr(progress_module.time, "monotonic", lambda: clock[0])

    class Store:
        def update_datablock_progress(self, *args: object) -> None:
            pass

    progress = JobProgress(Store(), None, "run", core.CancelToken(), core)
    progress.set_part(1, 2)
    progress.update("training", 0, 10)
    clock[0] += 100.0  # part 1 trains its 10 steps in 100 s
    progress.update("training", 10, 10)
    progress.set_part(2, 2)
    progress.update("training", 0, 10)
    clock[0] += 1.0  # part 2's first 5 steps in 1 s: 1 s more at its rate
    progress.update("training", 5, 10)
    assert progress.progress() == {"stage": "training", "completed": 5, "total": 10, "eta_seconds": 1,
                                   "part": 2, "parts": 2}
