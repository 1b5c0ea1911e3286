"""The OpenAPI page reads well (docs/api.md): every operation has a summary, a description, an
example of its request body and of each response with a body; every example is valid against
its own schema, and the untyped answers' examples have the shape a live server answers with."""

from __future__ import annotations

import jsonschema
import pytest

from cartridges.server.app import create_app
from cartridges.server.openapi_examples import CHAT_COMPLETION, STATUS

from .conftest import LiveServer

MESSAGES = [{"role": "user", "content": "Who rings the bell?"}]


@pytest.fixture(scope="module")
def schema() -> dict:
    return create_app().openapi()


def operations(schema: dict):
    for path, methods in schema["paths"].items():
        for method, operation in methods.items():
            yield f"{method.upper()} {path}", operation


def valid(instance: object, media_schema: dict, components: dict) -> None:
    jsonschema.Draft202012Validator({**media_schema, "components": components}).validate(instance)


def test_every_operation_has_summary_description_and_examples(schema: dict) -> None:
    missing = []
    for name, operation in operations(schema):
        if not operation.get("summary") or len(operation.get("description", "")) < 40:
            missing.append(f"{name}: summary or description")
        for media_type, media in operation.get("requestBody", {}).get("content", {}).items():
            if not media.get("examples"):
                missing.append(f"{name}: request example ({media_type})")
        for status, response in operation["responses"].items():
            if not response.get("description"):
                missing.append(f"{name} {status}: description")
            content = response.get("content")
            if content and not any("example" in media or "examples" in media for media in content.values()):
                missing.append(f"{name} {status}: response example")
    assert not missing, missing


def test_every_example_fits_its_schema(schema: dict) -> None:
    components = schema["components"]
    checked = 0
    for name, operation in operations(schema):
        for media in operation.get("requestBody", {}).get("content", {}).values():
            for example in media.get("examples", {}).values():
                valid(example["value"], media["schema"], components)
                checked += 1
        for status, response in operation["responses"].items():
            for media_type, media in (response.get("content") or {}).items():
                if "example" in media and "schema" in media and media_type == "application/json":
                    valid(media["example"], media["schema"], components)
                    checked += 1
    assert checked > 50


def test_chat_examples_cover_the_cartridge_fields(schema: dict) -> None:
    body = schema["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]
    fields = {key for example in body["examples"].values() for key in example["value"]}
    assert {"cartridges", "composition", "stream", "stream_options", "n", "logprobs", "logit_bias"} <= fields
    train = schema["paths"]["/v1/datablocks/train"]["post"]["requestBody"]["content"]["application/json"]
    assert any("config" in example["value"] for example in train["examples"].values())


def shape(value: object) -> object:
    """Keys all the way down (lists by their first item); values do not count."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [shape(value[0])] if value else []
    return None


@pytest.mark.slow
def test_untyped_examples_have_the_live_answers_shape(chat_server: LiveServer) -> None:
    http = chat_server.http()
    chat = http.post("/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES, "max_tokens": 3}).json()
    assert shape(chat) == shape(CHAT_COMPLETION)
    status = http.get("/v1/status").json()
    assert shape(status) == shape(STATUS)
