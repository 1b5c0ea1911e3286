"""Datablocks (docs/api.md §2): train a cartridge as a background job, list, retrieve, delete.

A datablock id is `<owner>/<project>/<run_id>` or the bare run id; the full form holds
slashes, hence the `:path` converter."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path as PathLib
from typing import Annotated, Literal

from fastapi import APIRouter, Path, Query
from fastapi.responses import FileResponse
from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool

from cartridges.models.default import base_model_id
from cartridges.selfstudy.config import TrainConfig
from cartridges.server.text_route import TextRoute
from cartridges.server.datablock_schemas import (
    MAX_TRAINING_FILES,
    DatablockDeleted,
    DatablockList,
    DatablockObject,
    DatablockStatus,
    TrainRequest,
)
from cartridges.server.deps import BlobMirrorDep, CurrentUser, ServingDep, SettingsDep, StoreDep, SupervisorDep
from cartridges.server.downloads import blob_response, content_disposition
from cartridges.server.errors import APIError, error_responses
from cartridges.server.schemas import list_object

router = APIRouter(tags=["datablocks"], route_class=TextRoute)

DatablockId = Annotated[str, Path(description="`<owner>/<project>/<run_id>`, or the bare run id.")]


@router.post(
    "/datablocks/train",
    summary="Train a datablock",
    response_model=DatablockObject,
    responses=error_responses(400, 401, 404, 500),
)
async def train_datablock(
    body: TrainRequest, user: CurrentUser, store: StoreDep, settings: SettingsDep, supervisor: SupervisorDep
) -> DatablockObject:
    """Queues a training job on the caller's processed `cartridge-training` files (a file still
    being processed is waited for). The answer is the datablock, `status: "queued"`."""
    file_ids = _training_files(body)
    config = body.config or TrainConfig()
    model = base_model_id(settings.model)
    if body.model is not None and body.model != model:
        raise APIError(400, f"Unknown model '{body.model}': this server trains for '{model}'.",
                       code="model_not_found", param="model")
    for file_id in file_ids:
        record = await run_in_threadpool(store.get_file, user.owner, file_id)  # 404 if not the caller's
        if record.purpose != "cartridge-training":
            raise APIError(400, f"File '{file_id}' has purpose '{record.purpose}'; training needs "
                           "'cartridge-training'.", code="invalid_purpose", param="training_files")
        if record.status == "error":
            raise APIError(400, f"File '{file_id}' could not be processed: {record.status_details}",
                           code="file_not_processed", param="training_files")
    # num_tokens 0: left to the corpus, decided by the job once it has read the files (in parts,
    # or maybe in parts when not told: their sum, once the corpus is cut). The parts' settings
    # travel in the stored config; without "parts" there, the job decides from the corpus' length.
    in_parts = True if body.part_tokens is not None else body.parts
    stored = config.to_dict() | ({} if in_parts is None else {"parts": in_parts}) | (
        {"part_tokens": body.part_tokens} if in_parts else {})
    record = await run_in_threadpool(
        store.create_datablock, user.owner, project=body.name, model=model, model_path=_model_path(settings.model),
        training_files=file_ids, config=json.dumps(stored),
        num_tokens=config.num_tokens or 0 if in_parts is False else 0,
    )
    supervisor.wake()
    return DatablockObject.of(record)


def _model_path(model: str | None) -> str:
    """Absolute, so that a worker started after a restart from elsewhere finds the same model."""
    return str(PathLib(model).resolve()) if model else ""


def _training_files(body: TrainRequest) -> list[str]:
    if (body.training_files is None) == (body.training_file is None):
        raise APIError(400, "Give exactly one of 'training_files' and 'training_file'.",
                       code="invalid_value", param="training_files")
    files = body.training_files if body.training_files is not None else [body.training_file or ""]
    if not 1 <= len(files) <= MAX_TRAINING_FILES:
        raise APIError(400, f"'training_files' takes 1 to {MAX_TRAINING_FILES} file ids.",
                       code="invalid_value", param="training_files")
    return list(dict.fromkeys(files))  # a file given twice is trained on once


@router.get("/datablocks", summary="List datablocks", response_model=DatablockList,
            responses=error_responses(400, 401, 404, 500))
def list_datablocks(
    user: CurrentUser,
    store: StoreDep,
    status: Annotated[DatablockStatus | None, Query(description="Only datablocks in this status.")] = None,
    limit: Annotated[int, Query(ge=1, le=10000, description="Page size.")] = 10000,
    order: Annotated[Literal["asc", "desc"], Query(description="By `created_at`.")] = "desc",
    after: Annotated[str | None, Query(description="A datablock id: the page starts after it (404 if unknown).")] = None,
) -> DatablockList:
    """The caller's datablocks, newest first by default, in pages walked with `after`."""
    page = store.list_datablocks(user.owner, status=status, after=after, limit=limit, descending=order == "desc")
    return list_object(DatablockList, [DatablockObject.of(r) for r in page.data], page.has_more)


# The cartridge's download formats: file name suffix and media type.
EXPORT_FORMATS = {
    "safetensors": (".safetensors", "application/octet-stream"),
    "peft": ("-peft.zip", "application/zip"),
    "pt": (".pt", "application/octet-stream"),
}


# Registered before the retrieve route: `{datablock_id:path}` would otherwise take ".../content".
@router.get(
    "/datablocks/{datablock_id:path}/content",
    summary="Download a datablock's cartridge",
    response_class=FileResponse,
    responses={200: {"description": "The cartridge file, or with `format=peft` a zip of the PEFT adapter "
                     "directory.", "content": {"application/octet-stream": {}, "application/zip": {}}},
               **error_responses(400, 401, 404, 409, 500)},
)
def datablock_content(
    datablock_id: DatablockId,
    user: CurrentUser,
    store: StoreDep,
    mirror: BlobMirrorDep,
    format: Annotated[Literal["safetensors", "peft", "pt"], Query(
        description="`safetensors`: this package's cartridge file (`Cartridge.load`); `peft`: a zip of a Hugging "
        "Face PEFT `CARTRIDGE` adapter directory (`PeftModel.from_pretrained`); `pt`: the research code's "
        "`.pt`.")] = "safetensors",
) -> FileResponse:
    """The trained cartridge of the caller's datablock, in the format asked for (docs/formats.md)."""
    from cartridges.cartridge import Cartridge, CartridgeFileError, PartsFileError, UnexportableError

    record = store.get_datablock(user.owner, datablock_id)
    if record.status != "succeeded":
        raise APIError(409, f"Datablock '{record.id}' has no cartridge yet (status: {record.status}).",
                       code="cartridge_not_ready")
    suffix, media_type = EXPORT_FORMATS[format]
    filename = f"{record.project}-{record.run_id}{suffix}"
    if format == "safetensors":  # the stored file itself
        return blob_response(store.datablock_content(user.owner, record.id), mirror, media_type,
                             {"Content-Disposition": content_disposition(filename)})
    path = store.datablock_cartridge_path(user.owner, record.id)
    try:
        cartridge = Cartridge.load(path)
    except PartsFileError:
        raise APIError(400, f"Datablock '{record.id}' was trained in parts, which only this package's cartridge file "
                       f"holds (format=safetensors); {format} holds one cartridge.", param="format",
                       code="format_unavailable") from None
    except CartridgeFileError as error:
        raise APIError(500, f"The cartridge of '{record.id}' could not be read: {error.reason}.",
                       code="cartridge_unreadable") from None
    handle, scratch = tempfile.mkstemp(prefix="cartridge-export-", suffix=suffix)
    os.close(handle)
    try:
        if format == "peft":
            from cartridges.peft_adapter import save_peft_zip

            save_peft_zip(cartridge, scratch, base_model=record.model)
        else:
            cartridge.export_pt(scratch)
    except UnexportableError as error:
        os.unlink(scratch)
        raise APIError(400, f"{error} (format=safetensors).", param="format", code="format_unavailable") from None
    except BaseException:
        os.unlink(scratch)
        raise
    return FileResponse(scratch, media_type=media_type, filename=filename,
                        background=BackgroundTask(os.unlink, scratch))


@router.get("/datablocks/{datablock_id:path}", summary="Retrieve a datablock", response_model=DatablockObject,
            responses=error_responses(401, 404, 500))
def retrieve_datablock(datablock_id: DatablockId, user: CurrentUser, store: StoreDep) -> DatablockObject:
    """The datablock, with its job's status, progress and metrics."""
    return DatablockObject.of(store.get_datablock(user.owner, datablock_id))


@router.delete("/datablocks/{datablock_id:path}", summary="Delete a datablock", response_model=DatablockDeleted,
               responses=error_responses(401, 404, 500))
def delete_datablock(datablock_id: DatablockId, user: CurrentUser, store: StoreDep, serving: ServingDep,
                     supervisor: SupervisorDep) -> DatablockDeleted:
    """Cancels its job if queued or running (the worker stops within seconds), unloads its
    cartridge from memory, and removes the datablock and its cartridge for good."""
    record = store.get_datablock(user.owner, datablock_id)
    store.delete_datablock(user.owner, record.run_id)
    serving.unload(record.id)
    supervisor.wake()
    return DatablockDeleted(id=record.id)
