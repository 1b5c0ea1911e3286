"""Malformed chat bodies: each is a 400 in OpenAI's shape, naming the parameter where one
applies, and the server goes on."""

from __future__ import annotations

import pytest

from .conftest import LiveServer

pytestmark = pytest.mark.slow

BAD_BODIES = [
    ({}, "model"),
    ({"model": "tiny"}, "messages"),
    ({"model": "tiny", "messages": []}, "messages"),
    ({"model": "tiny", "messages": "hello"}, "messages"),
    ({"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"model": "tiny", "messages": [{"role": "user", "content": 12}]}, None),
    ({"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image", "x": 1}]}]}, None),
    ({"model": "tiny", "messages": [{"role": "user", "content": [{"type": "file", "file": {}}]}]}, None),
    ({"model": 7, "messages": [{"role": "user", "content": "x"}]}, "model"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "n": 0}, "n"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "n": 1000}, "n"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "temperature": -1}, "temperature"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "temperature": 2.5}, "temperature"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "top_p": 0}, "top_p"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": "many"}, "max_tokens"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "stop": 5}, "stop"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
     "top_logprobs"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "seed": "x"}, "seed"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "stream": "maybe"}, "stream"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "cartridges": [5]}, None),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "cartridges": "abc"}, "cartridges"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 5000}, "messages"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "word " * 2000}]}, "messages"),
]


@pytest.mark.parametrize("body,param", BAD_BODIES, ids=[str(i) for i in range(len(BAD_BODIES))])
def test_bad_chat_bodies_are_400(chat_server: LiveServer, body: dict, param: str | None) -> None:
    response = chat_server.http().post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] and error["message"]
    if param is not None:
        assert error["param"] == param
    if "max_tokens" in body and body["max_tokens"] == 5000 or "word" in str(body):
        assert error["code"] == "context_length_exceeded"
