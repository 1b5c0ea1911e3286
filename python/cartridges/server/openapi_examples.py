"""Examples on the OpenAPI page (`/docs`): a request example for every operation that takes a
body, and a response example for every documented status, added to the schema in one place.
tests/server/test_openapi_page.py checks each against its schema, and the untyped ones against
what a live server answers."""

from __future__ import annotations

import copy
from typing import Any

from cartridges.server.errors import ERROR_TYPES

_FILE_ID = "file-3hQxV0c8mZpL2rYt9KaWn4Ub"
_BLOCK_ID = "alice/handbook/k3v9x2m1q8ab"
_MODEL = "SmolLM2-135M-Instruct.Q4_1"

FILE = {"id": _FILE_ID, "object": "file", "bytes": 48213, "created_at": 1767225600, "filename": "handbook.pdf",
        "purpose": "cartridge-training", "status": "processed", "status_details": None}
DATABLOCK = {
    "id": _BLOCK_ID, "object": "datablock", "run_id": "k3v9x2m1q8ab", "project": "handbook", "owner": "alice",
    "model": _MODEL, "status": "running", "training_files": [_FILE_ID],
    "config": {"num_tokens": 304, "num_samples": 256, "learning_rate": 0.02, "epochs": 2},
    "created_at": 1767225600, "started_at": 1767225603, "finished_at": None, "updated_at": 1767225698,
    "progress": {"stage": "training", "completed": 40, "total": 128, "eta_seconds": 95},
    "metrics": {"loss": 0.83, "synthetic_samples": 256, "train_tokens": None, "quality": None, "signal_by_part": None},
    "num_tokens": 304, "bytes": None, "error": None, "imported_from": None,
}
LOADED_CARTRIDGE = {"id": _BLOCK_ID, "object": "model", "created": 1767226000, "owned_by": "alice",
                    "parent": _MODEL, "num_tokens": 304}
CHAT_COMPLETION = {
    "id": "chatcmpl-5f0c8d2e9b7a4c1d8e3f6a2b9c0d1e4f", "object": "chat.completion", "created": 1767226100,
    "model": _BLOCK_ID, "system_fingerprint": None,
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "The harbor master, at dawn.",
                                         "refusal": None},
                 "logprobs": None, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 321, "completion_tokens": 8, "total_tokens": 329,
              "prompt_tokens_details": {"cached_tokens": 304}, "completion_tokens_details": None},
}
CHAT_STREAM = (
    'data: {"id":"chatcmpl-5f0c","object":"chat.completion.chunk","created":1767226100,"model":"' + _BLOCK_ID
    + '","system_fingerprint":null,"choices":[{"index":0,"delta":{"role":"assistant","content":""},'
    '"logprobs":null,"finish_reason":null}]}\n\n'
    'data: {"id":"chatcmpl-5f0c","object":"chat.completion.chunk","created":1767226100,"model":"' + _BLOCK_ID
    + '","system_fingerprint":null,"choices":[{"index":0,"delta":{"content":"The harbor master"},'
    '"logprobs":null,"finish_reason":null}]}\n\n'
    'data: {"id":"chatcmpl-5f0c","object":"chat.completion.chunk","created":1767226100,"model":"' + _BLOCK_ID
    + '","system_fingerprint":null,"choices":[{"index":0,"delta":{},"logprobs":null,"finish_reason":"stop"}]}\n\n'
    "data: [DONE]\n\n"
)
STATUS = {
    "status": "ok", "version": "0.1.0", "device": "cpu", "model": _MODEL, "uptime_s": 3600,
    "cartridges": {"loaded": 1, "bytes": 14008320, "budget_bytes": 1073741824},
    "training_jobs": {"queued": 0, "running": 1, "max_jobs": 1, "worker_threads": 1},
    "engine": {"kv_tokens": 65536, "kv_tokens_used": 512, "running_requests": 1, "waiting_requests": 0,
               "threads": 1, "serve_threads_setting": None, "cpu_cores": 2, "default_max_tokens": 1024},
}

# Request bodies: named examples (a dropdown on the page).
REQUESTS: dict[tuple[str, str], dict[str, dict[str, Any]]] = {
    ("post", "/v1/chat/completions"): {
        "cartridge": {"summary": "A cartridge as the model", "value": {
            "model": _BLOCK_ID, "messages": [{"role": "user", "content": "Who rings the bell at dawn?"}],
            "max_tokens": 64, "temperature": 0}},
        "composed": {"summary": "Two cartridges composed, streamed", "value": {
            "model": _MODEL, "cartridges": [_BLOCK_ID, "alice/ferries/p0d7w2n5c1xy"], "composition": "mixture",
            "messages": [{"role": "system", "content": "Answer from the documents."},
                         {"role": "user", "content": "When does the ferry leave?"}],
            "stream": True, "stream_options": {"include_usage": True}}},
        "sampling": {"summary": "Several sampled choices, log-probabilities, a banned token", "value": {
            "model": _BLOCK_ID, "messages": [{"role": "user", "content": "Name the oldest bell."}],
            "n": 3, "temperature": 0.8, "top_p": 0.95, "seed": 7, "stop": ["\n\n"], "logprobs": True,
            "top_logprobs": 2, "logit_bias": {"2": -100}}},
    },
    ("post", "/v1/datablocks/train"): {
        "defaults": {"summary": "Train with the defaults", "value": {"training_files": [_FILE_ID],
                                                                      "name": "handbook"}},
        "config": {"summary": "Train with some config fields set", "value": {
            "training_files": [_FILE_ID], "name": "handbook",
            "config": {"num_tokens": 1024, "epochs": 1, "learning_rate": 0.02, "seed": 3}}},
    },
    ("post", "/preload"): {"ids": {"summary": "Load two cartridges", "value": [_BLOCK_ID, "p0d7w2n5c1xy"]}},
    ("post", "/v1/files"): {"upload": {"summary": "A PDF to train on", "value": {
        "file": "(the file's bytes)", "purpose": "cartridge-training"}}},
}

# Successful answers, by (method, path) and status; media type application/json unless given.
RESPONSES: dict[tuple[str, str], dict[str, Any]] = {
    ("post", "/v1/chat/completions"): {"200": {"application/json": CHAT_COMPLETION, "text/event-stream": CHAT_STREAM}},
    ("get", "/v1/models"): {"200": {"object": "list", "data": [LOADED_CARTRIDGE]}},
    ("get", "/v1/models/{model_id}"): {"200": LOADED_CARTRIDGE},
    ("get", "/v1/status"): {"200": STATUS},
    ("post", "/v1/files"): {"200": {**FILE, "status": "uploaded"}},
    ("get", "/v1/files"): {"200": {"object": "list", "data": [FILE], "first_id": _FILE_ID, "last_id": _FILE_ID,
                                   "has_more": False}},
    ("get", "/v1/files/{file_id}"): {"200": FILE},
    ("delete", "/v1/files/{file_id}"): {"200": {"id": _FILE_ID, "object": "file", "deleted": True}},
    ("get", "/v1/files/{file_id}/content"): {"200": {"application/octet-stream": "(the bytes uploaded)"},
                                             "206": {"application/octet-stream": "(the bytes of the range)"}},
    ("post", "/v1/datablocks/train"): {"200": {**DATABLOCK, "status": "queued", "started_at": None,
                                               "progress": {"stage": "queued", "completed": 0, "total": 0,
                                                            "eta_seconds": None},
                                               "metrics": {"loss": None, "synthetic_samples": None,
                                                           "train_tokens": None, "quality": None,
                                                           "signal_by_part": None}}},
    ("get", "/v1/datablocks"): {"200": {"object": "list", "data": [DATABLOCK], "first_id": _BLOCK_ID,
                                        "last_id": _BLOCK_ID, "has_more": False}},
    ("get", "/v1/datablocks/{datablock_id}"): {"200": DATABLOCK},
    ("get", "/v1/datablocks/{datablock_id}/content"): {"200": {"application/octet-stream": "(the cartridge file)",
                                                               "application/zip": "(a zip of the PEFT adapter)"}},
    ("delete", "/v1/datablocks/{datablock_id}"): {"200": {"id": _BLOCK_ID, "object": "datablock", "deleted": True}},
    ("post", "/preload"): {"200": {_BLOCK_ID: "loaded", "p0d7w2n5c1xy": "error: No cartridge 'p0d7w2n5c1xy'."}},
    ("get", "/health"): {"200": {"status": "healthy", "device": "cpu", "loaded_cartridges": [_BLOCK_ID]},
                         "503": {"status": "unhealthy", "device": "cpu", "loaded_cartridges": []}},
    ("get", "/metrics"): {"200": {"text/plain": "# HELP cartridges_http_requests_total HTTP requests.\n"
                                                "cartridges_http_requests_total{route=\"/v1/chat/completions\","
                                                "status=\"200\"} 12.0\n"}},
}

# One error example per status: what a client most often meets there (message, param, code);
# the type follows from the status, as in every error answer.
_ERRORS: dict[int, tuple[str, str | None, str]] = {
    400: ("Invalid value for 'temperature': Input should be less than or equal to 2.", "temperature", "invalid_value"),
    401: ("Incorrect API key provided.", None, "invalid_api_key"),
    404: ("No cartridge 'alice/handbook/k3v9x2m1q8zz'.", "model", "model_not_found"),
    405: ("Method not allowed.", None, "method_not_allowed"),
    409: ("Cartridge 'alice/handbook/k3v9x2m1q8ab' is not trained yet (status: running).", "model",
          "cartridge_not_ready"),
    413: ("File too large: the limit is 536870912 bytes.", "file", "file_too_large"),
    416: ("The requested range is outside the file (48213 bytes).", None, "range_not_satisfiable"),
    429: ("The server has too many requests waiting; retry shortly.", None, "rate_limited"),
    500: ("Internal server error.", None, "internal_error"),
    503: ("The model is still loading; retry in a few seconds.", None, "unavailable"),
}
ERRORS = {status: {"message": message, "type": ERROR_TYPES[status], "param": param, "code": code}
          for status, (message, param, code) in _ERRORS.items()}


def add_examples(schema: dict[str, Any]) -> dict[str, Any]:
    """Puts the examples above into an OpenAPI document, under `/v1/...` and `/api/v1/...` alike."""
    for path, operations in schema.get("paths", {}).items():
        key_path = path.removeprefix("/api")
        for method, operation in operations.items():
            if not isinstance(operation, dict):
                continue
            named = REQUESTS.get((method, key_path))
            body = operation.get("requestBody", {}).get("content", {})
            if named:
                for media in body.values():
                    media["examples"] = copy.deepcopy(named)
            answers = RESPONSES.get((method, key_path), {})
            for status, response in operation.get("responses", {}).items():
                content = response.get("content")
                if content is None:  # no body (a 416's)
                    continue
                example = answers.get(status)
                if example is None and status.isdigit() and int(status) in ERRORS and int(status) >= 400:
                    example = {"error": ERRORS[int(status)]}
                if example is None:
                    continue
                by_media = example if _is_by_media(example) else {"application/json": example}
                for media_type, value in by_media.items():
                    content.setdefault(media_type, {})["example"] = copy.deepcopy(value)
    return schema


# An example given per media type is a dict keyed by these; any other example is JSON.
_MEDIA_TYPES = {"application/json", "text/event-stream", "application/octet-stream", "application/zip", "text/plain"}


def _is_by_media(example: Any) -> bool:
    return isinstance(example, dict) and bool(example) and set(example) <= _MEDIA_TYPES
