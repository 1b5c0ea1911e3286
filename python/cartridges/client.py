"""A Python client for what the OpenAI SDK does not cover: datablocks (docs/api.md §2).

    client = cartridges.Client("http://127.0.0.1:8000", api_key="sk-...")
    block = client.datablocks.train(training_files=[file.id], name="handbook", config={"num_samples": 64})
    block = client.datablocks.wait(block["id"])          # progress bar until it ends
    for b in client.datablocks.list(status="succeeded"):  # walks every page
        print(b["id"], b["bytes"])
    client.datablocks.delete(block["id"])

Files go through the OpenAI SDK (`openai.OpenAI(base_url=.../v1, api_key=...).files`).
Datablocks are returned as the server's JSON objects (dicts); errors raise `APIError` with
the server's `status`, `code` and `message`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import httpx

TERMINAL = ("succeeded", "failed", "cancelled")
# wait() rides out a server that cannot be reached or answers 502-504 for this long (a restart).
WAIT_RETRY_S = 120.0


class APIError(Exception):
    def __init__(self, status: int, code: str | None, message: str, param: str | None = None) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status = status
        self.code = code
        self.message = message
        self.param = param


class Client:
    def __init__(self, base_url: str, api_key: str, *, timeout: float = 60.0) -> None:
        """`base_url`: the server (`http://host:port`), with or without a `/v1` or `/api/v1` suffix."""
        base = base_url.rstrip("/")
        if not base.endswith("/v1"):  # also covers "/api/v1"
            base += "/v1"
        self._http = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {api_key}"}, timeout=timeout)
        self.datablocks = Datablocks(self)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def request(self, method: str, path: str, **kwargs: Any) -> Any:
        response = self._http.request(method, path, **kwargs)
        if response.status_code >= 400:
            try:
                error = response.json()["error"]
            except (ValueError, KeyError, TypeError):
                error = {"message": response.text, "code": None}
            raise APIError(response.status_code, error.get("code"), error.get("message", ""), error.get("param"))
        try:
            return response.json()
        except ValueError:  # another service at this address
            raise APIError(response.status_code, "invalid_response",
                           f"{response.request.url} answered without JSON: is it a cartridges server?") from None


class Datablocks:
    def __init__(self, client: Client) -> None:
        self._client = client

    def train(self, training_files: list[str] | str, *, name: str | None = None, model: str | None = None,
              config: dict[str, Any] | None = None, parts: bool | None = None,
              part_tokens: int | None = None) -> dict[str, Any]:
        """Queues training on the given processed files; returns the datablock (`queued`). With
        `parts`, the corpus is trained as a cartridge per part of about `part_tokens` tokens,
        served together by mixture; `parts=False`, as one cartridge; unset, in parts when it holds
        more than four of the model's contexts."""
        files = [training_files] if isinstance(training_files, str) else list(training_files)
        body: dict[str, Any] = {"training_files": files}
        for key, value in (("name", name), ("model", model), ("config", config), ("parts", parts),
                           ("part_tokens", part_tokens)):
            if value is not None:
                body[key] = value
        return self._client.request("POST", "/datablocks/train", json=body)

    def page(self, *, status: str | None = None, limit: int | None = None, order: str | None = None,
             after: str | None = None) -> dict[str, Any]:
        """One page: `{"data", "first_id", "last_id", "has_more"}`."""
        params = {k: v for k, v in (("status", status), ("limit", limit), ("order", order), ("after", after))
                  if v is not None}
        return self._client.request("GET", "/datablocks", params=params)

    def list(self, *, status: str | None = None, order: str | None = None,
             page_size: int = 100) -> Iterator[dict[str, Any]]:
        """Every datablock of the caller, walking the pages."""
        after = None
        while True:
            page = self.page(status=status, limit=page_size, order=order, after=after)
            yield from page["data"]
            if not page["has_more"]:
                return
            after = page["last_id"]

    def retrieve(self, datablock_id: str) -> dict[str, Any]:
        return self._client.request("GET", f"/datablocks/{_path(datablock_id)}")

    def delete(self, datablock_id: str) -> dict[str, Any]:
        """Cancels the job if it is queued or running and removes the datablock."""
        return self._client.request("DELETE", f"/datablocks/{_path(datablock_id)}")

    def wait(self, datablock_id: str, *, timeout: float | None = None, poll_interval: float = 1.0,
             progress: bool = True) -> dict[str, Any]:
        """Polls until the datablock ends (succeeded, failed or cancelled) and returns it; with
        `progress`, a bar per stage shows completed/total, the loss and the time left.
        TimeoutError after `timeout` seconds. A server out of reach, or answering 502-504, is
        asked again for up to WAIT_RETRY_S (a restart: its jobs resume)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        bar = _StageBar(progress)
        failing_since = None
        try:
            while True:
                try:
                    block = self.retrieve(datablock_id)
                    failing_since = None
                except (httpx.TransportError, APIError) as error:
                    # A server restarting (its jobs resume) or a network blip: keep waiting a while.
                    if isinstance(error, APIError) and error.status not in (502, 503, 504):
                        raise
                    failing_since = failing_since or time.monotonic()
                    if time.monotonic() - failing_since > WAIT_RETRY_S:
                        raise
                    time.sleep(poll_interval)
                    continue
                bar.show(block)
                if block["status"] in TERMINAL:
                    return block
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"datablock {datablock_id} is still {block['status']} after {timeout} s")
                time.sleep(poll_interval)
        finally:
            bar.close()


def _path(datablock_id: str) -> str:
    return quote(datablock_id, safe="/")


class _StageBar:
    """One tqdm bar per progress stage (compacting, synthesizing, training), updated from the datablock."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.stage: str | None = None
        self.bar: Any = None

    def show(self, block: dict[str, Any]) -> None:
        if not self.enabled:
            return
        from tqdm.auto import tqdm

        p = block["progress"]
        stage = p["stage"] if p.get("part") is None else f"part {p['part']} of {p['parts']}, {p['stage']}"
        if stage != self.stage:
            self.close()
            self.stage = stage
            self.bar = tqdm(total=p["total"] or None, desc=stage, disable=None)
        self.bar.total = p["total"] or None
        self.bar.n = p["completed"]
        postfix = {}
        if block["metrics"].get("loss") is not None:
            postfix["loss"] = f"{block['metrics']['loss']:.4f}"
        if p.get("eta_seconds") is not None:
            postfix["left"] = f"{p['eta_seconds']}s"
        self.bar.set_postfix(postfix, refresh=False)
        self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
