"""Chat completions where OpenAI's peers (vLLM, llama.cpp's server, SGLang) test their own
OpenAI-compatible servers: `stream_options` without streaming, one choice per streamed chunk,
unimplemented fields refused by name, bookkeeping fields accepted, `logit_bias` (docs/api.md §4)."""

from __future__ import annotations

import json

import pytest

import cartridges

from .conftest import LiveServer

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "Who rings the bell?"}]
BASE = {"model": "tiny", "messages": MESSAGES, "max_tokens": 6, "temperature": 0}


@pytest.fixture(scope="module")
def model(tiny_model_dir) -> cartridges.Model:
    return cartridges.load_model(tiny_model_dir)


def post(server: LiveServer, **fields):
    return server.http().post("/v1/chat/completions", json={**BASE, **fields})


def assert_refused(response, param: str, code: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, code), error
    assert param in error["message"] or code == "invalid_value"


def sse_bodies(server: LiveServer, **fields) -> list[dict | str]:
    with server.http().stream("POST", "/v1/chat/completions", json={**BASE, **fields, "stream": True}) as response:
        assert response.status_code == 200
        lines = [line.removeprefix("data: ") for line in response.iter_lines() if line]
    return [line if line == "[DONE]" else json.loads(line) for line in lines]


# -- stream_options ----------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, None])
def test_stream_options_without_streaming_is_refused(chat_server: LiveServer, stream: bool | None) -> None:
    fields = {"stream_options": {"include_usage": True}} | ({} if stream is None else {"stream": stream})
    assert_refused(post(chat_server, **fields), "stream_options", "invalid_value")
    assert post(chat_server, stream_options=None).status_code == 200  # null asks for nothing


# -- n > 1 streamed --------------------------------------------------------------------------


def test_each_streamed_chunk_carries_one_choice(chat_server: LiveServer) -> None:
    fields = {"n": 3, "temperature": 1.0, "seed": 5, "max_tokens": 8}
    whole = post(chat_server, **fields).json()
    bodies = sse_bodies(chat_server, **fields, stream_options={"include_usage": True})
    assert bodies[-1] == "[DONE]"
    chunks, usage = bodies[:-2], bodies[-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"]
    assert all(len(c["choices"]) == 1 and c["usage"] is None for c in chunks)
    for index in range(3):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        # the last chunk of a choice is its own, with the finish reason and nothing else
        assert mine[-1]["delta"] == {} and mine[-1]["finish_reason"] == whole["choices"][index]["finish_reason"]
        assert all(c["finish_reason"] is None for c in mine[:-1])
        text = "".join(c["delta"].get("content") or "" for c in mine)
        assert text == whole["choices"][index]["message"]["content"]  # same seed, same choice


# -- fields this server does not implement ---------------------------------------------------

UNSUPPORTED = [
    ("tools", [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]),
    ("tool_choice", "auto"),
    ("functions", [{"name": "f", "parameters": {"type": "object"}}]),
    ("function_call", "auto"),
    ("parallel_tool_calls", False),
    ("response_format", {"type": "json_object"}),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}),
    ("audio", {"voice": "alloy", "format": "wav"}),
    ("modalities", ["text", "audio"]),
    ("prediction", {"type": "content", "content": "x"}),
    ("web_search_options", {}),
    ("reasoning_effort", "low"),
    ("frequency_penalty", 0.5),
    ("presence_penalty", -1),
]


@pytest.mark.parametrize("field,value", UNSUPPORTED, ids=[f"{f}-{i}" for i, (f, _) in enumerate(UNSUPPORTED)])
def test_unimplemented_fields_are_refused_by_name(chat_server: LiveServer, field: str, value: object) -> None:
    assert_refused(post(chat_server, **{field: value}), field, "unsupported_parameter")


def test_fields_that_ask_for_nothing_are_accepted(chat_server: LiveServer) -> None:
    plain = post(chat_server).json()["choices"][0]["message"]["content"]
    neutral = {"tools": None, "tool_choice": None, "response_format": {"type": "text"}, "frequency_penalty": 0,
               "presence_penalty": 0, "audio": None}
    no_effect = {"store": True, "metadata": {"project": "x"}, "service_tier": "auto", "user": "u-1",
                 "prompt_cache_key": "k", "safety_identifier": "s-1"}
    for fields in (neutral, no_effect):
        response = post(chat_server, **fields)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["message"]["content"] == plain


def test_bookkeeping_fields_are_still_type_checked(chat_server: LiveServer) -> None:
    assert_refused(post(chat_server, metadata={"a": 1}), "metadata.a", "invalid_value")
    assert_refused(post(chat_server, store="yes please"), "store", "invalid_value")


# -- logit_bias ----------------------------------------------------------------------------------


def test_logit_bias_bans_and_forces_tokens_as_the_library_does(chat_server: LiveServer,
                                                               model: cartridges.Model) -> None:
    prompt = model.encode_chat(MESSAGES)
    plain = model.generate([prompt], max_new_tokens=6)[0]
    stops = set(model.tokenizer.eos_token_ids)
    # the greedy reply's first token, banned: the reply starts otherwise, here and over HTTP alike
    banned = model.generate([prompt], max_new_tokens=6, logit_bias={plain.tokens[0]: -100})[0]
    assert banned.tokens[0] != plain.tokens[0]
    reply = post(chat_server, logit_bias={str(plain.tokens[0]): -100}).json()
    assert reply["choices"][0]["message"]["content"] == banned.text
    # a token pushed by +100 is all the greedy reply says
    forced_token = next(t for t in range(10, model.config.vocab_size) if t not in stops and t != plain.tokens[0])
    forced = model.generate([prompt], max_new_tokens=6, logit_bias={forced_token: 100})[0]
    assert forced.tokens == [forced_token] * 6
    reply = post(chat_server, logit_bias={str(forced_token): 100}).json()
    assert reply["choices"][0]["message"]["content"] == forced.text
    # sampling obeys the ban too: every sampled first token avoids it
    sampled = post(chat_server, n=8, temperature=1.5, seed=3, max_tokens=1, logprobs=True,
                   logit_bias={str(plain.tokens[0]): -100}).json()
    first_token = model.tokenizer.decode([plain.tokens[0]])
    assert all(c["logprobs"]["content"][0]["token"] != first_token for c in sampled["choices"]
               if c["logprobs"]["content"])


@pytest.mark.parametrize("bias", [{"99999": 1}, {"-3": 1}, {"abc": 1}, {"²": 1}, {"5": 101}, {"5": -100.5},
                                  {str(i): 1 for i in range(301)}, {"9" * 5000: 1}])
def test_bad_logit_bias_is_refused(chat_server: LiveServer, bias: dict) -> None:
    assert_refused(post(chat_server, logit_bias=bias), "logit_bias", "invalid_value")
