"""The file endpoints through the official openai client, against a live server."""

from __future__ import annotations

import json

import openai
import pytest

from tests.server.conftest import LiveServer, make_pdf, wait_processed

SAMPLES = {
    "notes.txt": (b"Cartridges are trained KV caches.\n", "text/plain; charset=utf-8"),
    "README.MD": ("# Title\n\nUnicode: \u00e9t\u00e9 \u2713\n".encode(), "text/markdown; charset=utf-8"),
    "data.json": (json.dumps({"name": "cartridge", "tokens": [1, 2, 3]}).encode(), "application/json"),
    "rows.jsonl": (b'{"q": "a?", "a": "b"}\n\n{"q": "c?", "a": "d"}\n', "application/jsonl"),
    "table.csv": (b"name,value\nalpha,1\nbeta,\"two, quoted\"\n", "text/csv; charset=utf-8"),
    "paper.pdf": (make_pdf("Hello cartridges from a PDF"), "application/pdf"),
}


@pytest.mark.parametrize("prefix", ["/v1", "/api/v1"])
def test_six_types_round_trip(server: LiveServer, user_key: str, prefix: str) -> None:
    client = server.openai(user_key, prefix)
    http = server.http(user_key)
    for name, (content, media_type) in SAMPLES.items():
        created = client.files.create(file=(name, content), purpose="cartridge-training")
        assert created.id.startswith("file-") and len(created.id) >= 29
        assert created.id[5:].isalnum()
        assert (created.object, created.bytes, created.filename) == ("file", len(content), name)
        assert created.purpose == "cartridge-training"
        assert created.status == "uploaded" and created.status_details is None

        body = wait_processed(http, created.id)
        assert (body["status"], body["status_details"]) == ("processed", None), name
        retrieved = client.files.retrieve(created.id)
        assert retrieved.id == created.id and retrieved.status == "processed"
        assert retrieved.created_at == created.created_at

        assert client.files.content(created.id).content == content
        raw = http.get(f"{prefix}/files/{created.id}/content")
        assert raw.headers["content-type"] == media_type
        assert raw.headers["content-disposition"].startswith(f'attachment; filename="{name}"')

        deleted = client.files.delete(created.id)
        assert (deleted.id, deleted.deleted) == (created.id, True)
        with pytest.raises(openai.NotFoundError) as info:
            client.files.retrieve(created.id)
        assert info.value.code == "not_found"
        assert http.get(f"{prefix}/files/{created.id}/content").status_code == 404


def test_list_pagination_and_purpose_filter(server: LiveServer, user_key: str) -> None:
    client = server.openai(user_key)
    training = [client.files.create(file=(f"t{i}.txt", b"x" * (i + 1)), purpose="cartridge-training").id for i in range(5)]
    assistants = [client.files.create(file=(f"a{i}.md", b"y"), purpose="assistants").id for i in range(2)]

    first = client.files.list(limit=2)
    assert len(first.data) == 2 and first.has_more
    walked = [f.id for f in client.files.list(limit=2)]  # auto-pagination over 4 pages
    assert walked == (training + assistants)[::-1]  # newest first
    assert [f.id for f in client.files.list(limit=3, order="asc")] == training + assistants
    assert [f.id for f in client.files.list(purpose="assistants", limit=1)] == assistants[::-1]
    assert sorted(f.id for f in client.files.list(purpose="cartridge-training")) == sorted(training)

    raw = server.http(user_key).get("/api/v1/files", params={"limit": 3}).json()
    assert raw["object"] == "list" and raw["has_more"] is True
    assert raw["first_id"] == raw["data"][0]["id"] and raw["last_id"] == raw["data"][-1]["id"]
    assert set(raw["data"][0]) == {"id", "object", "bytes", "created_at", "filename", "purpose"}

    empty = server.http(server.add_user()).get("/v1/files").json()
    assert empty == {"object": "list", "data": [], "first_id": None, "last_id": None, "has_more": False}


def test_range_requests(server: LiveServer, user_key: str) -> None:
    http = server.http(user_key)
    content = bytes(range(256)) * 8
    file_id = server.openai(user_key).files.create(file=("bytes.txt", content), purpose="assistants").id
    part = http.get(f"/v1/files/{file_id}/content", headers={"Range": "bytes=10-19"})
    assert part.status_code == 206
    assert part.content == content[10:20]
    assert part.headers["content-range"] == f"bytes 10-19/{len(content)}"
    tail = http.get(f"/v1/files/{file_id}/content", headers={"Range": "bytes=-5"})
    assert tail.status_code == 206 and tail.content == content[-5:]
    outside = http.get(f"/v1/files/{file_id}/content", headers={"Range": f"bytes={len(content) + 10}-"})
    assert outside.status_code == 416 and outside.headers["content-range"] == f"bytes */{len(content)}"
    assert outside.json()["error"]["code"] == "range_not_satisfiable"
    for malformed in ("bytes", "items=0-3", "bytes=5-2"):
        refused = http.get(f"/v1/files/{file_id}/content", headers={"Range": malformed})
        assert refused.status_code == 400, malformed
        assert refused.json()["error"] | {"message": ""} == {"message": "", "type": "invalid_request_error",
                                                             "param": "Range", "code": "invalid_range"}
    # a Range that If-Range rules out is ignored, as HTTP says: the whole file
    whole = http.get(f"/v1/files/{file_id}/content", headers={"Range": "bytes=0-3", "If-Range": '"stale"'})
    assert whole.status_code == 200 and whole.content == content


def test_admin_key_acts_on_any_users_files(server: LiveServer, user_key: str) -> None:
    from tests.server.conftest import ADMIN_KEY

    file_id = server.openai(user_key).files.create(file=("mine.txt", b"mine"), purpose="assistants").id
    admin = server.openai(ADMIN_KEY)
    assert admin.files.retrieve(file_id).id == file_id
    assert file_id in {f.id for f in admin.files.list()}
    admin.files.delete(file_id)
    with pytest.raises(openai.NotFoundError):
        server.openai(user_key).files.retrieve(file_id)


def test_openapi_documents_every_file_endpoint(server: LiveServer) -> None:
    schema = server.http(None).get("/openapi.json").json()
    for prefix in ("/v1", "/api/v1"):
        assert set(schema["paths"][f"{prefix}/files"]) == {"get", "post"}
        assert set(schema["paths"][f"{prefix}/files/{{file_id}}"]) == {"get", "delete"}
        assert set(schema["paths"][f"{prefix}/files/{{file_id}}/content"]) == {"get"}
        for operation in [*schema["paths"][f"{prefix}/files"].values(), schema["paths"][f"{prefix}/files/{{file_id}}"]["get"]]:
            assert "422" not in operation["responses"]
            assert "401" in operation["responses"]
    upload = schema["paths"]["/v1/files"]["post"]
    body = upload["requestBody"]["content"]["multipart/form-data"]["schema"]
    assert body["required"] == ["file", "purpose"]
    assert "413" in upload["responses"]
    assert "ErrorResponse" in schema["components"]["schemas"]
    assert server.http(None).get("/docs").status_code == 200
