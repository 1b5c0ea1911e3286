"""Retrieval in chat (docs/api.md §4.3) on a live server with a tiny model, through the official
openai client: the passages of the cartridge's own training files that best match the last user
message go in a system message behind the cartridge, exactly as the library would put them;
bad options, a request without a cartridge and a deleted training file get clear errors."""

from __future__ import annotations

import httpx
import openai
import pytest

import cartridges
from cartridges import Client
from cartridges.retrieval import Retriever, passages_prompt
from cartridges.selfstudy.chunking import named_texts

from .conftest import LiveServer, upload_text
from .test_chat_api import UNTRAINED, greedy, stored_cartridge
from .tiny_hf_model import DOCUMENT

pytestmark = pytest.mark.slow

FERRY = "The ferry Maribel crosses the lake twice a day. Its captain, Ilse Varn, keeps goats on the island."
FILES = [("bells.txt", DOCUMENT), ("ferry.txt", FERRY)]
QUESTION = [{"role": "user", "content": "Who is the captain of the ferry Maribel?"}]


@pytest.fixture(scope="module")
def model(tiny_model_dir) -> cartridges.Model:
    return cartridges.load_model(tiny_model_dir)


def train_harbor(chat_server: LiveServer) -> dict:
    """A new user with a cartridge trained on the two files."""
    key = chat_server.add_user()
    client = chat_server.openai(key)
    file_ids = [upload_text(client, text, name=name) for name, text in FILES]
    with Client(chat_server.url, key) as api:
        block = api.datablocks.train(file_ids, name="harbor", config=UNTRAINED)
        done = api.datablocks.wait(block["id"], timeout=120, poll_interval=0.2)
    assert done["status"] == "succeeded", done
    return {"key": key, "cartridge": done["id"], "files": file_ids}


@pytest.fixture(scope="module")
def owner(chat_server: LiveServer) -> dict:
    return train_harbor(chat_server)


def expected_passages(model: cartridges.Model, question: str, k: int) -> list[str]:
    return Retriever.from_texts(model.tokenizer, named_texts(FILES)).search(question, k)


def test_the_best_passages_go_behind_the_cartridge(chat_server: LiveServer, model: cartridges.Model,
                                                   owner: dict) -> None:
    client = chat_server.openai(owner["key"])
    reply = greedy(client, owner["cartridge"], messages=QUESTION, extra_body={"retrieval": {"top_k": 2}})
    passages = expected_passages(model, QUESTION[0]["content"], 2)
    # Only the ferry file shares a word with the question: the bells are left out.
    assert len(passages) == 1 and passages[0].startswith("# ferry.txt\n\n") and "Ilse Varn" in passages[0]
    expected = [{"role": "system", "content": passages_prompt(passages)}, *QUESTION]
    assert reply.usage.prompt_tokens == 24 + len(model.encode_chat(expected))
    assert reply.usage.prompt_tokens_details.cached_tokens == 24
    stored = stored_cartridge(chat_server, owner["cartridge"])
    assert reply.choices[0].message.content == model.chat(expected, cartridges=[stored], max_tokens=12)
    # `true` asks for the default top 4: the same single passage here; streaming gives the same reply
    default = greedy(client, owner["cartridge"], messages=QUESTION, extra_body={"retrieval": True})
    assert default.choices[0].message.content == reply.choices[0].message.content
    # the response names the passages it used: their file, their cartridge and their text
    cited = reply.model_extra["retrieval"]["passages"]
    assert [(c["cartridge"], c["file_id"], c["filename"], c["text"]) for c in cited] == [
        (owner["cartridge"], owner["files"][1], "ferry.txt", passages[0])]
    assert cited[0]["score"] > 0
    stream = list(client.chat.completions.create(model=owner["cartridge"], messages=QUESTION, temperature=0,
                                                 max_tokens=12, stream=True, extra_body={"retrieval": True}))
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == reply.choices[0].message.content
    # streamed, on the first chunk only
    assert stream[0].model_extra["retrieval"]["passages"] == default.model_extra["retrieval"]["passages"]
    assert all("retrieval" not in c.model_extra for c in stream[1:])
    # without retrieval the prompt is the question alone, and the response has no such field
    plain = greedy(client, owner["cartridge"], messages=QUESTION)
    assert plain.usage.prompt_tokens == 24 + len(model.encode_chat(QUESTION))
    assert "retrieval" not in plain.model_extra


def test_the_passages_come_before_the_callers_system_message(chat_server: LiveServer, model: cartridges.Model,
                                                             owner: dict) -> None:
    client = chat_server.openai(owner["key"])
    messages = [{"role": "system", "content": "Answer in one word."},
                {"role": "user", "content": "Tell me about the ferry."},
                {"role": "assistant", "content": "It crosses the lake."},
                {"role": "user", "content": "Who casts bells, and when was Brannick cast?"}]
    reply = greedy(client, owner["cartridge"], messages=messages, extra_body={"retrieval": {"top_k": 1}})
    passages = expected_passages(model, messages[-1]["content"], 1)  # the last user message is the query
    assert len(passages) == 1 and "Brannick" in passages[0] and "Maribel" not in passages[0]
    expected = [{"role": "system", "content": f"{passages_prompt(passages)}\n\nAnswer in one word."}, *messages[1:]]
    assert reply.usage.prompt_tokens == 24 + len(model.encode_chat(expected))
    stored = stored_cartridge(chat_server, owner["cartridge"])
    assert reply.choices[0].message.content == model.chat(expected, cartridges=[stored], max_tokens=12)


def test_a_question_that_shares_no_word_gets_no_passage(chat_server: LiveServer, model: cartridges.Model,
                                                        owner: dict) -> None:
    client = chat_server.openai(owner["key"])
    messages = [{"role": "user", "content": "Why?"}]
    reply = greedy(client, owner["cartridge"], messages=messages, extra_body={"retrieval": True})
    assert reply.usage.prompt_tokens == 24 + len(model.encode_chat(messages))
    assert reply.model_extra["retrieval"] == {"passages": []}


def test_bad_retrieval_requests(chat_server: LiveServer, owner: dict) -> None:
    client = chat_server.openai(owner["key"])
    for bad in ({"top_k": 0}, {"top_k": 17}, {"topk": 2}, "yes", 3):
        with pytest.raises(openai.BadRequestError) as error:
            greedy(client, owner["cartridge"], messages=QUESTION, extra_body={"retrieval": bad})
        assert error.value.body["param"].startswith("retrieval"), (bad, error.value.body)
    with pytest.raises(openai.BadRequestError) as error:  # nothing to search without a cartridge
        greedy(client, "tiny", messages=QUESTION, extra_body={"retrieval": True})
    assert error.value.body["param"] == "retrieval" and "cartridge" in error.value.body["message"]
    # another user cannot reach the cartridge, nor its files through retrieval
    stranger = chat_server.openai(chat_server.add_user())
    with pytest.raises(openai.NotFoundError):
        greedy(stranger, owner["cartridge"], messages=QUESTION, extra_body={"retrieval": True})


def test_a_deleted_training_file_stops_retrieval_not_the_cartridge(chat_server: LiveServer) -> None:
    owner = train_harbor(chat_server)
    client = chat_server.openai(owner["key"])
    greedy(client, owner["cartridge"], messages=QUESTION, extra_body={"retrieval": True})  # indexed and cached
    client.files.delete(owner["files"][1])
    with pytest.raises(openai.ConflictError) as error:
        greedy(client, owner["cartridge"], messages=QUESTION, extra_body={"retrieval": True})
    assert error.value.body["code"] == "retrieval_unavailable" and owner["files"][1] in error.value.body["message"]
    assert greedy(client, owner["cartridge"], messages=QUESTION).choices[0].message.content is not None


def test_the_cli_chat_asks_for_retrieval(chat_server: LiveServer, owner: dict) -> None:
    from .test_chat_cli import chat

    client = chat_server.openai(owner["key"])
    question = "Who keeps goats on the island?"
    messages = [{"role": "user", "content": question}]
    expected = greedy(client, owner["cartridge"], messages=messages, max_tokens=6, extra_body={"retrieval": {"top_k": 1}})
    plain = greedy(client, owner["cartridge"], messages=messages, max_tokens=6)
    assert expected.usage.prompt_tokens > plain.usage.prompt_tokens  # a passage went in
    done = chat("--server", chat_server.url, "--api-key", owner["key"], "--model", owner["cartridge"], "--retrieval",
                "1", "--max-tokens", "6", "--temperature", "0", stdin=f"{question}\n/exit\n")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == expected.choices[0].message.content.strip()
    assert "(passages: ferry.txt)" in done.stderr  # where the passage came from, beside the reply
    local = chat("--retrieval", stdin="")
    assert local.returncode == 2 and "--retrieval without --server needs --corpus" in local.stderr
    too_many = chat("--server", chat_server.url, "--api-key", owner["key"], "--retrieval", "17", stdin="")
    assert too_many.returncode == 2 and "--retrieval takes 1 to 16 passages" in too_many.stderr
    alone = greedy(client, owner["cartridge"], messages=messages, max_tokens=16,
                   extra_body={"retrieval": {"top_k": 1, "passages_only": True}})
    cached = _cached_tokens(chat_server)
    done = chat("--server", chat_server.url, "--api-key", owner["key"], "--model", owner["cartridge"], "--retrieval",
                "1", "--passages-only", "--max-tokens", "16", "--temperature", "0", stdin=f"{question}\n/exit\n")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == alone.choices[0].message.content.strip()
    assert _cached_tokens(chat_server) == cached  # no cartridge tokens went into its prompt
    lone = chat("--server", chat_server.url, "--passages-only", stdin="")
    assert lone.returncode == 2 and "--passages-only needs --retrieval" in lone.stderr


def test_a_local_chat_retrieves_from_the_corpus_files_as_the_server_does(chat_server: LiveServer, owner: dict,
                                                                         tiny_model_dir, tmp_path) -> None:
    """`cartridges chat --cartridge FILE --corpus FILE... --retrieval` without a server: the same
    passages in the same prompt behind the same cartridge, so the same greedy reply."""
    from .test_chat_cli import chat

    client = chat_server.openai(owner["key"])
    cart = tmp_path / "harbor.safetensors"
    stored_cartridge(chat_server, owner["cartridge"]).save(cart)
    for name, text in FILES:
        (tmp_path / name).write_text(text)
    corpus = [str(tmp_path / name) for name, _ in FILES]
    question = "Who keeps goats on the island?"
    for options, flags in (({"top_k": 1}, ["--retrieval", "1"]),
                           ({"top_k": 2, "passages_only": True}, ["--retrieval", "2", "--passages-only"])):
        served = greedy(client, owner["cartridge"], messages=[{"role": "user", "content": question}], max_tokens=8,
                        extra_body={"retrieval": options})
        done = chat("--model", str(tiny_model_dir), "--cartridge", str(cart), "--corpus", *corpus, *flags,
                    "--max-tokens", "8", stdin=f"{question}\n/exit\n")
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == served.choices[0].message.content.strip(), flags
        files = dict.fromkeys(p["filename"] for p in served.model_extra["retrieval"]["passages"])
        assert f"(passages: {', '.join(files)})" in done.stderr and "ferry.txt" in files
    (tmp_path / "ferry.txt").write_text(FERRY.replace("goats", "sheep"))  # not the text it was trained on
    done = chat("--model", str(tiny_model_dir), "--cartridge", str(cart), "--corpus", *corpus, "--retrieval", stdin="")
    assert done.returncode == 1 and "trained on another text" in done.stderr


def test_passages_only_leaves_the_cartridge_out(chat_server: LiveServer, model: cartridges.Model,
                                                owner: dict) -> None:
    """`{"passages_only": true}`: the same passages in the same system message, and no cartridge
    in front: the base model's reply to that prompt."""
    client = chat_server.openai(owner["key"])
    options = {"top_k": 2, "passages_only": True}
    reply = greedy(client, owner["cartridge"], messages=QUESTION, extra_body={"retrieval": options})
    passages = expected_passages(model, QUESTION[0]["content"], 2)
    expected = [{"role": "system", "content": passages_prompt(passages)}, *QUESTION]
    assert reply.usage.prompt_tokens == len(model.encode_chat(expected))  # no cartridge tokens
    assert not reply.usage.prompt_tokens_details or not reply.usage.prompt_tokens_details.cached_tokens
    assert reply.choices[0].message.content == model.chat(expected, max_tokens=12)
    assert [c["text"] for c in reply.model_extra["retrieval"]["passages"]] == passages
    stream = list(client.chat.completions.create(model=owner["cartridge"], messages=QUESTION, temperature=0,
                                                 max_tokens=12, stream=True, extra_body={"retrieval": options}))
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == reply.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as error:  # a strict boolean
        greedy(client, owner["cartridge"], messages=QUESTION, extra_body={"retrieval": {"passages_only": "yes"}})
    assert error.value.body["param"].startswith("retrieval")
    stranger = chat_server.openai(chat_server.add_user())  # the cartridge is still the caller's own
    with pytest.raises(openai.NotFoundError):
        greedy(stranger, owner["cartridge"], messages=QUESTION, extra_body={"retrieval": options})


def _cached_tokens(server: LiveServer) -> float:
    """The server's count of prompt tokens served from cartridges (/metrics)."""
    line = next(line for line in httpx.get(server.url + "/metrics").text.splitlines()
                if line.startswith("cartridges_cached_tokens_total"))
    return float(line.split()[-1])
