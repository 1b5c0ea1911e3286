"""Load a GGUF file (llama.cpp's format): dequantized float32 weights under Hugging Face
names, a ModelConfig from the metadata, and the tokenizer rebuilt from the metadata."""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from ..store import core
from .config import ModelConfig
from .errors import ModelLoadError
from .gguf_file import GGUFFormatError, GGUFTensor, read_gguf
from .gguf_tokenizer import build_gguf_tokenizer
from .loaded import LoadedModel, check_tensors, merge_ids

# Tensor types we dequantize. gguf can dequantize more (K-quants, IQ*); they are left out on
# purpose until they are tested against a reference.
SUPPORTED_TYPES = frozenset({
    GGMLQuantizationType.F32,
    GGMLQuantizationType.F16,
    GGMLQuantizationType.BF16,
    GGMLQuantizationType.Q8_0,
    GGMLQuantizationType.Q4_0,
    GGMLQuantizationType.Q4_1,
})

_ARCHITECTURES = ("llama", "qwen2", "qwen3")

# llama.cpp per-block tensor names → Hugging Face names (prefix "model.layers.{i}.").
_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(.+)")
_ROPE_FREQS = "rope_freqs.weight"  # llama.cpp's precomputed llama3 RoPE divisors


def load_gguf(path: str | os.PathLike[str]) -> LoadedModel:
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(path, "file not found")
    try:
        gguf_file = read_gguf(path)
    except (GGUFFormatError, OSError) as e:
        raise ModelLoadError(path, f"corrupt or truncated GGUF file ({e})") from e
    meta = gguf_file.metadata
    arch = meta.get("general.architecture")
    if arch not in _ARCHITECTURES:
        raise ModelLoadError(path, f"unsupported architecture '{arch}'")

    tokenizer = build_gguf_tokenizer(meta, path)
    by_name = {t.name: t for t in gguf_file.tensors}
    config = _config(meta, arch, by_name, len(meta["tokenizer.ggml.tokens"]), path)
    config.eos_token_ids = merge_ids(config.eos_token_ids, tokenizer.eos_token_ids)

    tensors: dict[str, torch.Tensor] = {}
    quantized: dict[str, tuple[str, torch.Tensor]] = {}
    for name, t in by_name.items():
        if name == _ROPE_FREQS:
            continue  # folded into config by _config
        hf_name = _hf_name(name)
        if hf_name is None:
            raise ModelLoadError(path, f"unexpected tensor '{name}'")
        blocks = _raw_blocks(t)
        tensor = _dequantize(t, blocks, path)
        if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
            heads = config.num_heads if ".attn_q." in name else config.num_kv_heads
            tensor = _unpermute(tensor, heads)
            blocks = None if blocks is None else _unpermute(blocks, heads)  # the same row order
        tensors[hf_name] = tensor
        if blocks is not None:
            quantized[hf_name] = (t.tensor_type.name, blocks)
    check_tensors(config, tensors, path)
    return LoadedModel(config=config, tensors=tensors, tokenizer=tokenizer, source=path, quantized=quantized)


def _hf_name(name: str) -> str | None:
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    m = _BLOCK_RE.fullmatch(name)
    if m and m.group(2) in _BLOCK_NAMES:
        return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}"
    return None


def _dequantize(t: GGUFTensor, blocks: torch.Tensor | None, path: Path) -> torch.Tensor:
    """float32 [rows, columns] (numpy order, the reverse of GGUF's ne[]) of a tensor of the
    supported types; block formats decoded by the core, on all threads."""
    if t.tensor_type not in SUPPORTED_TYPES:
        raise ModelLoadError(path, f"unsupported quantization type {t.tensor_type.name} for tensor {t.name}")
    try:
        if blocks is not None:
            return core().dequantize_weight(t.tensor_type.name, blocks, t.shape[-1])
        array = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(t.shape)
    except Exception as e:
        raise ModelLoadError(path, f"cannot dequantize tensor {t.name} ({e})") from e
    # The array may be a read-only view of the memory-mapped file: copy it out.
    return torch.from_numpy(np.array(array, dtype=np.float32, copy=True, order="C"))


# Block formats the engine's CPU kernel reads directly.
_BLOCK_FORMATS = frozenset({GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0})


def _raw_blocks(t: GGUFTensor) -> torch.Tensor | None:
    """A matrix's quantized bytes as uint8 [rows, row bytes], for the formats the core decodes."""
    if t.tensor_type not in _BLOCK_FORMATS or len(t.shape) != 2:
        return None
    return torch.from_numpy(np.array(t.data, dtype=np.uint8, copy=True))


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's convert_hf_to_gguf `permute` of Q/K rows.

    llama.cpp rotates adjacent pairs (x0, x1) while HF rotates halves (x0, x_{d/2}); the
    converter reorders each head's rows from [half0 | half1] to interleaved, via
    reshape(n_head, 2, d/2, ...).swapaxes(1, 2). This is the exact inverse.
    """
    shape = w.shape
    return (
        w.reshape(n_head, shape[0] // n_head // 2, 2, *shape[1:])
        .transpose(1, 2)
        .reshape(shape)
        .contiguous()
    )


def _config(meta: dict[str, Any], arch: str, tensors: dict[str, Any], vocab_size: int, path: Path) -> ModelConfig:
    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise ModelLoadError(path, f"metadata key '{arch}.{key}' is missing")
        return value

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", hidden // heads))
    rope_dims = meta.get(f"{arch}.rope.dimension_count")
    if rope_dims is not None and int(rope_dims) != head_dim:
        raise ModelLoadError(path, f"partial rotary embedding ({rope_dims} of {head_dim} dims) is not supported")
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling != "none":
        raise ModelLoadError(path, f"unsupported rope scaling type '{scaling}'")

    bos = meta.get("tokenizer.ggml.bos_token_id")
    config = ModelConfig(
        architecture=arch,
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=heads,
        num_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        attention_bias="blk.0.attn_q.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        tie_word_embeddings="output.weight" not in tensors,
        max_position_embeddings=int(get("context_length")),
        bos_token_id=None if bos is None else int(bos),
    )
    if _ROPE_FREQS in tensors:
        _llama3_rope_from_freqs(config, _dequantize(tensors[_ROPE_FREQS], None, path), path)
    return config


def _llama3_rope_from_freqs(config: ModelConfig, divisors: torch.Tensor, path: Path) -> None:
    """Recover llama3 RoPE scaling parameters from llama.cpp's `rope_freqs` tensor.

    llama.cpp stores, per frequency f, the divisor 1 (high f), `factor` (low f), or in
    between 1 / ((1 - s) / factor + s) with s = (L / wavelen - low) / (high - low), and
    writes no rope.scaling metadata. s is linear in f, so two in-between points give its
    slope and intercept; that pins (L, low, high) up to a common scale, which we fix with
    the converter's own default L = 8192. The result is checked against the tensor.
    """
    r = divisors.double()
    dim = 2 * r.numel()
    freqs = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    factor = float(r.max())
    if factor <= 1 + 1e-6:
        return  # no scaling at all: plain RoPE
    config.rope_type = "llama3"
    config.rope_factor = factor
    config.rope_original_max_position_embeddings = 8192
    config.rope_low_freq_factor, config.rope_high_freq_factor = 1.0, 4.0  # Llama 3.x values
    middle = (r > 1 + 1e-6) & (r < factor * (1 - 1e-6))
    if int(middle.sum()) >= 2:
        s = (1 / r[middle] - 1 / factor) / (1 - 1 / factor)
        x = freqs[middle] / (2 * math.pi)
        slope = float((s[-1] - s[0]) / (x[-1] - x[0]))
        intercept = float(s[0] - slope * x[0])
        span = 8192 / slope  # high - low
        config.rope_low_freq_factor = -intercept * span
        config.rope_high_freq_factor = config.rope_low_freq_factor + span
    if not torch.allclose(_llama3_divisors(config, freqs), r, rtol=1e-4):
        raise ModelLoadError(path, "rope_freqs tensor does not follow llama3 RoPE scaling")


def _llama3_divisors(config: ModelConfig, freqs: torch.Tensor) -> torch.Tensor:
    # The formula of llama.cpp's converter and of transformers' _compute_llama3_parameters.
    L = config.rope_original_max_position_embeddings
    lo, hi = config.rope_low_freq_factor, config.rope_high_freq_factor
    wavelen = 2 * math.pi / freqs
    smooth = ((L / wavelen - lo) / (hi - lo)).clamp(0, 1)
    return 1 / ((1 - smooth) / config.rope_factor + smooth)
