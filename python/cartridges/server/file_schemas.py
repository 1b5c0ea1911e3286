"""Bodies of the Files API (docs/api.md §1), as pydantic models."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

Purpose = Literal["cartridge-training", "assistants"]
PURPOSES: tuple[str, ...] = ("cartridge-training", "assistants")
FileStatus = Literal["uploaded", "processed", "error"]

# Accepted extensions (case-insensitive) and the Content-Type their content is served with.
MEDIA_TYPES = {
    ".txt": "text/plain; charset=utf-8",
    ".pdf": "application/pdf",
    ".md": "text/markdown; charset=utf-8",
    ".json": "application/json",
    ".jsonl": "application/jsonl",
    ".csv": "text/csv; charset=utf-8",
}


class FileListEntry(BaseModel):
    id: str = Field(description="`file-` followed by 24 characters [A-Za-z0-9].")
    object: Literal["file"] = "file"
    bytes: int = Field(description="Size of the stored content.")
    created_at: int = Field(description="Upload time, Unix seconds.")
    filename: str = Field(description="The uploaded name reduced to a safe base name (at most 255 bytes).")
    purpose: Purpose

    @classmethod
    def of(cls, record: Any) -> FileListEntry:
        return cls(
            id=record.id,
            bytes=record.bytes,
            created_at=record.created_at,
            filename=record.filename,
            purpose=record.purpose,
        )


class FileObject(FileListEntry):
    status: FileStatus = Field(description="`uploaded` → `processed` once its text is extracted, or `error`.")
    status_details: str | None = Field(description="Why processing failed, when `status` is `error`.")

    @classmethod
    def of(cls, record: Any) -> FileObject:
        entry = FileListEntry.of(record).model_dump()
        return cls(**entry, status=record.status, status_details=record.status_details)


class FileList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FileListEntry]
    first_id: str | None = Field(description="Id of the first entry of this page, null when empty.")
    last_id: str | None = Field(description="Id of the last entry: pass it as `after` for the next page.")
    has_more: bool = Field(description="Whether more entries follow this page.")


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: Literal[True] = True


UPLOAD_REQUEST_BODY: dict[str, Any] = {
    "required": True,
    "content": {
        "multipart/form-data": {
            "schema": {
                "type": "object",
                "required": ["file", "purpose"],
                "properties": {
                    "file": {
                        "type": "string",
                        "format": "binary",
                        "description": "The file, at most 512 MiB; its name must end in one of "
                        + ", ".join(MEDIA_TYPES)
                        + " (case-insensitive).",
                    },
                    "purpose": {"type": "string", "enum": list(PURPOSES), "description": "What the file is for."},
                },
            }
        }
    },
}
