"""The clients users already run, unchanged, against a live server on a tiny model: the official
`openai` SDK, LangChain's `ChatOpenAI` and LiteLLM, plain chats and cartridges through
`extra_body` (the README shows each)."""

from __future__ import annotations

import asyncio
import os

import openai
import pytest

from cartridges import Client

from .conftest import LiveServer, upload_text
from .tiny_hf_model import DOCUMENT, TINY_TRAIN_CONFIG

pytestmark = pytest.mark.slow

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # LiteLLM would fetch its price list at import

UNTRAINED = {**TINY_TRAIN_CONFIG, "num_tokens": 24, "learning_rate": 1e-30}  # the document's own KV, in effect
MESSAGES = [{"role": "user", "content": "Who rings the bell?"}]
GREEDY = {"temperature": 0, "max_tokens": 8}


@pytest.fixture(scope="module")
def user(chat_server: LiveServer) -> dict:
    """A user with one cartridge."""
    key = chat_server.add_user()
    with Client(chat_server.url, key) as client:
        block = client.datablocks.train([upload_text(chat_server.openai(key), DOCUMENT)], name="bells",
                                        config=UNTRAINED)
        done = client.datablocks.wait(block["id"], timeout=120, poll_interval=0.2)
    assert done["status"] == "succeeded", done
    return {"key": key, "cartridge": done["id"], "url": chat_server.url + "/v1"}


def reference(server: LiveServer, user: dict, cartridges: list[str] | None = None) -> str:
    """The greedy reply, asked over plain HTTP."""
    body = {"model": "tiny", "messages": MESSAGES, **GREEDY} | ({"cartridges": cartridges} if cartridges else {})
    response = server.http(user["key"]).post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


# -- the official openai SDK -------------------------------------------------------------------


def test_openai_sdk(chat_server: LiveServer, user: dict) -> None:
    client = openai.OpenAI(base_url=user["url"], api_key=user["key"], max_retries=0)
    try:
        uploaded = client.files.create(file=("notes.txt", b"The ferry leaves at nine."), purpose="assistants")
        assert uploaded.filename == "notes.txt" and uploaded.bytes == 25
        assert uploaded.id in [f.id for f in client.files.list()]
        assert client.files.retrieve(uploaded.id).purpose == "assistants"
        assert client.files.content(uploaded.id).content == b"The ferry leaves at nine."
        assert client.files.delete(uploaded.id).deleted
        with_cartridge = reference(chat_server, user, [user["cartridge"]])
        assert with_cartridge != reference(chat_server, user)  # the cartridge is what the answer reads
        reply = client.chat.completions.create(model="tiny", messages=MESSAGES, **GREEDY,
                                               extra_body={"cartridges": [user["cartridge"]]})
        assert reply.choices[0].message.content == with_cartridge
        as_model = client.chat.completions.create(model=user["cartridge"], messages=MESSAGES, **GREEDY)
        assert as_model.choices[0].message.content == with_cartridge
        # the cartridges loaded in memory are listed (docs/api.md §3.1); the base model answers by id
        assert [m.id for m in client.models.list()] == [user["cartridge"]]
        assert client.models.retrieve("tiny").id == "tiny"
        chunks = list(client.chat.completions.create(model=user["cartridge"], messages=MESSAGES, **GREEDY,
                                                     stream=True, stream_options={"include_usage": True}))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == with_cartridge
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 24
        several = client.chat.completions.create(model="tiny", messages=MESSAGES, n=3, temperature=1.0, seed=2,
                                                 max_tokens=8)
        assert [c.index for c in several.choices] == [0, 1, 2]

        with pytest.raises(openai.NotFoundError) as missing:
            client.chat.completions.create(model="nosuch", messages=MESSAGES)
        assert missing.value.code == "model_not_found" and missing.value.param == "model"
        with pytest.raises(openai.BadRequestError) as bad:
            client.chat.completions.create(model="tiny", messages=MESSAGES, n=99)
        assert bad.value.code == "invalid_value" and bad.value.param == "n"
        with pytest.raises(openai.BadRequestError) as unsupported:
            client.chat.completions.create(model="tiny", messages=MESSAGES, tools=[
                {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}])
        assert unsupported.value.code == "unsupported_parameter" and unsupported.value.param == "tools"
        with pytest.raises(openai.NotFoundError):
            client.files.retrieve("file-nosuch")
    finally:
        client.close()
    stranger = openai.OpenAI(base_url=user["url"], api_key="sk-cart-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        stranger.models.list()
    stranger.close()


# -- LangChain ---------------------------------------------------------------------------------


def test_langchain_chat_openai(chat_server: LiveServer, user: dict) -> None:
    from langchain_openai import ChatOpenAI

    plain = ChatOpenAI(base_url=user["url"], api_key=user["key"], model="tiny", **GREEDY, max_retries=0)
    assert plain.invoke(MESSAGES[0]["content"]).content == reference(chat_server, user)

    expected = reference(chat_server, user, [user["cartridge"]])
    llm = ChatOpenAI(base_url=user["url"], api_key=user["key"], model="tiny", **GREEDY, max_retries=0,
                     extra_body={"cartridges": [user["cartridge"]]})
    assert llm.invoke(MESSAGES[0]["content"]).content == expected
    assert "".join(chunk.content for chunk in llm.stream(MESSAGES[0]["content"])) == expected
    assert [m.content for m in llm.batch([MESSAGES[0]["content"]] * 3)] == [expected] * 3


# -- LiteLLM -----------------------------------------------------------------------------------


@pytest.fixture
def closes_litellms_loop():
    """LiteLLM's blocking calls make an event loop the thread's current one and never close it;
    the next `asyncio.run` replaced it, and its self-pipe, collected unclosed, failed whichever
    test ran then ("unclosed <socket.socket ... family=1>"). Closed here once the test is done."""
    yield
    policy = asyncio.get_event_loop_policy()
    try:
        loop = policy.get_event_loop()
    except RuntimeError:  # none is current (LiteLLM used one made before)
        return
    if not loop.is_running():
        loop.close()
        policy.set_event_loop(None)


@pytest.mark.usefixtures("closes_litellms_loop")
def test_litellm(chat_server: LiveServer, user: dict) -> None:
    import litellm

    common = {"api_base": user["url"], "api_key": user["key"], "messages": MESSAGES, **GREEDY}
    reply = litellm.completion(model="openai/tiny", **common)
    assert reply.choices[0].message.content == reference(chat_server, user)

    expected = reference(chat_server, user, [user["cartridge"]])
    reply = litellm.completion(model="openai/tiny", **common, extra_body={"cartridges": [user["cartridge"]]})
    assert reply.choices[0].message.content == expected
    stream = litellm.completion(model=f"openai/{user['cartridge']}", **common, stream=True)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream) == expected
