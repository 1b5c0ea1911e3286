"""Two users: B acting on A's file gets exactly what a missing id gets; lists never mix."""

from __future__ import annotations

from tests.server.conftest import LiveServer

MISSING = "file-" + "Z" * 24


def test_foreign_file_is_indistinguishable_from_missing(server: LiveServer) -> None:
    alice, bob = server.add_user(), server.add_user()
    a_id = server.openai(alice).files.create(file=("secret.txt", b"alice only"), purpose="assistants").id
    b = server.http(bob)
    b_own = server.openai(bob).files.create(file=("bob.txt", b"bob"), purpose="assistants").id

    def same(method: str, path: str, **kwargs: object) -> None:
        foreign = b.request(method, path.format(id=a_id), **kwargs)  # type: ignore[arg-type]
        missing = b.request(method, path.format(id=MISSING), **kwargs)  # type: ignore[arg-type]
        assert foreign.status_code == missing.status_code == 404, (method, path)
        assert foreign.text.replace(a_id, MISSING) == missing.text, (method, path)
        assert foreign.json()["error"]["code"] == "not_found"
        assert {k for k in foreign.headers if k not in ("date", "content-length")} == {
            k for k in missing.headers if k not in ("date", "content-length")
        }

    for prefix in ("/v1", "/api/v1"):
        same("GET", prefix + "/files/{id}")
        same("GET", prefix + "/files/{id}/content")
        same("GET", prefix + "/files/{id}/content", headers={"Range": "bytes=0-1"})
        same("DELETE", prefix + "/files/{id}")
        same("GET", prefix + "/files?after={id}")

    listed = [f["id"] for f in b.get("/v1/files").json()["data"]]
    assert listed == [b_own]
    assert a_id not in [f.id for f in server.openai(bob).files.list(limit=1)]
    # A's file survived B's attempts.
    assert server.openai(alice).files.content(a_id).content == b"alice only"
    assert [f.id for f in server.openai(alice).files.list()] == [a_id]
