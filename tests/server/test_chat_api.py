"""Chat completions, models, preload, health, status and metrics (docs/api.md §3–4) on a live server
with a tiny model, through the official openai client: every field, streaming and not;
exactness against the library; cartridges loaded, composed, isolated and deleted."""

from __future__ import annotations

import os
import time

import httpx
import openai
import pytest
import torch

import cartridges
from cartridges import Cartridge, Client
from cartridges.selfstudy.chunking import Corpus
from cartridges.store import core, open_store

from .conftest import ADMIN_KEY, LiveServer, upload_text
from .tiny_hf_model import DOCUMENT, TINY_TRAIN_CONFIG

pytestmark = pytest.mark.slow

# An untrained cartridge, in effect: a learning rate far below float32's resolution leaves
# the initialization (the KV of the document's first tokens) as it was.
UNTRAINED = {**TINY_TRAIN_CONFIG, "num_tokens": 24, "learning_rate": 1e-30}
OTHER_DOCUMENT = "The ferry Maribel crosses the lake twice a day. Its captain, Ilse Varn, keeps goats. " * 3
MESSAGES = [{"role": "user", "content": "Who rings the bell?"}]
EXPECTED_DEVICE = os.environ.get("CARTRIDGES_DEVICE", "cpu")  # the servers' (CI: cpu; a GPU check: cuda)


@pytest.fixture(scope="module")
def model(tiny_model_dir) -> cartridges.Model:
    return cartridges.load_model(tiny_model_dir)


@pytest.fixture(scope="module")
def owner(chat_server: LiveServer) -> dict:
    """A user with two untrained cartridges (one per document)."""
    key = chat_server.add_user()
    client = chat_server.openai(key)
    ids = []
    with Client(chat_server.url, key) as datablocks:
        for name, text in (("bells", DOCUMENT), ("ferry", OTHER_DOCUMENT)):
            block = datablocks.datablocks.train([upload_text(client, text)], name=name, config=UNTRAINED)
            done = datablocks.datablocks.wait(block["id"], timeout=120, poll_interval=0.2)
            assert done["status"] == "succeeded", done
            ids.append(done["id"])
    return {"key": key, "bells": ids[0], "ferry": ids[1]}


def stored_cartridge(server: LiveServer, datablock_id: str) -> Cartridge:
    store = open_store(server.data_dir)
    try:
        return Cartridge.load(store.datablock_cartridge_path(core().Owner(0, True), datablock_id))
    finally:
        store.close()


def greedy(client: openai.OpenAI, model: str, **kwargs):
    return client.chat.completions.create(model=model, messages=kwargs.pop("messages", MESSAGES), temperature=0,
                                          max_tokens=kwargs.pop("max_tokens", 12), **kwargs)


# -- the base model ----------------------------------------------------------------------------


def test_chat_fields_and_usage(chat_server: LiveServer, model: cartridges.Model) -> None:
    client = chat_server.openai()
    reply = greedy(client, "tiny", max_tokens=7)
    assert reply.object == "chat.completion" and reply.id.startswith("chatcmpl-") and reply.model == "tiny"
    assert abs(reply.created - time.time()) < 60
    (choice,) = reply.choices
    assert choice.index == 0 and choice.message.role == "assistant" and choice.logprobs is None
    assert choice.finish_reason in ("stop", "length")
    prompt = len(model.encode_chat(MESSAGES))
    assert reply.usage.prompt_tokens == prompt and reply.usage.prompt_tokens_details.cached_tokens == 0
    assert reply.usage.total_tokens == prompt + reply.usage.completion_tokens
    if choice.finish_reason == "length":
        assert reply.usage.completion_tokens == 7
    # the newer name of the limit works the same
    again = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_completion_tokens=7)
    assert again.choices[0].message.content == choice.message.content


def test_greedy_chat_equals_the_library(chat_server: LiveServer, model: cartridges.Model) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Where do ships go?"},
                {"role": "assistant", "content": "Out."}, {"role": "user", "content": "When?"}]
    reply = greedy(chat_server.openai(), "tiny", messages=messages, max_tokens=16)
    assert reply.choices[0].message.content == model.chat(messages, max_tokens=16)


def test_streaming_equals_the_whole_answer(chat_server: LiveServer) -> None:
    client = chat_server.openai()
    whole = greedy(client, "tiny", max_tokens=10)
    chunks = list(greedy(client, "tiny", max_tokens=10, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finished = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finished == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert all(c.usage is None for c in chunks[:-1])
    # without include_usage there is no usage chunk
    plain = list(greedy(client, "tiny", max_tokens=10, stream=True))
    assert all(c.choices and c.usage is None for c in plain)


def test_raw_event_stream_ends_with_done(chat_server: LiveServer) -> None:
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 3, "stream": True}
    with chat_server.http().stream("POST", "/api/v1/chat/completions", json=body) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"


def test_choices_seeds_and_stop(chat_server: LiveServer) -> None:
    client = chat_server.openai()
    kwargs = {"model": "tiny", "messages": MESSAGES, "max_tokens": 12, "temperature": 1.0, "n": 3, "seed": 11}
    first = client.chat.completions.create(**kwargs)
    second = client.chat.completions.create(**kwargs)
    texts = [c.message.content for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert texts == [c.message.content for c in second.choices]  # same seed, same choices
    assert len(set(texts)) > 1  # distinct choices
    streamed = list(client.chat.completions.create(**kwargs, stream=True))
    by_choice = {i: "".join(choice.delta.content or "" for chunk in streamed for choice in chunk.choices
                            if choice.index == i) for i in range(3)}
    assert all(len({c.index for c in chunk.choices}) == len(chunk.choices) for chunk in streamed)
    # streamed choices come interleaved, each one as a whole equal to the non-streamed one
    assert [by_choice[i] for i in range(3)] == texts
    # a stop sequence ends the text before it
    greedy_text = greedy(client, "tiny", max_tokens=12).choices[0].message.content
    if len(greedy_text) > 4:
        stop = greedy_text[2:4]
        stopped = greedy(client, "tiny", max_tokens=12, stop=[stop, "zzzz"])
        assert stopped.choices[0].message.content == greedy_text[: greedy_text.index(stop)]
        assert stopped.choices[0].finish_reason == "stop"


def test_logprobs(chat_server: LiveServer) -> None:
    reply = greedy(chat_server.openai(), "tiny", max_tokens=6, logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    assert 1 <= len(content) <= 6
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)  # greedy: the best one
        assert entry.top_logprobs[0].token == entry.token and bytes(entry.bytes).decode(errors="replace") == entry.token
    if not any(e.token.startswith("<|") for e in content):  # special tokens are not text
        assert b"".join(bytes(e.bytes) for e in content).decode(errors="replace") == reply.choices[0].message.content
    without_top = greedy(chat_server.openai(), "tiny", max_tokens=3, logprobs=True)
    assert all(e.top_logprobs == [] for e in without_top.choices[0].logprobs.content)


def test_file_part_puts_the_text_in_the_prompt(chat_server: LiveServer, model: cartridges.Model) -> None:
    client = chat_server.openai()
    file_id = upload_text(client, DOCUMENT, purpose="assistants")
    parts = [{"type": "text", "text": "Read this."}, {"type": "file", "file": {"file_id": file_id}}]
    reply = greedy(client, "tiny", messages=[{"role": "user", "content": parts}], max_tokens=8)
    expected_messages = [{"role": "user", "content": "Read this.\n\n" + DOCUMENT}]
    assert reply.usage.prompt_tokens == len(model.encode_chat(expected_messages))
    assert reply.choices[0].message.content == model.chat(expected_messages, max_tokens=8)


# -- cartridges --------------------------------------------------------------------------------


def test_cartridge_chat_is_exact(chat_server: LiveServer, model: cartridges.Model, owner: dict) -> None:
    client = chat_server.openai(owner["key"])
    reply = greedy(client, owner["bells"], max_tokens=16)
    assert reply.usage.prompt_tokens_details.cached_tokens == 24
    assert reply.usage.prompt_tokens == 24 + len(model.encode_chat(MESSAGES))
    # the library with the stored cartridge
    stored = stored_cartridge(chat_server, owner["bells"])
    assert reply.choices[0].message.content == model.chat(MESSAGES, cartridges=[stored], max_tokens=16)
    # the cartridge is (in effect) its initialization: the document's first tokens in context
    document = Corpus.from_texts(model.tokenizer, [DOCUMENT]).tokens[:24]
    in_context = model.generate([document + model.encode_chat(MESSAGES)], max_new_tokens=16)[0]
    assert reply.choices[0].message.content == in_context.text
    # the bare run id names it too
    bare = greedy(client, owner["bells"].rsplit("/", 1)[1], max_tokens=16)
    assert bare.choices[0].message.content == reply.choices[0].message.content


def test_concatenated_cartridges_equal_both_texts_in_context(chat_server: LiveServer, model: cartridges.Model,
                                                             owner: dict) -> None:
    client = chat_server.openai(owner["key"])
    reply = greedy(client, "tiny", max_tokens=12, extra_body={"cartridges": [owner["bells"], {"id": owner["ferry"]}],
                                                              "composition": "concatenate"})
    assert reply.usage.prompt_tokens_details.cached_tokens == 48
    both = (Corpus.from_texts(model.tokenizer, [DOCUMENT]).tokens[:24]
            + Corpus.from_texts(model.tokenizer, [OTHER_DOCUMENT]).tokens[:24])
    assert reply.choices[0].message.content == model.generate([both + model.encode_chat(MESSAGES)],
                                                              max_new_tokens=12)[0].text
    # a cartridge model plus the extension: the model's cartridge comes first
    mixed = greedy(client, owner["bells"], max_tokens=12, extra_body={"cartridges": [owner["ferry"]],
                                                                      "composition": "concatenate"})
    assert mixed.choices[0].message.content == reply.choices[0].message.content


def test_composed_cartridges_mix_by_default(chat_server: LiveServer, model: cartridges.Model, owner: dict) -> None:
    """Two cartridges are composed by mixture unless asked otherwise: the reply equals the
    library's mixture of the two documents' KV, weighed from the question on (past the system
    prompt), with each one's log-probabilities."""
    client = chat_server.openai(owner["key"])
    messages = [{"role": "system", "content": "Answer from the documents."}, *MESSAGES]
    reply = greedy(client, "tiny", max_tokens=12, logprobs=True, top_logprobs=2, messages=messages,
                   extra_body={"cartridges": [owner["bells"], owner["ferry"]]})
    assert reply.usage.prompt_tokens_details.cached_tokens == 48
    kv = [model.native.prefix_from_tokens(torch.tensor(Corpus.from_texts(model.tokenizer, [text]).tokens[:24]))
          for text in (DOCUMENT, OTHER_DOCUMENT)]
    expected = model.generate([model.encode_chat(messages)], prefixes=kv, max_new_tokens=12, logprobs=2,
                              weigh_from=[model.conversation_start(messages)])[0]
    assert reply.choices[0].message.content == expected.text
    got = [t.logprob for t in reply.choices[0].logprobs.content]
    assert got == pytest.approx([t.logprob for t in expected.logprobs], abs=1e-4)
    with pytest.raises(openai.BadRequestError) as bad:
        greedy(client, "tiny", extra_body={"cartridges": [owner["bells"]], "composition": "average"})
    assert bad.value.body["param"] == "composition"


def test_models_preload_and_health(chat_server: LiveServer, owner: dict) -> None:
    http = chat_server.http(owner["key"])
    loaded = http.post("/preload", json=[owner["bells"], "nosuchcartridge", owner["ferry"]])
    assert loaded.status_code == 200
    assert loaded.json() == {owner["bells"]: "loaded", "nosuchcartridge": "error: No cartridge 'nosuchcartridge'.",
                             owner["ferry"]: "loaded"}
    models = chat_server.openai(owner["key"]).models.list().data
    assert {m.id for m in models} == {owner["bells"], owner["ferry"]}
    for m in models:
        assert m.object == "model" and m.owned_by == "cartridges" and abs(m.created - time.time()) < 600
        assert m.model_extra["parent"] == "tiny" and m.model_extra["num_tokens"] == 24
    assert chat_server.openai(owner["key"]).models.retrieve("tiny").id == "tiny"
    health = httpx.get(chat_server.url + "/health", headers={"Authorization": f"Bearer {owner['key']}"}).json()
    assert health["status"] == "healthy" and health["device"] == EXPECTED_DEVICE
    assert set(health["loaded_cartridges"]) == {owner["bells"], owner["ferry"]}
    assert httpx.get(chat_server.url + "/health").json()["loaded_cartridges"] == []  # no key: nothing
    admin = httpx.get(chat_server.url + "/health", headers={"Authorization": f"Bearer {ADMIN_KEY}"}).json()
    assert {owner["bells"], owner["ferry"]} <= set(admin["loaded_cartridges"])


def test_a_second_user_sees_nothing(chat_server: LiveServer, owner: dict) -> None:
    stranger = chat_server.add_user()
    client = chat_server.openai(stranger)
    chat_server.http(owner["key"]).post("/preload", json=[owner["bells"]])
    assert client.models.list().data == []
    health = httpx.get(chat_server.url + "/health", headers={"Authorization": f"Bearer {stranger}"}).json()
    assert health["loaded_cartridges"] == []
    preload = chat_server.http(stranger).post("/preload", json=[owner["bells"]]).json()
    assert preload == {owner["bells"]: f"error: No cartridge '{owner['bells']}'."}
    for call in (lambda: greedy(client, owner["bells"]),
                 lambda: greedy(client, "tiny", extra_body={"cartridges": [owner["bells"]]}),
                 lambda: client.models.retrieve(owner["bells"])):
        with pytest.raises(openai.NotFoundError):
            call()


def test_deleting_a_datablock_unloads_it(chat_server: LiveServer, model: cartridges.Model) -> None:
    key = chat_server.add_user()
    client = chat_server.openai(key)
    with Client(chat_server.url, key) as datablocks:
        block = datablocks.datablocks.train([upload_text(client, DOCUMENT)], name="gone", config=UNTRAINED)
        assert datablocks.datablocks.wait(block["id"], timeout=120, poll_interval=0.2)["status"] == "succeeded"
        greedy(client, block["id"], max_tokens=2)
        assert [m.id for m in client.models.list().data] == [block["id"]]
        datablocks.datablocks.delete(block["id"])
    assert client.models.list().data == []
    with pytest.raises(openai.NotFoundError):
        greedy(client, block["id"], max_tokens=2)


def test_status_and_metrics(chat_server: LiveServer, owner: dict) -> None:
    greedy(chat_server.openai(owner["key"]), owner["bells"], max_tokens=3)
    status = httpx.get(chat_server.url + "/v1/status").json()
    assert status["status"] == "ok" and status["model"] == "tiny" and status["device"] == EXPECTED_DEVICE
    assert status["cartridges"]["loaded"] >= 1 and 0 < status["cartridges"]["bytes"] <= status["cartridges"]["budget_bytes"]
    assert status["training_jobs"]["queued"] == 0 and status["engine"]["kv_tokens"] == 32768
    assert status["engine"]["threads"] >= 1 and status["uptime_s"] >= 0
    assert owner["bells"] not in str(status) and owner["key"] not in str(status)
    metrics = httpx.get(chat_server.url + "/metrics")
    assert metrics.status_code == 200 and metrics.headers["content-type"].startswith("text/plain")
    text = metrics.text
    for name in ("cartridges_http_requests_total{", "cartridges_prompt_tokens_total", "cartridges_cached_tokens_total",
                 "cartridges_completion_tokens_total", "cartridges_time_to_first_token_seconds_bucket",
                 "cartridges_time_per_output_token_seconds_bucket", "cartridges_running_requests",
                 "cartridges_waiting_requests", "cartridges_kv_pool_tokens_used", "cartridges_kv_pool_compactions_total",
                 "cartridges_cartridge_cache_bytes",
                 "cartridges_cartridge_cache_hits", "cartridges_cartridge_loads", "cartridges_cartridge_evictions",
                 'cartridges_training_jobs{status="succeeded"}'):
        assert name in text, name
    assert 'endpoint="/v1/chat/completions",method="POST",status="200"' in text
    assert owner["bells"].split("/")[0] not in text  # no user or object ids in labels


# -- bad input ---------------------------------------------------------------------------------

def test_other_bad_requests(chat_server: LiveServer, owner: dict) -> None:
    http = chat_server.http()
    message = [{"role": "user", "content": "x"}]
    cases = [
        (http.post("/v1/chat/completions", content=b"{not json", headers={"Content-Type": "application/json"}),
         400, "invalid_json"),
        (http.post("/v1/chat/completions", json={"model": "nosuch", "messages": message}), 404, "model_not_found"),
        (http.post("/v1/chat/completions", json={"model": "tiny", "messages": message, "cartridges": ["nosuch"]}),
         404, "model_not_found"),
        (http.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": [
            {"type": "file", "file": {"file_id": "file-nosuch"}}]}]}), 404, "not_found"),
        (http.post("/v1/chat/completions", json={"model": owner["bells"], "messages": message}), 404,
         "model_not_found"),  # someone else's
        (chat_server.http(None).post("/v1/chat/completions", json={"model": "tiny", "messages": message}), 401,
         "invalid_api_key"),
        (http.post("/preload", json={"ids": ["a"]}), 400, "invalid_value"),
        (http.post("/preload", json=[1, 2]), 400, "invalid_value"),
        (http.post("/preload", json=["x"] * 257), 400, "invalid_value"),
        (http.post("/preload", content=b"[", headers={"Content-Type": "application/json"}), 400, "invalid_json"),
        (chat_server.http(None).post("/preload", json=["a"]), 401, "invalid_api_key"),
        (chat_server.http(None).get("/v1/models"), 401, "invalid_api_key"),
        (http.get("/v1/models/nosuch"), 404, "model_not_found"),
    ]
    for response, status, code in cases:
        assert response.status_code == status, response.text
        assert response.json()["error"]["code"] == code, response.text
    # fields OpenAI does not define are ignored (test_openai_conformance.py: those it defines)
    ok = http.post("/v1/chat/completions", json={"model": "tiny", "messages": message, "max_tokens": 2,
                                                 "ignore_eos_please": True, "user": "someone", "tools": None})
    assert ok.status_code == 200
    assert chat_server.alive()


def test_a_client_that_leaves_cancels_its_request(chat_server: LiveServer) -> None:
    """Not streaming: the client gives up before the answer; the engine stops generating for it."""
    def generated() -> float:
        for line in httpx.get(chat_server.url + "/metrics").text.splitlines():
            if line.startswith("cartridges_completion_tokens_total"):
                return float(line.split()[1])
        raise AssertionError("no completion token counter")

    before = generated()
    # greedy on the tiny model never meets its end-of-turn token: 16 x 1000 tokens take seconds
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 1000, "temperature": 0, "n": 16}
    with pytest.raises(httpx.ReadTimeout):
        chat_server.http().post("/v1/chat/completions", json=body, timeout=0.2)
    deadline = time.monotonic() + 10
    while httpx.get(chat_server.url + "/v1/status").json()["engine"]["running_requests"]:
        assert time.monotonic() < deadline, "the request kept running after its client left"
        time.sleep(0.05)
    # Stopped before the end: all 16 x 1000 tokens are what a request nobody cancelled generates.
    # (How many come before the disconnect is seen depends on the machine: the tiny model is fast.)
    assert generated() - before < 16 * 1000


def test_default_model_end_to_end(server: LiveServer) -> None:
    """The embedded model through the official client, streaming and not."""
    client = server.openai()
    model_id = httpx.get(server.url + "/v1/status").json()["model"]
    question = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    reply = client.chat.completions.create(model=model_id, messages=question, max_tokens=8, temperature=0)
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=model_id, messages=question, max_tokens=8, temperature=0, stream=True) if c.choices)
    assert "Paris" in reply.choices[0].message.content
    assert streamed == reply.choices[0].message.content
