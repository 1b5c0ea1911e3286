"""The datablocks API (docs/api.md §2) on a live server training a tiny model: the official openai
client for files, `cartridges.Client` for datablocks; every bad input; two-user isolation."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from cartridges import Cartridge, Client
from cartridges.client import APIError
from cartridges.store import core, open_store

from .conftest import ADMIN_KEY, LiveServer, upload_text
from .tiny_hf_model import DOCUMENT, TINY_TRAIN_CONFIG

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def jobs_server(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir) -> Iterator[LiveServer]:
    live = LiveServer(tmp_path_factory.mktemp("datablocks") / "data", model=tiny_model_dir,
                      env={"CARTRIDGES_WORKER_THREADS": "1"}).start()
    try:
        yield live
    finally:
        live.stop()


@pytest.fixture
def alice(jobs_server: LiveServer) -> Iterator[tuple[Client, str, str]]:
    """A fresh user: a datablocks client, one processed training file, the key."""
    key = jobs_server.add_user()
    client = Client(jobs_server.url, key)
    yield client, upload_text(jobs_server.openai(key), DOCUMENT), key
    client.close()


def stored_cartridge(server: LiveServer, datablock_id: str) -> Cartridge:
    store = open_store(server.data_dir)
    try:
        admin = core().Owner(0, True)
        store.verify_datablock(admin, datablock_id)
        return Cartridge.load(store.datablock_cartridge_path(admin, datablock_id))
    finally:
        store.close()


def test_train_watch_list_delete(jobs_server: LiveServer, alice) -> None:
    client, file_id, key = alice
    block = client.datablocks.train([file_id], name="handbook", config={**TINY_TRAIN_CONFIG, "learning_rate": 0.05})
    run_id = block["run_id"]
    assert block["object"] == "datablock" and block["status"] == "queued"
    assert block["id"] == f"{block['owner']}/handbook/{run_id}" and block["project"] == "handbook"
    assert len(run_id) >= 8 and run_id.isalnum() and run_id == run_id.lower()
    assert block["training_files"] == [file_id]
    assert block["config"]["learning_rate"] == 0.05 and block["config"]["num_samples"] == 8
    assert block["config"]["objective"] == "distill"  # defaults filled in
    # Whether it trains in parts (each of 8 tokens) waits for the corpus: its length too.
    assert block["num_tokens"] is None and block["parts"] is None
    assert block["bytes"] is None and block["error"] is None
    assert block["progress"]["stage"] == "queued" and block["started_at"] is None

    done = client.datablocks.wait(block["id"], timeout=120, poll_interval=0.2, progress=False)
    assert done["status"] == "succeeded", done
    assert done["progress"]["stage"] == "done" and done["num_tokens"] == 8 and done["parts"] is False
    assert done["bytes"] > 0 and done["started_at"] and done["finished_at"] >= done["started_at"]
    assert done["updated_at"] >= done["finished_at"]  # the last write is the one that finished it
    assert done["metrics"]["synthetic_samples"] == 8
    assert done["metrics"]["train_tokens"] > 0 and isinstance(done["metrics"]["loss"], float)
    assert done["model"] == jobs_server.model.name  # type: ignore[union-attr]

    # Both id forms, both prefixes.
    assert client.datablocks.retrieve(run_id)["id"] == block["id"]
    with Client(jobs_server.url + "/api/v1", key) as api_v1:
        assert api_v1.datablocks.retrieve(block["id"])["status"] == "succeeded"
    assert [b["id"] for b in client.datablocks.list()] == [block["id"]]
    assert [b["id"] for b in client.datablocks.list(status="succeeded")] == [block["id"]]
    assert list(client.datablocks.list(status="failed")) == []

    # The cartridge is whole, for the server's model, and outlives its training file.
    cartridge = stored_cartridge(jobs_server, block["id"])
    assert cartridge.num_tokens == 8 and cartridge.config["learning_rate"] == 0.05
    jobs_server.openai(key).files.delete(file_id)
    assert client.datablocks.retrieve(block["id"])["status"] == "succeeded"
    assert stored_cartridge(jobs_server, block["id"]).checksum() == cartridge.checksum()

    blobs_before = jobs_server.blob_names()
    assert client.datablocks.delete(run_id) == {"id": block["id"], "object": "datablock", "deleted": True}
    assert len(jobs_server.blob_names()) == len(blobs_before) - 1
    with pytest.raises(APIError) as missing:
        client.datablocks.retrieve(block["id"])
    assert (missing.value.status, missing.value.code) == (404, "not_found")


def _bad(jobs_server: LiveServer, key: str, method: str, path: str, **kwargs) -> tuple[int, str | None]:
    response = jobs_server.http(key).request(method, path, **kwargs)
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return response.status_code, error["code"]


def test_the_cartridge_length_left_to_the_corpus_is_shown_once_decided(jobs_server: LiveServer, alice) -> None:
    client, file_id, _ = alice
    config = {k: v for k, v in TINY_TRAIN_CONFIG.items() if k != "num_tokens"}
    block = client.datablocks.train([file_id], config=config)
    assert block["num_tokens"] is None and block["config"]["num_tokens"] is None  # not known while queued
    done = client.datablocks.wait(block["id"], timeout=120, poll_interval=0.2, progress=False)
    assert done["status"] == "succeeded", done
    cartridge = stored_cartridge(jobs_server, block["id"])
    # The tiny document is short: an eighth of it is under the floor of 64 tokens.
    assert done["num_tokens"] == cartridge.num_tokens == done["config"]["num_tokens"] == 64
    assert cartridge.config["num_tokens"] == 64


def test_every_bad_input_is_answered(jobs_server: LiveServer) -> None:
    key = jobs_server.add_user()
    other = jobs_server.add_user()
    client = jobs_server.openai(key)
    good = upload_text(client, DOCUMENT)
    other_file = upload_text(jobs_server.openai(other), DOCUMENT)
    assistants = upload_text(client, DOCUMENT, purpose="assistants")
    broken = upload_text(client, "{not json", name="broken.json")
    assert client.files.retrieve(broken).status == "error"
    train = "/v1/datablocks/train"
    cases = {
        "neither file field": ({}, 400, "invalid_value"),
        "both file fields": ({"training_files": [good], "training_file": good}, 400, "invalid_value"),
        "no files": ({"training_files": []}, 400, "invalid_value"),
        "101 files": ({"training_files": [good] * 101}, 400, "invalid_value"),
        "files not a list": ({"training_files": good}, 400, "invalid_value"),
        "unknown file": ({"training_file": "file-" + "x" * 24}, 404, "not_found"),
        "someone else's file": ({"training_file": other_file}, 404, "not_found"),
        "wrong purpose": ({"training_file": assistants}, 400, "invalid_purpose"),
        "file in error": ({"training_file": broken}, 400, "file_not_processed"),
        "unknown config field": ({"training_file": good, "config": {"num_epochs": 2}}, 400, "unknown_parameter"),
        "config of wrong type": ({"training_file": good, "config": {"epochs": "two"}}, 400, "invalid_value"),
        "config bool for int": ({"training_file": good, "config": {"epochs": True}}, 400, "invalid_value"),
        "config out of range": ({"training_file": good, "config": {"epochs": 0}}, 400, "invalid_value"),
        "config bad choice": ({"training_file": good, "config": {"init": "zeros"}}, 400, "invalid_value"),
        "config not an object": ({"training_file": good, "config": [1]}, 400, "invalid_value"),
        "config beyond 32 bits": ({"training_file": good, "config": {"num_tokens": 2**63}}, 400, "invalid_value"),
        "bad project name": ({"training_file": good, "name": "a b"}, 400, "invalid_value"),
        "long project name": ({"training_file": good, "name": "x" * 65}, 400, "invalid_value"),
        "other base model": ({"training_file": good, "model": "llama-70b"}, 400, "model_not_found"),
        "unknown field": ({"training_file": good, "epochs": 2}, 400, "unknown_parameter"),
    }
    for name, (body, status, code) in cases.items():
        assert _bad(jobs_server, key, "POST", train, json=body) == (status, code), name
    # A config's error names the field, as OpenAI names nested parameters.
    for config, param in (({"epochs": 0}, "config.epochs"), ({"lr": -1}, "config.lr"),
                          ({"num_tokens": 8, "num_frozen": 8}, "config")):
        response = jobs_server.http(key).post(train, json={"training_file": good, "config": config})
        assert (response.status_code, response.json()["error"]["param"]) == (400, param), response.text
    assert _bad(jobs_server, key, "POST", train, content=b"{oops", headers={"Content-Type": "application/json"}) == (
        400, "invalid_json")
    for infinite in (b"Infinity", b"-Infinity", b"NaN"):  # Python's JSON reads them; a config never holds them
        body = b'{"training_file": "' + good.encode() + b'", "config": {"learning_rate": ' + infinite + b"}}"
        assert _bad(jobs_server, key, "POST", train, content=body, headers={"Content-Type": "application/json"}) == (
            400, "invalid_value"), infinite
    assert _bad(jobs_server, key, "GET", "/v1/datablocks", params={"status": "done"})[0] == 400
    assert _bad(jobs_server, key, "GET", "/v1/datablocks", params={"limit": 0})[0] == 400
    assert _bad(jobs_server, key, "GET", "/v1/datablocks", params={"order": "up"})[0] == 400
    assert _bad(jobs_server, key, "GET", "/v1/datablocks", params={"after": "nosuchrun1"}) == (404, "not_found")
    for method in ("GET", "DELETE"):
        for missing in ("nosuchrun123", "someone/default/nosuchrun123", "a/b", "a/b/c/d"):
            assert _bad(jobs_server, key, method, f"/api/v1/datablocks/{missing}") == (404, "not_found")
    assert _bad(jobs_server, "", "GET", "/v1/datablocks") == (401, "invalid_api_key")
    assert _bad(jobs_server, "sk-wrong", "POST", train, json={"training_file": good}) == (401, "invalid_api_key")
    # None of these queued anything.
    with Client(jobs_server.url, key) as client:
        assert client.datablocks.page()["data"] == []


def test_two_users_are_isolated(jobs_server: LiveServer, alice) -> None:
    client, file_id, _ = alice
    first = client.datablocks.train(file_id, config=TINY_TRAIN_CONFIG)
    second = client.datablocks.train(file_id, name="second", config=TINY_TRAIN_CONFIG)
    bob_key = jobs_server.add_user()
    with Client(jobs_server.url, bob_key) as bob:
        for block_id in (first["id"], first["run_id"]):
            for call in (bob.datablocks.retrieve, bob.datablocks.delete):
                with pytest.raises(APIError) as refused:
                    call(block_id)
                assert (refused.value.status, refused.value.code) == (404, "not_found")
        assert list(bob.datablocks.list()) == []
        with pytest.raises(APIError) as refused:
            bob.datablocks.page(after=first["id"])
        assert refused.value.status == 404
        with pytest.raises(APIError) as refused:
            bob.datablocks.train(file_id, config=TINY_TRAIN_CONFIG)
        assert refused.value.status == 404
    # Alice's are untouched; her list walks page by page, oldest first when asked.
    assert client.datablocks.wait(first["id"], timeout=120, poll_interval=0.2, progress=False)["status"] == "succeeded"
    assert client.datablocks.wait(second["id"], timeout=120, poll_interval=0.2, progress=False)["status"] == "succeeded"
    page = client.datablocks.page(limit=1, order="asc")
    assert [b["id"] for b in page["data"]] == [first["id"]] and page["has_more"]
    page = client.datablocks.page(limit=1, order="asc", after=page["last_id"])
    assert [b["id"] for b in page["data"]] == [second["id"]] and not page["has_more"]
    # The admin key sees them.
    with Client(jobs_server.url, ADMIN_KEY) as admin:
        assert admin.datablocks.retrieve(first["id"])["owner"] == first["owner"]


def test_command_line(jobs_server: LiveServer, alice, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from cartridges.cli import main

    _, file_id, key = alice
    base = ["datablocks", "--base-url", jobs_server.url, "--api-key", key]
    assert main([*base, "train", file_id, "--name", "cli", "--config", json.dumps(TINY_TRAIN_CONFIG)]) == 0
    block = json.loads(capsys.readouterr().out)
    assert block["status"] == "queued" and block["project"] == "cli"
    assert main([*base, "wait", block["run_id"]]) == 0
    assert json.loads(capsys.readouterr().out)["status"] == "succeeded"
    assert main([*base, "list", "--status", "succeeded"]) == 0
    assert block["id"] in capsys.readouterr().out
    assert main([*base, "get", block["id"]]) == 0
    assert json.loads(capsys.readouterr().out)["bytes"] > 0
    assert main([*base, "delete", block["id"]]) == 0
    assert json.loads(capsys.readouterr().out)["deleted"] is True
    assert main([*base, "get", block["id"]]) == 1
    assert "not_found" in capsys.readouterr().err
    assert main([*base, "train", file_id, "--config", '{"bogus": 1}']) == 1
    assert "unknown_parameter" in capsys.readouterr().err
