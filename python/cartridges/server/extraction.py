"""Background text extraction: a stored file becomes `processed` (its text stored for
training and chat) or `error` (with a reason). One worker thread, in upload order."""

from __future__ import annotations

import asyncio
import codecs
import csv
import io
import json
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from cartridges.server.uploads import file_extension

log = logging.getLogger("cartridges.server")

READ_CHUNK = 1 << 20
# A file whose extraction found the store unavailable is tried again after this long.
RETRY_UNAVAILABLE_S = 5.0


class ExtractionError(Exception):
    """The file cannot be read; the message is the `status_details` users see."""


def extract_text(path: str, filename: str) -> str | None:
    """The text of a stored file, or None when the content itself is the text (.txt, .md)."""
    ext = file_extension(filename)
    if ext in (".txt", ".md"):
        _check_utf8(path)
        return None
    if ext == ".pdf":
        return _pdf_text(path)
    with open(path, "rb") as f:
        text = _decode(f.read())
    if ext == ".json":
        return _json_text(text)
    if ext == ".jsonl":
        return _jsonl_text(text)
    if ext == ".csv":
        return _csv_text(text)
    raise ExtractionError(f"unsupported file type '{ext}'")


def _utf8_error(offset: int) -> ExtractionError:
    return ExtractionError(f"not valid UTF-8: invalid byte sequence at byte offset {offset}")


def _check_utf8(path: str) -> None:
    """Decodes in chunks, so that memory stays flat whatever the size."""
    decoder = codecs.getincrementaldecoder("utf-8")("strict")
    offset = 0
    with open(path, "rb") as f:
        while chunk := f.read(READ_CHUNK):
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as exc:
                raise _utf8_error(offset + exc.start - len(decoder.getstate()[0])) from None
            offset += len(chunk)
        try:
            decoder.decode(b"", final=True)
        except UnicodeDecodeError as exc:
            raise _utf8_error(offset - len(exc.object) + exc.start) from None


def _decode(data: bytes) -> str:
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise _utf8_error(exc.start) from None


def _json_text(text: str) -> str:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ExtractionError(f"invalid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except (ValueError, RecursionError) as exc:  # an integer of thousands of digits, nesting too deep
        raise ExtractionError(f"unsupported JSON: {_parser_limit(exc)}") from None
    return json.dumps(value, indent=2, ensure_ascii=False)


def _parser_limit(exc: Exception) -> str:
    return "nested too deeply" if isinstance(exc, RecursionError) else str(exc)


def _jsonl_text(text: str) -> str:
    records = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            records.append(json.dumps(json.loads(line), ensure_ascii=False))
        except json.JSONDecodeError as exc:
            raise ExtractionError(f"invalid JSON on line {number}: {exc.msg} at column {exc.colno}") from None
        except (ValueError, RecursionError) as exc:
            raise ExtractionError(f"unsupported JSON on line {number}: {_parser_limit(exc)}") from None
    if not records:
        raise ExtractionError("JSONL file has no records")
    return "\n".join(records)


def _csv_text(text: str) -> str:
    """One line per record: `column: value | column: value`."""
    try:
        rows = [row for row in csv.reader(io.StringIO(text, newline=""), strict=True) if row]
    except csv.Error as exc:
        raise ExtractionError(f"invalid CSV: {exc}") from None
    if not rows:
        raise ExtractionError("CSV file has no rows")
    header, records = rows[0], rows[1:]
    lines = [" | ".join(header)] if not records else []
    for number, row in enumerate(records, start=2):
        if len(row) != len(header):
            raise ExtractionError(f"invalid CSV: record {number} has {len(row)} fields, the header has {len(header)}")
        lines.append(" | ".join(f"{name}: {value}" for name, value in zip(header, row)))
    return "\n".join(lines)


def _pdf_text(path: str) -> str:
    import pypdf

    try:
        reader = pypdf.PdfReader(path)
        if reader.is_encrypted and not reader.decrypt(""):
            raise ExtractionError("PDF is encrypted")
        pages = [page.extract_text() or "" for page in reader.pages]
    except ExtractionError:
        raise
    except Exception as exc:  # pypdf raises many types on damaged files
        raise ExtractionError(f"could not read PDF: {exc}") from None
    text = "\n\n".join(p.strip() for p in pages).strip()
    if not text:
        raise ExtractionError("PDF has no extractable text")
    return text


class Extractor:
    """Processes files with status `uploaded`, one at a time, in a dedicated thread."""

    def __init__(self, store: Any, admin_owner: Any) -> None:
        self._store = store
        self._owner = admin_owner  # internal: sees every user's files
        self._queue: asyncio.Queue[str] = asyncio.Queue()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="extract")
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        # Files left `uploaded` by a previous run (stopped or crashed) are processed again.
        after = None
        while True:
            page = self._store.list_files(self._owner, status="uploaded", after=after, descending=False)
            for record in page.data:
                self.submit(record.id)
            if not page.has_more:
                break
            after = page.data[-1].id
        self._task = asyncio.create_task(self._run())

    def submit(self, file_id: str) -> None:
        self._queue.put_nowait(file_id)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        self._executor.shutdown(wait=True, cancel_futures=True)

    async def _run(self) -> None:
        from cartridges.store import core

        loop = asyncio.get_running_loop()
        while True:
            file_id = await self._queue.get()
            try:
                await loop.run_in_executor(self._executor, self.process, file_id)
            except core().UnavailableError as exc:  # the database or blob store away: try again later
                log.warning("text extraction of %s waits for the store: %s", file_id, exc)
                loop.call_later(RETRY_UNAVAILABLE_S, self.submit, file_id)
            except Exception:
                log.exception("text extraction failed for %s", file_id)

    def process(self, file_id: str) -> None:
        from cartridges.store import core

        errors = core()
        try:
            record = self._store.get_file(self._owner, file_id)
            path = self._store.file_content_path(self._owner, file_id)
            try:
                text = extract_text(path, record.filename)
            except ExtractionError as exc:
                self._store.set_file_error(self._owner, file_id, str(exc))
                return
            except Exception as exc:  # a parser's own failure on hostile content: the file fails, never stays pending
                log.exception("text extraction of %s failed", file_id)
                self._store.set_file_error(self._owner, file_id,
                                           f"could not extract text ({type(exc).__name__}); check the file's format")
                return
            if text is not None:
                text = text.encode("utf-8", "replace").decode("utf-8")  # no lone surrogates
            self._store.set_file_processed(self._owner, file_id, text)
        except errors.NotFoundError:
            pass  # deleted while waiting or processing
        except errors.CorruptError as exc:
            log.error("cannot process %s: %s", file_id, exc)
            self._store.set_file_error(self._owner, file_id, "stored content is damaged")
