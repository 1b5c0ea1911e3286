"""Bodies of chat completions (docs/api.md §4).

Chat requests follow OpenAI's: unknown fields are ignored (clients send many), known ones are
checked, and a bad one is a 400 naming it."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

MAX_STOP_SEQUENCES = 4
MAX_CHOICES = 16
MAX_TOP_LOGPROBS = 20


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class FileRef(BaseModel):
    file_id: str = Field(description="A processed file of the caller; its text goes into the prompt.")


class FilePart(BaseModel):
    type: Literal["file"]
    file: FileRef


ContentPart = Annotated[TextPart | FilePart, Field(discriminator="type")]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart] | None = Field(
        default=None, description="Text, or parts: `{type: text, text}` and `{type: file, file: {file_id}}`.")


class CartridgeRef(BaseModel):
    id: str


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str = Field(description="A cartridge id (full or bare run id; loaded on demand) or the base model's id.")
    messages: list[ChatMessage] = Field(min_length=1)
    cartridges: list[str | CartridgeRef] | None = Field(
        default=None, description="Extension: more cartridges as context, composed with the `model` cartridge "
        "(if any) as `composition` says.")
    composition: Literal["mixture", "concatenate"] = Field(
        default="mixture", description="Extension: how two or more cartridges are composed. `mixture`: each "
        "cartridge reads the conversation on its own, and each token is drawn from their predictions weighted by "
        "how well each explains the conversation so far, from the first message after the system prompt (each "
        "document's questions keep their single-cartridge quality; costs one sequence per cartridge). "
        "`concatenate`: their KV one after another in front of one sequence, in order (cheaper, but trained "
        "cartridges pull every question to themselves).")
    max_tokens: int | None = Field(default=None, ge=1, description="Deprecated alias of max_completion_tokens.")
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    stop: str | list[str] | None = Field(default=None, description=f"Up to {MAX_STOP_SEQUENCES} stop sequences.")
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**63)
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS, description="Needs `logprobs: true`.")

    @field_validator("stop")
    @classmethod
    def _at_most_four_stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        if isinstance(stop, list) and len(stop) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences")
        return stop

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, top: int | None, info: ValidationInfo) -> int | None:
        if top is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs 'logprobs': true")
        return top
