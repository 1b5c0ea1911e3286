"""Request and response bodies of the datablocks API (docs/api.md §2), as pydantic models."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from cartridges.parts import MIN_PART_TOKENS
from cartridges.selfstudy.config import TrainConfig

DatablockStatus = Literal["queued", "running", "succeeded", "failed", "cancelled"]
Stage = Literal["queued", "compacting", "synthesizing", "training", "saving", "done"]
MAX_TRAINING_FILES = 100  # docs/api.md §5


class TrainRequest(BaseModel):
    """Exactly one of `training_files` and `training_file`."""

    model_config = ConfigDict(extra="forbid")

    training_files: list[str] | None = Field(default=None, description="The files to train on (1 to 100).")
    training_file: str | None = Field(default=None, description="One file to train on.")
    name: str = Field(default="default", pattern=r"^[A-Za-z0-9._-]{1,64}$",
                      description="The project: the middle part of the datablock id.")
    model: str | None = Field(default=None, description="Base model id; default: the server's model.")
    config: TrainConfig | None = Field(
        default=None,
        description="The training config: any of its fields, the others keep their defaults (docs/configuration.md). "
        "Unknown fields, wrong types and values out of range are refused.",
    )
    parts: bool | None = Field(
        default=None,
        description="`true`: cut the corpus at headings (or paragraphs) into parts of about `part_tokens` (a part "
        "can run a little over, to end at a heading), train a cartridge per part with `config`, and keep them as one "
        "cartridge; a chat question is answered by the part it is about (a corpus within one part gets one "
        "cartridge). `false`: one cartridge however long the corpus. Unset: in parts for a corpus of more than "
        "four of the model's contexts "
        "(32,768 tokens for the default model), decided when the job has read the files.")
    part_tokens: int | None = Field(
        default=None, ge=MIN_PART_TOKENS,
        description="About how many tokens a part holds (implies `parts`); default: two of the model's contexts "
        "(16,384 tokens for the default model).")

    @model_validator(mode="after")
    def _part_tokens_need_parts(self) -> TrainRequest:
        if self.part_tokens is not None and self.parts is False:
            raise ValueError("`part_tokens` is the size of a part: it cannot go with `parts: false`")
        return self


class Progress(BaseModel):
    stage: Stage
    completed: int
    total: int
    eta_seconds: int | None = Field(default=None, description="Estimated seconds left in this stage.")
    part: int | None = Field(default=None, description="For a datablock trained in parts: the part the stage is "
                             "about (1 to `parts`); each part goes through the stages in turn.")
    parts: int | None = Field(default=None, description="For a datablock trained in parts: how many parts, once "
                              "the corpus is cut.")


class PartMetrics(BaseModel):
    corpus_tokens: int | None = Field(description="The part's tokens, the corpus' opening included (null when "
                                      "imported).")
    num_tokens: int = Field(description="Its cartridge's length in tokens.")
    num_samples: int | None = Field(description="The training conversations decided for the part.")
    loss: float | None = None
    quality: dict[str, Any] | None = None
    signal_by_part: list[float] | None = Field(default=None, description="As `metrics.signal_by_part`, over the "
                                               "part's tenths.")


class Metrics(BaseModel):
    loss: float | None = None
    synthetic_samples: int | None = None
    train_tokens: int | None = None
    quality: dict[str, Any] | None = None
    signal_by_part: list[float] | None = Field(
        default=None, description="Where the training signal came from: the share of the training conversations' "
        "answer tokens drawn from each tenth of the corpus, in order (0.1 each when even). Set when training ends.")
    parts: list[PartMetrics] | None = Field(
        default=None, description="For a datablock trained in parts, once trained: each part's figures, in order "
        "(`loss`, `quality` and `signal_by_part` above are then null).")


class DatablockError(BaseModel):
    code: str
    message: str


class DatablockObject(BaseModel):
    id: str = Field(description="`<owner>/<project>/<run_id>`.")
    object: Literal["datablock"] = "datablock"
    run_id: str
    project: str
    owner: str
    model: str = Field(description="Base model id the cartridge belongs to.")
    status: DatablockStatus
    training_files: list[str]
    config: TrainConfig = Field(description="The full training config, defaults filled in; once the job has read "
                                "the files, also what it decided from the corpus (num_tokens, num_samples, "
                                "quality_samples): exactly what is trained.")
    created_at: int
    started_at: int | None
    finished_at: int | None
    updated_at: int = Field(description="The record's last write: a running job writes its progress, and a "
                            "heartbeat every 2 s, so an old one on a `running` datablock means its worker is stuck.")
    progress: Progress
    metrics: Metrics
    num_tokens: int | None = Field(description="Cartridge length in tokens (trained in parts: the parts' sum; a "
                                   "chat's context holds only the longest part); null while queued when it waits for "
                                   "the corpus (a config that leaves it to the corpus, or `parts` left to its length).")
    bytes: int | None = Field(description="Size of the stored cartridge once trained.")
    error: DatablockError | None
    parts: bool | None = Field(default=None, description="Trained in parts: the request's `parts`, or when it left "
                               "them to the corpus' length, what the job decided (null until it starts).")
    part_tokens: int | None = Field(default=None, description="With `parts`, about how many tokens a part holds (the "
                                    "request's, or the default once the job has started).")
    imported_from: str | None = Field(
        default=None, description="Set for a cartridge made elsewhere and added with `cartridges import` (a PEFT "
        "adapter, a research .pt): the name it was imported from. Such a datablock was not trained here; its "
        "`config` holds only its length.")

    @classmethod
    def of(cls, record: Any) -> DatablockObject:
        error = None
        config = json.loads(record.config)
        if record.error_code is not None:
            error = DatablockError(code=record.error_code, message=record.error_message or "")
        return cls(
            id=record.id,
            run_id=record.run_id,
            project=record.project,
            owner=record.owner_name,
            model=record.model,
            status=record.status,
            training_files=list(record.training_files),
            config=TrainConfig.from_dict(config),
            created_at=record.created_at,
            started_at=record.started_at,
            finished_at=record.finished_at,
            updated_at=record.updated_at,
            progress=Progress(**json.loads(record.progress)),
            metrics=Metrics(**json.loads(record.metrics)),
            num_tokens=record.num_tokens or None,
            bytes=record.bytes,
            error=error,
            parts=config.get("parts", None if record.status == "queued" else False),
            part_tokens=config.get("part_tokens"),
            imported_from=config.get("imported_from"),
        )


class DatablockList(BaseModel):
    object: Literal["list"] = "list"
    data: list[DatablockObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class DatablockDeleted(BaseModel):
    id: str
    object: Literal["datablock"] = "datablock"
    deleted: Literal[True] = True
