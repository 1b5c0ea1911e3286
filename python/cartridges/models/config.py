"""`ModelConfig`: the shape and hyper-parameters of a Llama-family decoder.

One flat struct for the three families we run (Llama 3.x / SmolLM2, Qwen2/2.5, Qwen3).
The C++ model receives it as `to_dict()`.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

import cartridges_core as core

from .errors import ModelLoadError

# The C++ core defines the model config and its defaults once; the fields below that the core
# also has take their defaults from it. These fields are the Python side's own (tokenizer and
# loader facts) and never reach the core.
_CORE_DEFAULTS = core.LlamaConfig()
_PYTHON_ONLY_FIELDS = frozenset({"architecture", "bos_token_id", "eos_token_ids"})

# Hugging Face `architectures` entry → our architecture name.
_HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
_HF_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


@dataclass
class ModelConfig:
    architecture: str  # "llama" | "qwen2" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    # "default" or "llama3"; the four fields below only matter for "llama3".
    rope_type: str = _CORE_DEFAULTS.rope_type
    rope_factor: float = _CORE_DEFAULTS.rope_factor
    rope_low_freq_factor: float = _CORE_DEFAULTS.rope_low_freq_factor
    rope_high_freq_factor: float = _CORE_DEFAULTS.rope_high_freq_factor
    rope_original_max_position_embeddings: int = _CORE_DEFAULTS.rope_original_max_position_embeddings
    attention_bias: bool = _CORE_DEFAULTS.attention_bias  # bias on q/k/v projections (always on for Qwen2)
    qk_norm: bool = _CORE_DEFAULTS.qk_norm  # RMSNorm on each head of q and k before RoPE (Qwen3)
    tie_word_embeddings: bool = _CORE_DEFAULTS.tie_word_embeddings  # lm_head shares model.embed_tokens.weight
    max_position_embeddings: int = _CORE_DEFAULTS.max_position_embeddings
    bos_token_id: int | None = None  # None: the model has no BOS token (Qwen)
    eos_token_ids: list[int] = field(default_factory=list)  # every id that ends generation

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], path: str | os.PathLike[str]) -> ModelConfig:
        """Map a Hugging Face `config.json` (as a dict) to a ModelConfig; `path` is for errors."""
        arch = _architecture(d, path)

        def need(key: str) -> Any:
            if d.get(key) is None:
                raise ModelLoadError(path, f"config field '{key}' is missing")
            return d[key]

        hidden = int(need("hidden_size"))
        heads = int(need("num_attention_heads"))
        if d.get("mlp_bias"):
            raise ModelLoadError(path, "mlp_bias is not supported")
        if arch == "qwen2":
            attention_bias = True  # Qwen2 always has q/k/v bias; its config has no flag
        else:
            # Llama and Qwen3 put the same flag on o_proj too, which our model does not have;
            # no released checkpoint of these families sets it.
            if d.get("attention_bias"):
                raise ModelLoadError(path, f"attention_bias is not supported for {arch}")
            attention_bias = False
        cfg = cls(
            architecture=arch,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=int(need("num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or hidden // heads),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=10000.0,
            attention_bias=attention_bias,
            qk_norm=arch == "qwen3",
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            bos_token_id=_optional_int(d.get("bos_token_id")),
            eos_token_ids=_id_list(d.get("eos_token_id")),
        )
        _apply_hf_rope(cfg, d, path)
        return cfg

    def expected_tensors(self) -> dict[str, tuple[int, ...]]:
        """Every weight this config needs, by Hugging Face name, with its shape."""
        h, hd, inter = self.hidden_size, self.head_dim, self.intermediate_size
        q, kv = self.num_heads * hd, self.num_kv_heads * hd
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab_size, h)}
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            shapes[p + "input_layernorm.weight"] = (h,)
            shapes[p + "self_attn.q_proj.weight"] = (q, h)
            shapes[p + "self_attn.k_proj.weight"] = (kv, h)
            shapes[p + "self_attn.v_proj.weight"] = (kv, h)
            shapes[p + "self_attn.o_proj.weight"] = (h, q)
            if self.attention_bias:
                shapes[p + "self_attn.q_proj.bias"] = (q,)
                shapes[p + "self_attn.k_proj.bias"] = (kv,)
                shapes[p + "self_attn.v_proj.bias"] = (kv,)
            if self.qk_norm:
                shapes[p + "self_attn.q_norm.weight"] = (hd,)
                shapes[p + "self_attn.k_norm.weight"] = (hd,)
            shapes[p + "post_attention_layernorm.weight"] = (h,)
            shapes[p + "mlp.gate_proj.weight"] = (inter, h)
            shapes[p + "mlp.up_proj.weight"] = (inter, h)
            shapes[p + "mlp.down_proj.weight"] = (h, inter)
        shapes["model.norm.weight"] = (h,)
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, h)
        return shapes

    def to_core(self) -> core.LlamaConfig:
        """The C++ config. A field that is neither the core's nor one of the Python side's own
        is an error, never silently dropped."""
        out = core.LlamaConfig()
        for key, value in dataclasses.asdict(self).items():
            if key in _PYTHON_ONLY_FIELDS:
                continue
            if not hasattr(out, key):
                raise ValueError(f"config field {key!r} is unknown to the C++ core")
            setattr(out, key, value)
        out.validate()
        return out

    def to_dict(self) -> dict[str, Any]:
        """Plain values for C++: ints, floats, bools, str, and a list of ints.

        A missing BOS id is written as -1 so that every scalar has one type.
        """
        out = dataclasses.asdict(self)
        out["bos_token_id"] = -1 if self.bos_token_id is None else self.bos_token_id
        out["eos_token_ids"] = [int(i) for i in self.eos_token_ids]
        return out


def _architecture(d: dict[str, Any], path: str | os.PathLike[str]) -> str:
    names = d.get("architectures") or []
    for name in names:
        if name in _HF_ARCHITECTURES:
            return _HF_ARCHITECTURES[name]
    if names:
        raise ModelLoadError(path, f"unsupported architecture '{names[0]}'")
    model_type = d.get("model_type")
    if model_type in _HF_MODEL_TYPES:
        return _HF_MODEL_TYPES[model_type]
    raise ModelLoadError(path, f"unsupported architecture '{model_type}'")


def _apply_hf_rope(cfg: ModelConfig, d: dict[str, Any], path: str | os.PathLike[str]) -> None:
    # transformers >= 5 writes `rope_parameters` (with rope_theta inside); older files and
    # most Hub checkpoints have `rope_theta` at top level and `rope_scaling` (or null).
    rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    theta = rope.get("rope_theta", d.get("rope_theta"))
    if theta is not None:
        cfg.rope_theta = float(theta)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        return
    if rope_type != "llama3":
        raise ModelLoadError(path, f"unsupported rope type '{rope_type}'")
    try:
        cfg.rope_type = "llama3"
        cfg.rope_factor = float(rope["factor"])
        cfg.rope_low_freq_factor = float(rope["low_freq_factor"])
        cfg.rope_high_freq_factor = float(rope["high_freq_factor"])
        cfg.rope_original_max_position_embeddings = int(rope["original_max_position_embeddings"])
    except KeyError as e:
        raise ModelLoadError(path, f"llama3 rope scaling field {e} is missing") from None


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]
