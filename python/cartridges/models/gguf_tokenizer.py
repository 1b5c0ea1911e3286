"""Build a `tokenizers.Tokenizer` from a GGUF file's `tokenizer.ggml.*` metadata.

A GGUF carries no tokenizer.json: only the vocabulary, merges, token types and special ids.
We rebuild the byte-level BPE ("gpt2" model) the way transformers' GGUF loader does
(integrations/gguf/gguf_tokenizer_mapping.py), so ids match `AutoTokenizer(gguf_file=...)`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from functools import lru_cache
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers, processors
from tokenizers.models import BPE

from .errors import ModelLoadError
from .tokenizer import ChatTokenizer

_TOKEN_TYPE_CONTROL = 3  # llama.cpp's LLAMA_TOKEN_TYPE_CONTROL: <|im_start|>, <|endoftext|>, ...
_TOKEN_TYPE_USER_DEFINED = 4  # added tokens that are not special, e.g. <think>

# `tokenizer.ggml.pre` names the split regex the merges were learned with. Names not listed
# here ("smollm", "gpt2", "default", ...) use the GPT-2 regex built into ByteLevel, as in
# transformers. (llama.cpp's "smollm" also splits digits one by one, but SmolLM2's vocabulary has
# no token with a digit beside another character, so the ids are the same.)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "dbrx", "smaug-bpe"), _LLAMA3_SPLIT
    ),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "megrez"), _QWEN2_SPLIT),
}


# Longer than 60 lines: the GGUF tokenizer metadata mapped field by field onto a `tokenizers` BPE.
def build_gguf_tokenizer(meta: Mapping[str, Any], path: str | os.PathLike[str]) -> ChatTokenizer:
    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise ModelLoadError(path, f"unsupported GGUF tokenizer model '{model}' (only byte-level BPE 'gpt2')")
    if not meta.get("tokenizer.ggml.tokens"):
        raise ModelLoadError(path, "metadata key 'tokenizer.ggml.tokens' is missing")
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [])
    merges = [tuple(m.split(" ")) for m in meta.get("tokenizer.ggml.merges") or []]

    # Tokens are stored in the byte alphabet (" " as "Ġ"); a control token written with other
    # characters is respelled so the BPE model can hold it, as transformers does.
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {
        t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
        for i, t in enumerate(tokens)
    }
    tok = Tokenizer(
        BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
            end_of_word_suffix="", fuse_unk=False)
    )
    split = _SPLITS.get(meta.get("tokenizer.ggml.pre", ""))
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    tok.decoder = decoders.ByteLevel()

    def special_text(key: str) -> str | None:
        token_id = meta.get(f"tokenizer.ggml.{key}")
        return tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None

    bos, eos = special_text("bos_token_id"), special_text("eos_token_id")
    unk, pad = special_text("unknown_token_id"), special_text("padding_token_id")

    # Control tokens must match whole in the text and be skipped on decode; a control token
    # outside the byte alphabet is a llama.cpp mislabel that transformers skips too.
    special = [t for t, ty in zip(tokens, types) if ty == _TOKEN_TYPE_CONTROL and set(t) <= alphabet]
    special += [t for t in (bos, eos, unk, pad) if t is not None]
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in dict.fromkeys(special)])
    user = [t for t, ty in zip(tokens, types) if ty == _TOKEN_TYPE_USER_DEFINED and t in vocab]
    if user:
        tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])

    if meta.get("tokenizer.ggml.add_bos_token") and bos is not None:
        # Only `encode(..., add_special_tokens=True)` uses this; chat prompts get BOS from
        # the template.
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])]
        )

    stop_ids = [
        meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                          "tokenizer.ggml.eom_token_id") if meta.get(k) is not None
    ]
    return ChatTokenizer(
        tok,
        meta.get("tokenizer.chat_template"),
        bos_token=bos,
        eos_token=eos,
        unk_token=unk,
        pad_token=pad,
        stop_token_ids=[int(i) for i in stop_ids],
    )


@lru_cache(maxsize=1)
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from each byte to a printable character (the byte-level alphabet)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))
