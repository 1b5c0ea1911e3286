"""Bodies of models, preload and health (docs/api.md §3)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

MAX_PRELOAD_IDS = 256


class ModelObject(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(description="When it was loaded (Unix seconds).")
    owned_by: str = "cartridges"
    parent: str | None = Field(default=None, description="The base model a cartridge belongs to.")
    num_tokens: int | None = Field(default=None, description="Cartridge length in tokens.")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelObject]


class Health(BaseModel):
    status: Literal["healthy", "unhealthy"]
    device: str
    loaded_cartridges: list[str] = Field(description="Only those the presented key may see.")
    reason: str | None = Field(None, description="Why the server is unhealthy, when it is.")
