"""`ChatTokenizer`: text ↔ token ids, and the model's own chat template.

Tokenization is `tokenizers`; the chat template is rendered with a sandboxed jinja2
environment set up the way transformers sets it up (same helpers and options), so that a
conversation becomes exactly the ids `apply_chat_template(..., tokenize=True)` gives.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer
from tokenizers import decoders
from tokenizers.decoders import DecodeStream

Message = Mapping[str, Any]

# Tokens that end an assistant turn in the families we run. Generation must stop on them
# even when the file names another token as its EOS (SmolLM2's GGUF: eos <|im_end|> but
# <|endoftext|> also ends text; Llama 3: eos <|end_of_text|> but turns end with <|eot_id|>).
_END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<|endoftext|>")


class ChatTokenizer:
    def __init__(
        self,
        tokenizer: Tokenizer,
        chat_template: str | None,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        unk_token: str | None = None,
        pad_token: str | None = None,
        stop_token_ids: Iterable[int] = (),
    ) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.unk_token = unk_token
        self.pad_token = pad_token
        self._compiled: jinja2.Template | None = None
        self._token_bytes: dict[bool, list[bytes] | None] = {}  # by skip_special_tokens, built on first use

        ids = list(stop_token_ids)
        for token in (eos_token, *_END_OF_TURN_TOKENS):
            token_id = tokenizer.token_to_id(token) if token else None
            if token_id is not None:
                ids.append(token_id)
        self.eos_token_ids: list[int] = list(dict.fromkeys(ids))  # dedupe, keep order

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return self.tokenizer.token_to_id(self.bos_token) if self.bos_token else None

    @property
    def eos_token_id(self) -> int | None:
        return self.tokenizer.token_to_id(self.eos_token) if self.eos_token else None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`. Special tokens written in the text (e.g. "<|im_start|>") are
        always recognized; `add_special_tokens` adds what the tokenizer's post-processor adds
        (e.g. Llama 3's BOS)."""
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def render_chat(
        self, messages: Sequence[Message], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """The conversation as the prompt string the model was trained on.

        Extra keyword arguments reach the template (e.g. `enable_thinking` for Qwen3)."""
        if self._compiled is None:
            if not self.chat_template:
                raise ValueError("this model has no chat template")
            self._compiled = _compile_template(self.chat_template)
        variables: dict[str, Any] = {
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "unk_token": self.unk_token,
            "pad_token": self.pad_token,
            # Templates test `tools is not none`: an undefined variable would pass that test.
            "tools": None,
            "documents": None,
        }
        variables.update(kwargs)
        return self._compiled.render(
            messages=[dict(m) for m in messages],
            add_generation_prompt=add_generation_prompt,
            **variables,
        )

    def encode_chat(
        self, messages: Sequence[Message], add_generation_prompt: bool = True, **kwargs: Any
    ) -> list[int]:
        # The template writes BOS itself where the model wants one; adding special tokens
        # here would double it (transformers also encodes with add_special_tokens=False).
        text = self.render_chat(messages, add_generation_prompt=add_generation_prompt, **kwargs)
        return self.encode(text, add_special_tokens=False)

    def conversation_start(
        self, messages: Sequence[Message], add_generation_prompt: bool = True, *,
        prompt: Sequence[int] | None = None, **kwargs: Any
    ) -> int:
        """Where the conversation proper begins in `encode_chat(messages)`: the first token of the
        text of the first message that is not a system message (past the template's opening,
        the system prompt and that message's role header), or the prompt's end when every
        message is a system message. What comes before is the same whatever is asked: a
        mixture of cartridges weighs them from here on (`Engine.submit_many`'s `weigh_from`).
        `prompt`: `encode_chat(messages, ...)` when the caller has it already (not encoded again)."""
        if prompt is None:
            prompt = self.encode_chat(messages, add_generation_prompt=add_generation_prompt, **kwargs)
        first = next((i for i, m in enumerate(messages) if m["role"] != "system"), None)
        if first is None:
            return len(prompt)
        try:  # the same conversation cut where that message's text begins
            opening = self.encode_chat([*messages[:first], {**messages[first], "content": ""}],
                                       add_generation_prompt=False, **kwargs)
        except Exception:  # a template that refuses an empty message: weigh everything
            return 0
        return common_prefix_len([prompt, opening])

    def stream_decoder(self, skip_special_tokens: bool = True) -> StreamDecoder | ByteStreamDecoder:
        """An incremental detokenizer: its pieces join to `decode(ids)`. For a byte-level BPE
        vocabulary (GPT-2's, SmolLM2's, Llama 3's) a table of each token's bytes and Python's
        UTF-8 decoder; otherwise `tokenizers`' DecodeStream, several times slower per token
        (the streamed chat's cost per token: benchmarks/README.md, "The HTTP layer's cost per step")."""
        table = self.byte_table(skip_special_tokens)
        if table is not None:
            return ByteStreamDecoder(table)
        return StreamDecoder(self, skip_special_tokens=skip_special_tokens)

    def byte_table(self, skip_special_tokens: bool = True) -> list[bytes] | None:
        """Each token id's bytes as `decode` gives them, for a byte-level BPE vocabulary (built
        once); None for any other."""
        if skip_special_tokens not in self._token_bytes:
            self._token_bytes[skip_special_tokens] = _byte_level_table(self.tokenizer, skip_special_tokens)
        return self._token_bytes[skip_special_tokens]


class StreamDecoder:
    """Incremental detokenizer for streaming: feed ids one at a time, get the new text.

    A character split across tokens (multi-byte UTF-8 in byte-level BPE) is held back until
    its last byte arrives, so the concatenated output equals `decode(all ids)`.
    """

    def __init__(self, tokenizer: ChatTokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._pending: list[int] = []  # ids fed since the last text came out

    def feed(self, token_id: int) -> str:
        """The text completed by this token ("" while a character is still incomplete)."""
        chunk = self._stream.step(self._tokenizer.tokenizer, int(token_id))
        if chunk is None:
            self._pending.append(int(token_id))
            return ""
        self._pending.clear()
        return chunk

    def flush(self) -> str:
        """Whatever is held back at the end of the stream (an incomplete character decodes
        to U+FFFD, as in `decode`)."""
        text = self._tokenizer.decode(self._pending, self._skip_special_tokens) if self._pending else ""
        self._pending.clear()
        return text


class ByteStreamDecoder:
    """`StreamDecoder` for byte-level BPE: each token's bytes from a table, joined into text by
    an incremental UTF-8 decoder (a character split across tokens waits for its last byte;
    invalid bytes become U+FFFD, as `decode` makes them)."""

    def __init__(self, table: list[bytes]) -> None:
        self._table = table
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def feed(self, token_id: int) -> str:
        """The text completed by this token ("" while a character is still incomplete)."""
        token_id = int(token_id)
        data = self._table[token_id] if 0 <= token_id < len(self._table) else b""
        return self._utf8.decode(data)

    def flush(self) -> str:
        """Whatever is held back at the end of the stream (an incomplete character decodes
        to U+FFFD, as in `decode`)."""
        return self._utf8.decode(b"", final=True)


def _byte_level_table(tokenizer: Tokenizer, skip_special_tokens: bool) -> list[bytes] | None:
    """Each token id's bytes as a byte-level BPE decoder gives them (a token spells its bytes as
    GPT-2's printable characters; a token with a character outside that table, as an added
    token may be, is its text's UTF-8), special tokens empty when skipped; None when the
    tokenizer's decoder is not byte-level alone."""
    if not isinstance(tokenizer.decoder, decoders.ByteLevel):
        return None
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    char_byte = {chr(b): b for b in printable}
    for extra, b in enumerate(b for b in range(256) if b not in set(printable)):
        char_byte[chr(256 + extra)] = b
    special = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
    table = []
    for token_id in range(tokenizer.get_vocab_size(with_added_tokens=True)):
        piece = tokenizer.id_to_token(token_id) or ""
        if skip_special_tokens and token_id in special:
            table.append(b"")
        elif all(ch in char_byte for ch in piece):
            table.append(bytes(char_byte[ch] for ch in piece))
        else:
            table.append(piece.encode("utf-8"))
    return table


def common_prefix_len(seqs: Sequence[Sequence[int]]) -> int:
    """How many leading tokens all of `seqs` share."""
    first = seqs[0]
    n = min(len(s) for s in seqs)
    for i in range(n):
        if any(s[i] != first[i] for s in seqs):
            return i
    return n


def _compile_template(source: str) -> jinja2.Template:
    # The same environment transformers builds for `apply_chat_template`: chat templates come
    # from model files, so they run sandboxed.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja's own tojson escapes HTML characters, which would change the prompt.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
