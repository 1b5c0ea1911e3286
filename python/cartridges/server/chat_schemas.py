"""Bodies of chat completions (docs/api.md §4).

Chat requests follow OpenAI's: fields OpenAI defines are checked, and a bad one is a 400 naming
it; a field this server does not implement (tools, structured output, audio, ...) is refused
with 400 `unsupported_parameter` rather than ignored, so that a client never gets an answer to a
question it did not ask; fields that only concern OpenAI's own bookkeeping (`store`, `user`,
...) are accepted and change nothing. Fields OpenAI does not define are ignored."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationInfo, field_validator
from pydantic.json_schema import SkipJsonSchema
from pydantic_core import PydanticCustomError

from cartridges.retrieval import MAX_PASSAGES, TOP_K

MAX_STOP_SEQUENCES = 4
MAX_CHOICES = 16
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 300  # entries, as OpenAI allows

# OpenAI request fields for features this server does not have: a request that sets one (to
# anything but null, or the value that asks for nothing) is refused, naming the field.
UNSUPPORTED_FIELDS = ("tools", "tool_choice", "functions", "function_call", "parallel_tool_calls", "audio",
                      "modalities", "prediction", "web_search_options", "reasoning_effort", "verbosity")
# Accepted and without effect here: they concern OpenAI's storage, billing and abuse tracking.
_NO_EFFECT = "Accepted for compatibility with OpenAI; has no effect here."

Unsupported = SkipJsonSchema[Any]


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


class RetrievalOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    top_k: int = Field(default=TOP_K, ge=1, le=MAX_PASSAGES, description="At most this many passages in the prompt.")
    passages_only: StrictBool = Field(
        default=False, description="Leave the cartridges' KV out of the context: their training files are searched "
        "as usual, and the passages alone answer (retrieval without the cartridge). On corpora of 40K tokens and "
        "more it answers more questions exactly than one cartridge with the passages, and about as many as a "
        "cartridge in parts (the default there) with the passages (docs/api.md §4.3).")


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
    composition: Literal["mixture", "route", "search", "concatenate"] = Field(
        default="search", description="Extension: how two or more cartridges, and a cartridge's parts, are composed. "
        "`search` (the default): of a cartridge trained in parts, only the part that BM25 over the parts' own "
        "training text ranks first for the last user message is used (parts that tie, by mixture; one part's KV "
        "and speed, the prompt read once; about the mixture's quality), and the response's `search` field names it; where the search cannot say, all "
        "its parts; several cartridges (or parts) by `mixture`. `mixture`: each cartridge reads the conversation on "
        "its own, and each token is drawn from their predictions weighted by how well each explains the "
        "conversation so far, from the first message after the system prompt (each document's questions keep their "
        "single-cartridge quality; costs one sequence per cartridge). `route`: as `mixture` while the prompt is "
        "read, then the reply is decoded with the cartridge that weighs most alone (one sequence and its KV: "
        "several times faster for a cartridge trained in parts, a little less of its gain). `concatenate`: their "
        "KV one after another in front of one sequence, in order (cheaper, but trained cartridges pull every "
        "question to themselves). A cartridge trained in parts counts as its parts, and is composed by `search`, "
        "`mixture` or `route` only.")
    retrieval: StrictBool | RetrievalOptions | None = Field(
        default=None, description="Extension: `true` (or `{top_k}`, default 4) also puts in the prompt the passages "
        "of the cartridges' own training files that best match the last user message (BM25 over chunks of about "
        "300 tokens), as a system message behind the cartridges: the cartridge for what the corpus says as a "
        "whole, the passages for its literal detail; `{passages_only: true}`: the passages alone, the cartridges' "
        "KV left out. Needs a cartridge.")
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
    logit_bias: dict[str, float] | None = Field(
        default=None, max_length=MAX_LOGIT_BIAS, examples=[{"15339": -100, "1820": 5}],
        description="Token id (as a string) -> a value in [-100, 100] added to that token's logit before "
        "sampling: -100 bans the token, 100 all but forces it. `logprobs` stay the model's own.")
    response_format: dict[str, Any] | None = Field(
        default=None, description='Only `{"type": "text"}` (the default); JSON modes are refused.')
    frequency_penalty: float | None = Field(
        default=None, ge=-2, le=2, description="Only 0 (the default): penalties are not implemented and are refused.")
    presence_penalty: float | None = Field(
        default=None, ge=-2, le=2, description="Only 0 (the default): penalties are not implemented and are refused.")
    store: bool | None = Field(default=None, description=_NO_EFFECT)
    metadata: dict[str, str] | None = Field(default=None, description=_NO_EFFECT)
    service_tier: str | None = Field(default=None, description=_NO_EFFECT)
    user: str | None = Field(default=None, description=_NO_EFFECT)
    prompt_cache_key: str | None = Field(default=None, description=_NO_EFFECT)
    safety_identifier: str | None = Field(default=None, description=_NO_EFFECT)

    # Refused when set (see UNSUPPORTED_FIELDS); kept off the OpenAPI page, listed in docs/api.md.
    tools: Unsupported = None
    tool_choice: Unsupported = None
    functions: Unsupported = None
    function_call: Unsupported = None
    parallel_tool_calls: Unsupported = None
    audio: Unsupported = None
    modalities: Unsupported = None
    prediction: Unsupported = None
    web_search_options: Unsupported = None
    reasoning_effort: Unsupported = None
    verbosity: Unsupported = None

    @field_validator(*UNSUPPORTED_FIELDS)
    @classmethod
    def _not_implemented(cls, value: Any) -> Any:
        if value is not None:
            raise PydanticCustomError("unsupported_parameter", "this server does not implement it; leave it out")
        return value

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None and value.get("type") != "text":
            raise PydanticCustomError("unsupported_parameter", "only {'type': 'text'} is supported: replies are "
                                      "not constrained to JSON here")
        return value

    @field_validator("frequency_penalty", "presence_penalty")
    @classmethod
    def _no_penalty(cls, value: float | None) -> float | None:
        if value:
            raise PydanticCustomError("unsupported_parameter", "only 0 is supported: penalties are not implemented")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _token_ids_and_range(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for token, value in (bias or {}).items():
            if not (token.isascii() and token.strip().isdigit()):  # "²" and "５" are digits to isdigit
                raise ValueError(f"keys must be token ids (non-negative integers as strings), got {token!r}")
            if len(token.strip()) > 10:  # no vocabulary reaches 10 digits; int() refuses 4,300
                raise ValueError(f"token id {token.strip()[:12]}... is outside any vocabulary")
            if not -100 <= value <= 100:
                raise ValueError(f"values must be in [-100, 100], got {value} for token {token}")
        return bias

    @field_validator("stream_options")
    @classmethod
    def _needs_stream(cls, options: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if options is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed when 'stream' is true")
        return options

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
