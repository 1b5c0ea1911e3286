"""Files (docs/api.md §1): upload, list, retrieve, delete, download."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Path, Query, Request
from fastapi.responses import FileResponse, Response
from starlette.concurrency import run_in_threadpool

from cartridges.server.text_route import TextRoute
from cartridges.server.deps import BlobMirrorDep, CurrentUser, ExtractorDep, SettingsDep, StoreDep
from cartridges.server.downloads import blob_response, content_disposition
from cartridges.server.errors import error_responses
from cartridges.server.file_schemas import (
    MEDIA_TYPES,
    UPLOAD_REQUEST_BODY,
    FileDeleted,
    FileList,
    FileListEntry,
    FileObject,
    Purpose,
)
from cartridges.server.schemas import list_object
from cartridges.server.uploads import file_extension, receive_upload

router = APIRouter(tags=["files"], route_class=TextRoute)

FileId = Annotated[str, Path(description="The file's id.")]


@router.post(
    "/files",
    summary="Upload a file",
    response_model=FileObject,
    responses=error_responses(400, 401, 413, 500),
    openapi_extra={"requestBody": UPLOAD_REQUEST_BODY},
)
async def upload_file(request: Request, user: CurrentUser, store: StoreDep, settings: SettingsDep,
                      extractor: ExtractorDep) -> FileObject:
    """Streams the file into the store; its text is extracted in the background (`status`
    moves from `uploaded` to `processed` or `error`). Type, size and emptiness are checked
    here: a file over the limit is refused while it streams in and leaves nothing behind."""
    upload = await receive_upload(request, store, settings.max_upload_bytes)
    record = await run_in_threadpool(store.create_file, user.owner, upload.writer, upload.filename, upload.purpose)
    extractor.submit(record.id)
    return FileObject.of(record)


@router.get("/files", summary="List files", response_model=FileList, responses=error_responses(400, 401, 404, 500))
def list_files(
    user: CurrentUser,
    store: StoreDep,
    purpose: Annotated[Purpose | None, Query(description="Only files with this purpose.")] = None,
    limit: Annotated[int, Query(ge=1, le=10000, description="Page size.")] = 10000,
    order: Annotated[Literal["asc", "desc"], Query(description="By `created_at`.")] = "desc",
    after: Annotated[str | None, Query(description="A file id: the page starts after it (404 if unknown).")] = None,
) -> FileList:
    """The caller's files, newest first by default, in pages walked with `after`."""
    page = store.list_files(user.owner, purpose=purpose, after=after, limit=limit, descending=order == "desc")
    return list_object(FileList, [FileListEntry.of(r) for r in page.data], page.has_more)


@router.get(
    "/files/{file_id}", summary="Retrieve a file", response_model=FileObject, responses=error_responses(401, 404, 500)
)
def retrieve_file(file_id: FileId, user: CurrentUser, store: StoreDep) -> FileObject:
    """The file object, with its processing `status`."""
    return FileObject.of(store.get_file(user.owner, file_id))


@router.delete(
    "/files/{file_id}", summary="Delete a file", response_model=FileDeleted, responses=error_responses(401, 404, 500)
)
def delete_file(file_id: FileId, user: CurrentUser, store: StoreDep) -> FileDeleted:
    """Removes the file and its content for good."""
    store.delete_file(user.owner, file_id)
    return FileDeleted(id=file_id)


@router.get(
    "/files/{file_id}/content",
    summary="Download a file's content",
    response_class=FileResponse,
    responses={
        200: {
            "description": "The exact bytes uploaded; `Range` requests are honoured (206).",
            "content": {media.split(";")[0]: {"schema": {"type": "string", "format": "binary"}} for media in MEDIA_TYPES.values()},
        },
        206: {"description": "The requested byte range.",
              "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}},
        **error_responses(400, 401, 404, 416, 500),
    },
)
def file_content(file_id: FileId, user: CurrentUser, store: StoreDep, mirror: BlobMirrorDep) -> Response:
    """The content, with the Content-Type of its type and `Content-Disposition: attachment`."""
    record = store.get_file(user.owner, file_id)
    content = store.file_content(user.owner, file_id)  # the local file, checked whole, or the mirror's
    return blob_response(content, mirror, MEDIA_TYPES[file_extension(record.filename)],
                         {"Content-Disposition": content_disposition(record.filename)})
