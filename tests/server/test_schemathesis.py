"""Property-based checks of the file endpoints against their own OpenAPI schema: no 5xx, and
every response conforms to what the schema documents (status codes, content types, bodies).

Hypothesis drives each operation directly (schemathesis' lazy pytest fixture loader does not
work with the pinned pytest), with a bounded number of examples per operation."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from tests.server.conftest import LiveServer

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


@pytest.fixture(scope="module")
def file_operations(server: LiveServer) -> dict[str, schemathesis.APIOperation]:
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json").include(path_regex=r"^/v1/files")
    operations = [result.ok() for result in schema.get_all_operations()]
    return {f"{op.method.upper()} {op.path}": op for op in operations}


def test_all_file_endpoints_are_covered(file_operations: dict[str, schemathesis.APIOperation]) -> None:
    assert sorted(file_operations) == [
        "DELETE /v1/files/{file_id}",
        "GET /v1/files",
        "GET /v1/files/{file_id}",
        "GET /v1/files/{file_id}/content",
        "POST /v1/files",
    ]


@pytest.mark.parametrize(
    "name",
    ["POST /v1/files", "GET /v1/files", "GET /v1/files/{file_id}", "DELETE /v1/files/{file_id}",
     "GET /v1/files/{file_id}/content"],
)
def test_file_endpoint_conforms(server: LiveServer, file_operations: dict, name: str) -> None:
    key = server.add_user()
    operation = file_operations[name]
    headers = {"Authorization": f"Bearer {key}"}

    @given(case=operation.as_strategy())
    @settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True, database=None)
    def check(case: schemathesis.Case) -> None:
        case.call_and_validate(base_url=server.url, headers=headers, checks=CHECKS, timeout=30)

    check()
    if "{file_id}" in operation.path:  # random ids never exist: validate the answer for a real one too
        existing = server.openai(key).files.create(file=("seed.txt", b"seed"), purpose="assistants").id
        case = operation.Case(path_parameters={"file_id": existing})
        response = case.call_and_validate(base_url=server.url, headers=headers, checks=CHECKS, timeout=30)
        assert response.status_code == 200
    assert server.alive()


@pytest.fixture(scope="module")
def datablock_operations(server: LiveServer) -> dict[str, schemathesis.APIOperation]:
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json").include(path_regex=r"^/v1/datablocks")
    operations = [result.ok() for result in schema.get_all_operations()]
    return {f"{op.method.upper()} {op.path}": op for op in operations}


@pytest.mark.parametrize(
    "name",
    ["POST /v1/datablocks/train", "GET /v1/datablocks", "GET /v1/datablocks/{datablock_id}",
     "DELETE /v1/datablocks/{datablock_id}", "GET /v1/datablocks/{datablock_id}/content"],
)
def test_datablock_endpoint_conforms(server: LiveServer, datablock_operations: dict, name: str) -> None:
    """Random bodies, queries and ids: 400/404 as documented, never a 5xx. (Random file ids
    never exist, so nothing is queued: training itself is tested in test_datablocks_*.)"""
    assert sorted(datablock_operations) == sorted(
        ["POST /v1/datablocks/train", "GET /v1/datablocks", "GET /v1/datablocks/{datablock_id}",
         "DELETE /v1/datablocks/{datablock_id}", "GET /v1/datablocks/{datablock_id}/content"])
    key = server.add_user()
    headers = {"Authorization": f"Bearer {key}"}

    @given(case=datablock_operations[name].as_strategy())
    @settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True, database=None)
    def check(case: schemathesis.Case) -> None:
        case.call_and_validate(base_url=server.url, headers=headers, checks=CHECKS, timeout=30)

    check()
    assert server.alive()


SERVING_OPERATIONS = ["POST /v1/chat/completions", "GET /v1/models", "GET /v1/models/{model_id}", "GET /v1/status",
                      "POST /preload", "GET /health", "GET /metrics"]


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir) -> Iterator[LiveServer]:
    """Chat on a tiny model: random valid bodies generate quickly."""
    live = LiveServer(tmp_path_factory.mktemp("schemathesis-chat") / "data", model=tiny_model_dir).start()
    try:
        yield live
    finally:
        live.stop()


@pytest.fixture(scope="module")
def serving_operations(tiny_server: LiveServer) -> dict[str, schemathesis.APIOperation]:
    schema = schemathesis.openapi.from_url(tiny_server.url + "/openapi.json").include(
        path_regex=r"^/(v1/(chat|models|status)|preload|health|metrics)")
    operations = [result.ok() for result in schema.get_all_operations()]
    return {f"{op.method.upper()} {op.path}": op for op in operations}


@pytest.mark.parametrize("name", SERVING_OPERATIONS)
def test_serving_endpoint_conforms(tiny_server: LiveServer, serving_operations: dict, name: str) -> None:
    """Random bodies and ids on chat, models, preload, health, status, metrics: documented
    answers, never a 5xx (the model being the tiny one, valid chats finish fast)."""
    assert sorted(serving_operations) == sorted(SERVING_OPERATIONS)
    key = tiny_server.add_user()
    headers = {"Authorization": f"Bearer {key}"}

    @given(case=serving_operations[name].as_strategy())
    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True, database=None)
    def check(case: schemathesis.Case) -> None:
        case.call_and_validate(base_url=tiny_server.url, headers=headers, checks=CHECKS, timeout=60)

    check()
    assert tiny_server.alive()
