"""A tiny random Llama model and a character-level chat tokenizer, for fast training tests."""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass

import torch

import cartridges_core
from cartridges import Engine

PAD, BOS, IM_START, IM_END = 0, 1, 2, 3
_FIRST_CHAR, _NUM_CHARS = 4, 95  # printable ASCII 32..126


class CharTokenizer:
    """One token per printable ASCII character; chat turns as <|im_start|>role\\ncontent<|im_end|>\\n."""

    eos_token_ids = [IM_END]

    def encode(self, text: str) -> list[int]:
        return [_FIRST_CHAR + (ord(c) - 32 if 32 <= ord(c) < 127 else ord("?") - 32) for c in text]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(i - _FIRST_CHAR + 32) for i in ids if _FIRST_CHAR <= i < _FIRST_CHAR + _NUM_CHARS)

    def encode_chat(self, messages, add_generation_prompt: bool = True) -> list[int]:
        out: list[int] = []
        for m in messages:
            out += [IM_START, *self.encode(f"{m['role']}\n{m['content']}"), IM_END, *self.encode("\n")]
        if add_generation_prompt:
            out += [IM_START, *self.encode("assistant\n")]
        return out


def tiny_config(context: int = 1024) -> cartridges_core.LlamaConfig:
    c = cartridges_core.LlamaConfig()
    c.vocab_size = 128
    c.hidden_size = 32
    c.intermediate_size = 64
    c.num_layers = 2
    c.num_heads = 4
    c.num_kv_heads = 2
    c.head_dim = 8
    c.tie_word_embeddings = True
    c.max_position_embeddings = context
    return c


def random_weights(c: cartridges_core.LlamaConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def randn(*shape: int, scale: float) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    w = {
        "model.embed_tokens.weight": randn(c.vocab_size, c.hidden_size, scale=0.5),
        "model.norm.weight": 1 + randn(c.hidden_size, scale=0.1),
    }
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = 1 + randn(c.hidden_size, scale=0.1)
        w[p + "post_attention_layernorm.weight"] = 1 + randn(c.hidden_size, scale=0.1)
        w[p + "self_attn.q_proj.weight"] = randn(q, c.hidden_size, scale=0.3)
        w[p + "self_attn.k_proj.weight"] = randn(kv, c.hidden_size, scale=0.3)
        w[p + "self_attn.v_proj.weight"] = randn(kv, c.hidden_size, scale=0.3)
        w[p + "self_attn.o_proj.weight"] = randn(c.hidden_size, q, scale=0.3)
        w[p + "mlp.gate_proj.weight"] = randn(c.intermediate_size, c.hidden_size, scale=0.3)
        w[p + "mlp.up_proj.weight"] = randn(c.intermediate_size, c.hidden_size, scale=0.3)
        w[p + "mlp.down_proj.weight"] = randn(c.hidden_size, c.intermediate_size, scale=0.3)
    return w


@dataclass
class TinyModel:
    """What train() and Cartridge need of a model: .native, .tokenizer, .fingerprint."""

    native: cartridges_core.LlamaModel
    tokenizer: CharTokenizer
    fingerprint: str
    weights: dict[str, torch.Tensor]
    config: cartridges_core.LlamaConfig

    @functools.cached_property
    def engine(self) -> Engine:
        return Engine(self, kv_tokens=8192)


def tiny_model(seed: int = 0, context: int = 1024) -> TinyModel:
    c = tiny_config(context)
    w = random_weights(c, seed)
    fingerprint = "tiny-" + hashlib.sha256(w["model.embed_tokens.weight"].numpy().tobytes()).hexdigest()[:16]
    return TinyModel(cartridges_core.LlamaModel(c, w, "cpu", "float32"), CharTokenizer(), fingerprint, w, c)
