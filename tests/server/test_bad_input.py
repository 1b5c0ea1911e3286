"""Bad input answers with the documented OpenAI-shaped errors, and the server keeps serving."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from tests.server.conftest import SMALL_LIMIT, LiveServer, make_pdf, multipart, wait_processed


@pytest.fixture(autouse=True)
def still_serving(server: LiveServer) -> Iterator[None]:
    yield
    assert server.alive()
    assert server.http().get("/v1/files", params={"limit": 1}).status_code == 200


def assert_error(response: httpx.Response, status: int, code: str | None, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code and error["message"]
    if param is not None:
        assert error["param"] == param
    assert "Traceback" not in error["message"]
    return error


def upload(server: LiveServer, key: str, name: str, content: bytes, purpose: str | None = "assistants") -> httpx.Response:
    data = {"purpose": purpose} if purpose is not None else {}
    return server.http(key).post("/v1/files", files={"file": (name, content)}, data=data)


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer sk-cart-wrong"},
        {"Authorization": "Bearer"},
        {"Authorization": "Basic dXNlcjpwYXNz"},
        {"Authorization": "Bearer two words"},
        {"Authorization": "sk-cart-test-default-key-0123456789"},
    ],
)
def test_authentication(server: LiveServer, headers: dict[str, str]) -> None:
    http = server.http(None)
    for method, path in [("GET", "/v1/files"), ("GET", "/api/v1/files/file-x"), ("DELETE", "/v1/files/file-x"),
                         ("GET", "/v1/files/file-x/content")]:
        error = assert_error(http.request(method, path, headers=headers), 401, "invalid_api_key")
        assert error["type"] == "authentication_error"
    response = http.post("/v1/files", headers=headers, files={"file": ("a.txt", b"x")}, data={"purpose": "assistants"})
    assert_error(response, 401, "invalid_api_key")


def test_revoked_key_is_refused(server: LiveServer) -> None:
    from cartridges.server.keys import hash_key
    from cartridges.store import open_store

    key = server.add_user()
    assert server.http(key).get("/v1/files").status_code == 200
    store = open_store(server.data_dir)
    try:
        user = store.user_for_key(hash_key(key))
        (info,) = [k for k in store.list_keys() if k.user_id == user.id]
        store.revoke_key(info.id)
    finally:
        store.close()
    assert_error(server.http(key).get("/v1/files"), 401, "invalid_api_key")


def test_purpose(server: LiveServer, user_key: str) -> None:
    assert_error(upload(server, user_key, "a.txt", b"x", None), 400, "missing_required_parameter", "purpose")
    assert_error(upload(server, user_key, "a.txt", b"x", "fine-tune"), 400, "invalid_purpose", "purpose")
    assert_error(upload(server, user_key, "a.txt", b"x", "p" * 5000), 400, "invalid_request")
    assert_error(server.http(user_key).get("/v1/files", params={"purpose": "batch"}), 400, "invalid_purpose", "purpose")
    assert_error(server.http(user_key).get("/v1/files", params={"limit": 10001}), 400, "invalid_value", "limit")
    assert_error(server.http(user_key).get("/v1/files", params={"order": "up"}), 400, "invalid_value", "order")
    assert server.http(user_key).get("/v1/files").json()["data"] == []


def test_file_part_problems(server: LiveServer, user_key: str) -> None:
    for name in ("a.exe", "a.txt.zip", "noext", "a.", ".."):
        assert_error(upload(server, user_key, name, b"x"), 400, "unsupported_file_type", "file")
    assert_error(upload(server, user_key, "a.TXT", b""), 400, "empty_file", "file")
    http = server.http(user_key)
    assert_error(http.post("/v1/files", data={"purpose": "assistants"}, files={"other": ("a.txt", b"x")}),
                 400, "missing_required_parameter", "file")
    assert_error(http.post("/v1/files", json={"purpose": "assistants"}), 400, "invalid_multipart")
    assert http.get("/v1/files").json()["data"] == []
    assert server.tmp_names() == []


def test_size_limit(server: LiveServer, user_key: str) -> None:
    ok = upload(server, user_key, "exact.txt", b"a" * SMALL_LIMIT)
    assert ok.status_code == 200 and ok.json()["bytes"] == SMALL_LIMIT
    error = assert_error(upload(server, user_key, "big.txt", b"a" * (SMALL_LIMIT + 1)), 413, "file_too_large", "file")
    assert error["type"] == "invalid_request_error"
    # Far over the limit, streamed: refused, nothing left behind.
    body, ctype = multipart([(b'name="purpose"', b"assistants"), (b'name="file"; filename="huge.txt"', b"b" * (8 * SMALL_LIMIT))])
    response = server.http(user_key).post("/v1/files", content=body, headers={"Content-Type": ctype})
    assert_error(response, 413, "file_too_large")
    assert [f["filename"] for f in server.http(user_key).get("/v1/files").json()["data"]] == ["exact.txt"]
    assert server.tmp_names() == []


def test_a_body_over_the_request_limit_is_refused_before_it_is_parsed(server: LiveServer, user_key: str) -> None:
    """FastAPI reads a JSON body whole before the key is checked: past the request limit it is
    refused, with or without a key, whether its length is declared or it streams in chunks."""
    json_type = {"Content-Type": "application/json"}
    big = json.dumps({"model": "x", "messages": [{"role": "user", "content": "a" * SMALL_LIMIT}]}).encode()
    for key in (None, user_key):
        error = assert_error(server.http(key).post("/v1/chat/completions", content=big, headers=json_type), 413,
                             "request_too_large")
        assert "POST /v1/files" in error["message"]

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        for _ in range(8):
            yield b"a" * (SMALL_LIMIT // 4)

    assert_error(server.http(user_key).post("/v1/datablocks/train", content=chunks(), headers=json_type), 413,
                 "request_too_large")
    # Within the limit the request is read and answered as usual.
    small = json.dumps({"model": "x", "messages": [{"role": "user", "content": "a" * (SMALL_LIMIT // 2)}]})
    assert server.http(user_key).post("/v1/chat/completions", content=small, headers=json_type).status_code == 404


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", '{"model": "\\ud800", "messages": [{"role": "user", "content": "hi"}]}', "model"),
        ("/v1/chat/completions", '{"model": "m", "messages": [{"role": "user", "content": "a \\udfff b"}]}',
         "messages[0].content"),
        ("/v1/chat/completions", '{"model": "m", "messages": [{"role": "user", "content": "hi"}], "stop": ["\\ud83d"]}',
         "stop[0]"),
        ("/v1/chat/completions", '{"model": "m", "messages": [], "metadata": {"\\ud800": "x"}}', "metadata"),
        ("/v1/datablocks/train", '{"training_files": ["file-a", "\\udc00"]}', "training_files[1]"),
        ("/preload", '["\\ud800"]', "[0]"),
    ],
)
def test_a_lone_surrogate_is_refused_naming_where(server: LiveServer, user_key: str, path: str, body: str,
                                                   param: str) -> None:
    """Valid JSON, not text: no UTF-8 encodes it, so it would fail inside the tokenizer or the
    store (a 500) if it got that far. A pair that makes one character is text."""
    response = server.http(user_key).post(path, content=body, headers={"Content-Type": "application/json"})
    assert_error(response, 400, "invalid_value", param)
    paired = body.replace("\\ud800", "\\ud83d\\ude00").replace("\\udfff", "\\ud83d\\ude00")
    if paired != body:  # the same request with a whole character gets past the check
        again = server.http(user_key).post(path, content=paired, headers={"Content-Type": "application/json"})
        assert again.json().get("error", {}).get("code") != "invalid_value" or again.json()["error"]["param"] != param


@pytest.mark.parametrize("body", [b'{"n": ' + b"9" * 5000 + b"}", b"[" * 100_000 + b"]" * 100_000])
def test_json_past_the_parsers_limits_is_invalid_json(server: LiveServer, user_key: str, body: bytes) -> None:
    response = server.http(user_key).post("/v1/chat/completions", content=body,
                                          headers={"Content-Type": "application/json"})
    assert_error(response, 400, "invalid_json")


@pytest.mark.parametrize(
    ("body", "ctype"),
    [
        (b"--b\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.txt\"\r\n\r\nabc", "multipart/form-data; boundary=b"),
        (b"garbage without boundary", "multipart/form-data; boundary=b"),
        (b"--b\r\nno headers here\r\n\r\n", "multipart/form-data; boundary=b"),
        (b"x", "multipart/form-data"),
        (b"x", "text/plain"),
        (b"", "multipart/form-data; boundary=b"),
    ],
)
def test_malformed_multipart(server: LiveServer, user_key: str, body: bytes, ctype: str) -> None:
    response = server.http(user_key).post("/v1/files", content=body, headers={"Content-Type": ctype})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] in ("invalid_multipart", "missing_required_parameter")
    assert server.tmp_names() == []


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (b"../../etc/passwd.txt", "passwd.txt"),
        (b"..\\..\\windows\\notes.md", "notes.md"),
        (b"a\x00b.txt", "ab.txt"),
        (b"tab\there\x1b[31m.csv", "tabhere[31m.csv"),
        (b"/abs/path/", None),
        ("r\u00e9sum\u00e9\u202e.txt".encode(), "r\u00e9sum\u00e9.txt"),
        (b"x" * 996 + b".txt", "x" * 251 + ".txt"),
    ],
)
def test_unsafe_filenames(server: LiveServer, user_key: str, raw: bytes, expected: str | None) -> None:
    body, ctype = multipart([(b'name="purpose"', b"assistants"), (b'name="file"; filename="' + raw + b'"', b"data")])
    response = server.http(user_key).post("/v1/files", content=body, headers={"Content-Type": ctype})
    if expected is None:
        assert_error(response, 400, "unsupported_file_type")
        return
    assert response.status_code == 200, response.text
    name = response.json()["filename"]
    assert name == expected
    assert len(name.encode()) <= 255
    download = server.http(user_key).get(f"/v1/files/{response.json()['id']}/content")
    assert download.content == b"data"
    assert "\n" not in download.headers["content-disposition"]


@pytest.mark.parametrize(
    ("name", "content", "reason"),
    [
        ("bad.txt", b"ok so far \xff\xfe broken", "not valid UTF-8"),
        ("bad.md", "caf\u00e9".encode()[:-1], "not valid UTF-8"),
        ("bad.json", b'{"a": 1,', "invalid JSON"),
        ("bad.jsonl", b'{"a": 1}\n{"b": \n', "line 2"),
        ("bad.csv", b'a,b\n"unterminated,1\n', "invalid CSV"),
        ("ragged.csv", b"a,b\n1,2,3\n", "invalid CSV"),
        ("bad.pdf", b"%PDF-1.4\nthis is not really a pdf", "PDF"),
        ("truncated.pdf", make_pdf("cut short")[:120], "PDF"),
        ("latin1.json", '{"a": "caf\u00e9"}'.encode("latin-1"), "not valid UTF-8"),
        # What Python's own parser refuses beyond syntax: the file fails, it never stays pending.
        ("huge_number.json", b'{"n": ' + b"9" * 5000 + b"}", "unsupported JSON"),
        ("deep.json", b"[" * 200_000 + b"]" * 200_000, "unsupported JSON: nested too deeply"),
        ("deep.jsonl", b'{"ok": 1}\n' + b"[" * 200_000 + b"]" * 200_000 + b"\n", "line 2"),
    ],
)
def test_unreadable_content_ends_in_error(server: LiveServer, user_key: str, name: str, content: bytes, reason: str) -> None:
    response = upload(server, user_key, name, content)
    assert response.status_code == 200 and response.json()["status"] == "uploaded"
    body = wait_processed(server.http(user_key), response.json()["id"])
    assert body["status"] == "error"
    assert reason in body["status_details"]
    # The upload itself is kept and downloadable as sent.
    assert server.http(user_key).get(f"/v1/files/{body['id']}/content").content == content


def test_unknown_routes_and_methods_are_openai_shaped(server: LiveServer, user_key: str) -> None:
    http = server.http(user_key)
    assert_error(http.get("/v1/nothing-here"), 404, "not_found")
    assert_error(http.put("/v1/files"), 405, "method_not_allowed")
