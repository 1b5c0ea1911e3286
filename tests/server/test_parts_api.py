"""A datablock trained in parts (docs/api.md §2 `parts`) on a live server with a tiny model: one
datablock whose cartridge holds a cartridge per part of the corpus, each part's figures in its
metrics, chat answered by the mixture of its parts (exactly the library's) or by the part a
question is about (`composition: "search"`), concatenation and single-cartridge export formats
refused, listed and unloaded as one cartridge."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from types import SimpleNamespace

import httpx
import openai
import pytest

import cartridges
from cartridges import Client
from cartridges.cartridge import load_cartridges
from cartridges.parts import corpus_parts, part_search_for
from cartridges.server.passages import Passages
from cartridges.server.principal import Principal
from cartridges.store import core, open_store

from .conftest import LiveServer, upload_text
from .tiny_hf_model import DOCUMENT, TINY_TRAIN_CONFIG

pytestmark = pytest.mark.slow

PART_TOKENS = 400
MESSAGES = [{"role": "user", "content": "Who rings the bell?"}]
SECTIONS = ["Bells", "Harbor", "Ships", "Weddings"]
KEEPERS = ["Arven", "Belmo", "Corisande", "Dunstable"]  # a word of each section's alone, for `search`
CORPUS = "# Quelmor\n\nThe village and its bells.\n\n" + "\n\n".join(
    f"## {n}. {title}\n\n{DOCUMENT.strip()} Its keeper is {keeper}."
    for n, (title, keeper) in enumerate(zip(SECTIONS, KEEPERS), 1))


@pytest.fixture(scope="module")
def model(tiny_model_dir) -> cartridges.Model:
    return cartridges.load_model(tiny_model_dir)


@pytest.fixture(scope="module")
def trained(chat_server: LiveServer) -> dict:
    """A user and a datablock trained in parts on CORPUS."""
    key = chat_server.add_user()
    with Client(chat_server.url, key) as client:
        block = client.datablocks.train([upload_text(chat_server.openai(key), CORPUS, name="quelmor.md")],
                                        name="parts", config=TINY_TRAIN_CONFIG, parts=True, part_tokens=PART_TOKENS)
        assert block["parts"] is True and block["part_tokens"] == PART_TOKENS and block["num_tokens"] is None
        done = client.datablocks.wait(block["id"], timeout=180, poll_interval=0.2, progress=False)
    assert done["status"] == "succeeded", done
    return {"key": key, "block": done}


def stored_parts(server: LiveServer, datablock_id: str) -> list[cartridges.Cartridge]:
    store = open_store(server.data_dir)
    try:
        return load_cartridges(store.datablock_cartridge_path(core().Owner(0, True), datablock_id))
    finally:
        store.close()


def test_a_datablock_trained_in_parts_holds_a_cartridge_per_part(chat_server: LiveServer, model, trained) -> None:
    block = trained["block"]
    expected = corpus_parts(model.tokenizer, CORPUS, PART_TOKENS)
    assert len(expected) >= 2  # the corpus is several parts of the tiny model's tokens
    parts = stored_parts(chat_server, block["id"])
    assert len(parts) == len(expected) and all(p.num_tokens == TINY_TRAIN_CONFIG["num_tokens"] for p in parts)
    assert block["num_tokens"] == sum(p.num_tokens for p in parts)  # the KV held
    figures = block["metrics"]["parts"]
    assert [f["corpus_tokens"] for f in figures] == [len(model.tokenizer.encode(text)) for text in expected]
    assert all(f["num_tokens"] == TINY_TRAIN_CONFIG["num_tokens"] and f["num_samples"] == TINY_TRAIN_CONFIG["num_samples"]
               and f["quality"]["held_out_conversations"] > 0 and len(f["signal_by_part"]) == 10 for f in figures)
    assert [f["quality"] for f in figures] == [p.quality for p in parts]  # also in each part of the file
    assert block["metrics"]["quality"] is None and block["metrics"]["loss"] is None
    assert block["progress"]["stage"] == "done" and block["config"]["chunk_tokens"] == TINY_TRAIN_CONFIG["chunk_tokens"]


def test_chat_composes_the_parts_by_mixture_exactly_as_the_library(chat_server: LiveServer, model, trained) -> None:
    block = trained["block"]
    client = chat_server.openai(trained["key"])
    reply = client.chat.completions.create(model=block["id"], messages=MESSAGES, temperature=0, max_tokens=12,
                                           logprobs=True, extra_body={"composition": "mixture"})
    parts = stored_parts(chat_server, block["id"])
    assert reply.usage.prompt_tokens_details.cached_tokens == block["num_tokens"]
    assert "search" not in reply.model_extra  # only a search names parts
    expected = model.generate([model.encode_chat(MESSAGES)], prefixes=[p.prefix(model) for p in parts],
                              max_new_tokens=12, logprobs=1, weigh_from=[model.conversation_start(MESSAGES)])[0]
    assert reply.choices[0].message.content == expected.text
    assert [t.logprob for t in reply.choices[0].logprobs.content] == pytest.approx(
        [t.logprob for t in expected.logprobs], abs=1e-4)
    # `route`: the prompt read with every part, the reply decoded with the heaviest alone.
    routed = client.chat.completions.create(model=block["id"], messages=MESSAGES, temperature=0, max_tokens=12,
                                            extra_body={"composition": "route"})
    expected = model.generate([model.encode_chat(MESSAGES)], prefixes=[p.prefix(model) for p in parts],
                              max_new_tokens=12, composition="route",
                              weigh_from=[model.conversation_start(MESSAGES)])[0]
    assert routed.choices[0].message.content == expected.text
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=block["id"], messages=MESSAGES, max_tokens=2,
                                       extra_body={"composition": "concatenate"})
    assert refused.value.body["param"] == "composition" and "trained in parts" in refused.value.body["message"]
    # Listed, and unloaded, as one cartridge.
    assert [m.id for m in client.models.list().data] == [block["id"]]
    assert client.models.retrieve(block["id"]).model_extra["num_tokens"] == block["num_tokens"]


def test_search_answers_from_the_part_the_question_is_about(chat_server: LiveServer, model, trained) -> None:
    block = trained["block"]
    client = chat_server.openai(trained["key"])
    parts = stored_parts(chat_server, block["id"])
    texts = corpus_parts(model.tokenizer, CORPUS, PART_TOKENS)
    last = next(j for j, text in enumerate(texts) if "Dunstable" in text)
    assert last > 0  # not the part a tie would give
    asked = [{"role": "user", "content": "What does Dunstable keep?"}]
    reply = client.chat.completions.create(model=block["id"], messages=asked, temperature=0, max_tokens=12,
                                           logprobs=True, extra_body={"composition": "search"})
    expected = model.generate([model.encode_chat(asked)], prefixes=[parts[last].prefix(model)], max_new_tokens=12,
                              logprobs=1)[0]
    assert reply.usage.prompt_tokens_details.cached_tokens == parts[last].num_tokens  # that part's KV alone
    assert reply.model_extra["search"] == {"cartridges": [{"id": block["id"], "parts": [last + 1], "of": len(parts)}]}
    assert reply.choices[0].message.content == expected.text
    assert [t.logprob for t in reply.choices[0].logprobs.content] == pytest.approx(
        [t.logprob for t in expected.logprobs], abs=1e-4)
    # A question of stop words alone names no part: every part, by mixture.
    vague = client.chat.completions.create(model=block["id"], messages=[{"role": "user", "content": "Who is it?"}],
                                           max_tokens=2, extra_body={"composition": "search"})
    assert vague.usage.prompt_tokens_details.cached_tokens == block["num_tokens"]
    assert vague.model_extra["search"]["cartridges"][0]["parts"] == list(range(1, len(parts) + 1))  # all of them
    # Streamed, the first chunk says which part.
    stream = client.chat.completions.create(model=block["id"], messages=asked, max_tokens=2, stream=True,
                                            extra_body={"composition": "search"})
    assert [c.model_extra.get("search") for c in stream][0] == reply.model_extra["search"]
    # Search is the default: a request that does not say gets the same reply from the same part.
    default = client.chat.completions.create(model=block["id"], messages=asked, temperature=0, max_tokens=12)
    assert default.choices[0].message.content == reply.choices[0].message.content
    assert default.model_extra["search"] == reply.model_extra["search"]
    assert default.usage.prompt_tokens_details.cached_tokens == parts[last].num_tokens


def test_search_names_no_part_when_the_training_text_is_damaged_or_deleted(chat_server: LiveServer, model) -> None:
    """Where the parts cannot be rebuilt from the training file, search says so (no part), and chat
    answers by the mixture of every part as for a message of stop words: never a store error."""
    key = chat_server.add_user()
    marker = "Its last page was torn out."
    file_id = upload_text(chat_server.openai(key), f"{CORPUS}\n\n{marker}", name="quelmor.md")
    record = SimpleNamespace(id="dbk-searched", training_files=[file_id],
                             config=json.dumps({"part_tokens": PART_TOKENS}))
    texts = corpus_parts(model.tokenizer, f"{CORPUS}\n\n{marker}", PART_TOKENS)
    last = next(j for j, text in enumerate(texts) if "Dunstable" in text)
    admin = Principal(0, "admin", admin=True)
    store = open_store(chat_server.data_dir)
    try:
        def found() -> list[int]:  # a fresh index each time: the server keeps one per cartridge
            asked = "What does Dunstable keep?"
            return Passages(store).find_parts(admin, record, model.tokenizer, len(texts), asked)

        assert found() == [last]
        blobs = [p for p in (chat_server.data_dir / "blobs").iterdir()
                 if p.is_file() and marker.encode() in p.read_bytes()]
        assert blobs
        for blob in blobs:  # a flipped byte: the store's checksum no longer matches
            damaged = bytearray(blob.read_bytes())
            damaged[0] ^= 1
            blob.write_bytes(bytes(damaged))
        assert found() == []
        store.delete_file(admin.owner, file_id)
        assert found() == []
    finally:
        store.close()


def test_preload_builds_the_index_that_search_finds_parts_by(chat_server: LiveServer, model) -> None:
    """After a preload the part index is in memory: a training file deleted since changes nothing,
    where without it the search could no longer rebuild the parts and would compose them all."""
    key = chat_server.add_user()
    client = chat_server.openai(key)
    with Client(chat_server.url, key) as blocks:
        file_id = upload_text(client, CORPUS, name="quelmor.md")
        block = blocks.datablocks.train([file_id], name="preloaded", config=TINY_TRAIN_CONFIG, parts=True,
                                        part_tokens=PART_TOKENS)
        assert blocks.datablocks.wait(block["id"], timeout=180, poll_interval=0.2, progress=False)["status"] == "succeeded"
    texts = corpus_parts(model.tokenizer, CORPUS, PART_TOKENS)
    last = next(j for j, text in enumerate(texts) if "Dunstable" in text)
    assert httpx.post(chat_server.url + "/preload", json=[block["id"]],
                      headers={"Authorization": f"Bearer {key}"}).json() == {block["id"]: "loaded"}
    client.files.delete(file_id)
    reply = client.chat.completions.create(model=block["id"], messages=[{"role": "user", "content":
                                           "What does Dunstable keep?"}], max_tokens=2)
    assert reply.model_extra["search"]["cartridges"][0]["parts"] == [last + 1]


def test_the_terminal_chat_searches_on_a_server_and_says_why_not_here(chat_server: LiveServer, trained) -> None:
    from .test_chat_cli import chat
    from .test_chat_retrieval import _cached_tokens

    block = trained["block"]
    question = "What does Dunstable keep?"
    expected = chat_server.openai(trained["key"]).chat.completions.create(
        model=block["id"], messages=[{"role": "user", "content": question}], temperature=0, max_tokens=8,
        extra_body={"composition": "search"})
    before = _cached_tokens(chat_server)
    # Without --composition the server's default: search.
    done = chat("--server", chat_server.url, "--api-key", trained["key"], "--model", block["id"], "--max-tokens", "8",
                "--temperature", "0", stdin=f"{question}\n/exit\n")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == expected.choices[0].message.content.strip()
    [used] = expected.model_extra["search"]["cartridges"]
    assert f"(part {used['parts'][0]} of {used['of']} of {block['id']})" in done.stderr  # which part answered
    # One part's KV in front, not every part's.
    assert _cached_tokens(chat_server) - before == expected.usage.prompt_tokens_details.cached_tokens < block["num_tokens"]
    local = chat("--composition", "search", stdin="")
    assert local.returncode == 2 and "needs --corpus" in local.stderr


def test_its_file_downloads_whole_and_single_cartridge_formats_are_refused(chat_server: LiveServer, model, trained,
                                                                            tmp_path) -> None:
    block = trained["block"]
    http = chat_server.http(trained["key"])
    content = http.get(f"/v1/datablocks/{block['id']}/content")
    assert content.status_code == 200
    (tmp_path / "parts.safetensors").write_bytes(content.content)
    downloaded = load_cartridges(tmp_path / "parts.safetensors")
    assert downloaded == stored_parts(chat_server, block["id"])
    # Each part records the cut, so that the training text searches the file's parts anywhere.
    assert {part.config["part_tokens"] for part in downloaded} == {PART_TOKENS}
    texts = corpus_parts(model.tokenizer, CORPUS, PART_TOKENS)
    last = next(j for j, text in enumerate(texts) if "Dunstable" in text)
    assert part_search_for(model.tokenizer, CORPUS, downloaded).find("What does Dunstable keep?") == [last]
    for fmt in ("peft", "pt"):
        refused = http.get(f"/v1/datablocks/{block['id']}/content", params={"format": fmt})
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "format_unavailable"
        assert "trained in parts" in refused.json()["error"]["message"]


def test_its_file_imports_as_a_cartridge_in_parts(chat_server: LiveServer, trained, tmp_path) -> None:
    block = trained["block"]
    downloaded = tmp_path / "parts.safetensors"
    downloaded.write_bytes(chat_server.http(trained["key"]).get(f"/v1/datablocks/{block['id']}/content").content)
    key = chat_server.add_user("importer")
    done = subprocess.run([sys.executable, "-m", "cartridges.cli", "import", str(downloaded), "--user", "importer",
                           "--name", "imported", "--model", str(chat_server.model), "--data-dir",
                           str(chat_server.data_dir)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"cartridge in {len(block['metrics']['parts'])} parts" in done.stderr
    imported = chat_server.http(key).get(f"/v1/datablocks/{done.stdout.strip()}").json()
    assert imported["parts"] is True and imported["imported_from"] == "parts.safetensors"
    assert imported["num_tokens"] == block["num_tokens"]
    assert [p["num_tokens"] for p in imported["metrics"]["parts"]] == [p["num_tokens"] for p in block["metrics"]["parts"]]
    # It answers as the datablock it came from, by mixture.
    asked = dict(messages=MESSAGES, temperature=0, max_tokens=8, extra_body={"composition": "mixture"})
    theirs = chat_server.openai(key).chat.completions.create(model=imported["id"], **asked)
    ours = chat_server.openai(trained["key"]).chat.completions.create(model=block["id"], **asked)
    assert theirs.choices[0].message.content == ours.choices[0].message.content
    assert theirs.usage.prompt_tokens_details.cached_tokens == block["num_tokens"]
    # Imported, it has no training files to search: `search` (the default) composes all its parts by mixture.
    searched = chat_server.openai(key).chat.completions.create(
        model=imported["id"], messages=[{"role": "user", "content": "What does Dunstable keep?"}], max_tokens=2)
    assert searched.usage.prompt_tokens_details.cached_tokens == block["num_tokens"]
    assert searched.model_extra["search"]["cartridges"][0]["parts"] == list(range(1, len(block["metrics"]["parts"]) + 1))
    assert "answer by mixture, not by search (without --training-files)" in done.stderr
    # Imported with the files it was trained on (the user's own uploads), it searches as the datablock does.
    command = [sys.executable, "-m", "cartridges.cli", "import", str(downloaded), "--user", "importer", "--model",
               str(chat_server.model), "--data-dir", str(chat_server.data_dir), "--training-files"]
    others = subprocess.run(command + [trained["block"]["training_files"][0]], capture_output=True, text=True,
                            timeout=120)
    assert others.returncode == 1 and "No such file" in others.stderr  # another user's file
    edited = upload_text(chat_server.openai(key), CORPUS.replace("Dunstable", "Dunstaple"), name="quelmor.md")
    not_its_own = subprocess.run(command + [edited], capture_output=True, text=True, timeout=120)
    assert not_its_own.returncode == 1 and "was trained on another text" in not_its_own.stderr, not_its_own.stderr
    with_files = subprocess.run(command + [upload_text(chat_server.openai(key), CORPUS, name="quelmor.md")],
                                capture_output=True, text=True, timeout=120)
    assert with_files.returncode == 0 and "not by search" not in with_files.stderr, with_files.stderr
    asked = [{"role": "user", "content": "What does Dunstable keep?"}]
    theirs = chat_server.openai(key).chat.completions.create(model=with_files.stdout.strip(), messages=asked,
                                                             temperature=0, max_tokens=8)
    ours = chat_server.openai(trained["key"]).chat.completions.create(model=block["id"], messages=asked,
                                                                      temperature=0, max_tokens=8)
    assert theirs.model_extra["search"]["cartridges"][0]["parts"] == ours.model_extra["search"]["cartridges"][0]["parts"]
    assert len(theirs.model_extra["search"]["cartridges"][0]["parts"]) == 1
    assert theirs.choices[0].message.content == ours.choices[0].message.content


def test_a_corpus_within_one_part_is_one_cartridge(chat_server: LiveServer, trained, tmp_path) -> None:
    key = trained["key"]
    with Client(chat_server.url, key) as client:
        block = client.datablocks.train([upload_text(chat_server.openai(key), DOCUMENT)], name="short",
                                        config=TINY_TRAIN_CONFIG, parts=True)
        done = client.datablocks.wait(block["id"], timeout=180, poll_interval=0.2, progress=False)
    assert done["status"] == "succeeded" and done["parts"] is True and done["part_tokens"] == 2048  # two contexts
    assert done["metrics"]["parts"] is None and done["metrics"]["quality"] is not None
    assert len(stored_parts(chat_server, done["id"])) == 1 and done["num_tokens"] == TINY_TRAIN_CONFIG["num_tokens"]
    reply = chat_server.openai(key).chat.completions.create(model=done["id"], messages=MESSAGES, max_tokens=2,
                                                             extra_body={"composition": "concatenate"})
    assert reply.usage.prompt_tokens_details.cached_tokens == TINY_TRAIN_CONFIG["num_tokens"]
    # Nothing in parts to search: with the default composition the response names no part.
    reply = chat_server.openai(key).chat.completions.create(model=done["id"], messages=MESSAGES, max_tokens=2)
    assert "search" not in reply.model_extra
    # One cartridge records the digest of its text: imported with other files than it was trained on, refused.
    downloaded = tmp_path / "one.safetensors"
    downloaded.write_bytes(chat_server.http(key).get(f"/v1/datablocks/{done['id']}/content").content)
    importer_key = chat_server.add_user("one-importer")
    importer = chat_server.openai(importer_key)
    command = [sys.executable, "-m", "cartridges.cli", "import", str(downloaded), "--user", "one-importer", "--model",
               str(chat_server.model), "--data-dir", str(chat_server.data_dir), "--training-files"]
    edited = subprocess.run(command + [upload_text(importer, DOCUMENT.replace("Quelmor", "Quelmar"))],
                            capture_output=True, text=True, timeout=120)
    assert edited.returncode == 1 and "the cartridge was trained on another text" in edited.stderr, edited.stderr
    own_file = upload_text(importer, DOCUMENT)
    own = subprocess.run(command + [own_file], capture_output=True, text=True, timeout=120)
    assert own.returncode == 0, own.stderr
    assert chat_server.http(importer_key).get(f"/v1/datablocks/{own.stdout.strip()}").json()["training_files"] == [own_file]


def test_a_corpus_past_four_contexts_trains_in_parts_unless_told(chat_server: LiveServer, trained, model) -> None:
    key = trained["key"]
    sections = [f"## {n}. Part {n}\n\n{DOCUMENT.strip()}" for n in range(1, 13)]
    long = "# Quelmor at length\n\nThe village, again and again.\n\n" + "\n\n".join(sections)
    tokens = len(model.tokenizer.encode(long))
    assert tokens > 4 * 1024  # four of the tiny model's contexts
    with Client(chat_server.url, key) as client:
        file_id = upload_text(chat_server.openai(key), long, name="long.md")
        left = client.datablocks.train([file_id], name="auto", config=TINY_TRAIN_CONFIG)
        # One cartridge keeps a token of each of the corpus' windows: 16 of them.
        told = client.datablocks.train([file_id], name="one", config=TINY_TRAIN_CONFIG | {"num_tokens": 16}, parts=False)
        short = client.datablocks.train([upload_text(chat_server.openai(key), DOCUMENT)], name="brief",
                                        config=TINY_TRAIN_CONFIG)
        assert left["parts"] is None and left["num_tokens"] is None  # decided once the job reads the files
        assert told["parts"] is False and told["num_tokens"] == 16
        left, told, short = (client.datablocks.wait(b["id"], timeout=300, poll_interval=0.2, progress=False)
                             for b in (left, told, short))
    assert left["status"] == told["status"] == short["status"] == "succeeded", (left["error"], told["error"], short["error"])
    expected = corpus_parts(model.tokenizer, long, 2 * 1024)  # parts of two contexts
    assert left["parts"] is True and left["part_tokens"] == 2048 and len(left["metrics"]["parts"]) == len(expected) >= 3
    assert len(stored_parts(chat_server, left["id"])) == len(expected)
    for one in (told, short):
        assert one["parts"] is False and one["metrics"]["parts"] is None and len(stored_parts(chat_server, one["id"])) == 1


def test_deleting_it_unloads_every_part(chat_server: LiveServer, trained) -> None:
    key = trained["key"]
    client = chat_server.openai(key)
    with Client(chat_server.url, key) as blocks:
        block = blocks.datablocks.train([upload_text(client, CORPUS)], name="gone", config=TINY_TRAIN_CONFIG,
                                        parts=True, part_tokens=PART_TOKENS)
        assert blocks.datablocks.wait(block["id"], timeout=180, poll_interval=0.2, progress=False)["status"] == "succeeded"
        before = httpx.get(chat_server.url + "/v1/status").json()["cartridges"]["loaded"]
        client.chat.completions.create(model=block["id"], messages=MESSAGES, max_tokens=2)
        loaded = httpx.get(chat_server.url + "/v1/status").json()["cartridges"]["loaded"]
        assert loaded - before == 1 and len(stored_parts(chat_server, block["id"])) >= 2  # a cartridge in parts once
        assert f'cartridges_cartridges_loaded {float(loaded)}' in httpx.get(chat_server.url + "/metrics").text
        blocks.datablocks.delete(block["id"])
    assert httpx.get(chat_server.url + "/v1/status").json()["cartridges"]["loaded"] == before
    assert block["id"] not in [m.id for m in client.models.list().data]


def test_bad_parts_requests_are_refused(chat_server: LiveServer, trained) -> None:
    http = chat_server.http(trained["key"])
    file_id = trained["block"]["training_files"][0]
    for body, says, param in (({"parts": False, "part_tokens": 500}, "cannot go with `parts: false`", None),
                              ({"parts": True, "part_tokens": 8}, "64", "part_tokens"),
                              ({"parts": "yes please"}, "bool", "parts")):
        refused = http.post("/v1/datablocks/train", json={"training_file": file_id, **body})
        error = refused.json()["error"]
        assert refused.status_code == 400 and says in error["message"] and error["param"] == param, error


def test_the_cli_waits_with_the_part_in_its_bar(chat_server: LiveServer, trained, monkeypatch, capsys) -> None:
    from cartridges.cli import main

    file_id = trained["block"]["training_files"][0]
    monkeypatch.setattr("sys.stderr", io.StringIO())
    code = main(["datablocks", "--base-url", chat_server.url, "--api-key", trained["key"], "train", file_id,
                 "--name", "cli", "--config", '{"num_tokens": 8, "num_samples": 8, "chunk_tokens": 24, '
                 '"teacher_tokens": 48, "synthesis_batch_size": 2, "max_question_tokens": 6, "max_answer_tokens": 6, '
                 '"top_k": 4, "epochs": 1, "batch_size": 2}', "--parts", "--part-tokens", str(PART_TOKENS), "--wait"])
    assert code == 0
    out = capsys.readouterr().out
    assert '"parts": true' in out and f'"part_tokens": {PART_TOKENS}' in out
