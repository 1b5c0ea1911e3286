"""Cartridges as Hugging Face PEFT `CARTRIDGE` adapters, out and in (docs/formats.md).

A PEFT cartridge adapter is a directory with `adapter_config.json` (`peft_type: "CARTRIDGE"`)
and `adapter_model.safetensors` holding one tensor, `prompt_embeddings`, of shape
`[num_virtual_tokens, num_layers * 2 * token_dim]`: per virtual token, for layer l, the keys at
`2l` and the values at `2l + 1`, each `[num_kv_heads, head_dim]` flattened (token_dim =
num_kv_heads * head_dim, after PEFT's adjustment for grouped-query attention). PEFT hands
them to the model as `past_key_values`; the keys are used as stored, already rotated at
positions 0..num_virtual_tokens-1, and the prompt's positions start after them. That is the
layout of our `Cartridge` (keys after RoPE at positions 0..num_tokens-1), so the conversion
is a reshape, exact in both directions.

PEFT itself is not needed to write or read these files."""

from __future__ import annotations

import json
import os
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from .cartridge import Cartridge, CartridgeFileError, model_fingerprint

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
LEGACY_WEIGHTS_NAME = "adapter_model.bin"  # PEFT's torch.save format, when saved without safetensors
PEFT_TYPE = "CARTRIDGE"


def save_peft(cartridge: Cartridge, directory: str | os.PathLike[str], *, base_model: str | None = None) -> Path:
    """Write `cartridge` as a PEFT CARTRIDGE adapter directory (created if needed); returns it.
    `base_model`: the Hugging Face id or path of the base model, recorded as
    `base_model_name_or_path` (PEFT's `AutoPeftModelForCausalLM` loads it from there)."""
    cartridge.check_exportable("a PEFT adapter")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    heads, tokens, head_dim = cartridge.keys[0].shape
    per_layer = [torch.stack([k.transpose(0, 1), v.transpose(0, 1)], 1)  # [tokens, 2, heads, head_dim]
                 for k, v in zip(cartridge.keys, cartridge.values)]
    embeddings = torch.cat(per_layer, 1).reshape(tokens, -1).contiguous()
    config = {
        "peft_type": PEFT_TYPE,
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "revision": None,
        "inference_mode": True,
        "num_virtual_tokens": tokens,
        "num_frozen_tokens": cartridge.num_frozen,
        "num_layers": cartridge.num_layers,
        "num_attention_heads": heads,  # the key-value heads: PEFT's grouped-query layout
        "token_dim": heads * head_dim,
        "num_transformer_submodules": 1,
        "modules_to_save": None,
    }
    (out / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
    metadata = {"format": "pt", "cartridges.fingerprint": cartridge.fingerprint}
    save_file({"prompt_embeddings": embeddings}, str(out / WEIGHTS_NAME), metadata=metadata)
    return out


def save_peft_zip(cartridge: Cartridge, path: str | os.PathLike[str], *, base_model: str | None = None) -> Path:
    """The adapter directory as a zip file (its two files at the archive's top level), for a
    download: unzip it into a directory and hand that to `PeftModel.from_pretrained`."""
    with tempfile.TemporaryDirectory() as scratch:
        directory = save_peft(cartridge, scratch, base_model=base_model)
        with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as archive:
            for name in (CONFIG_NAME, WEIGHTS_NAME):
                archive.write(directory / name, arcname=name)
    return Path(path)


def load_peft(directory: str | os.PathLike[str], model: Any | None = None) -> Cartridge:
    """Read a PEFT CARTRIDGE adapter directory as a `Cartridge`; with `model`, also check that it
    fits that model (layers, key-value heads, head size) and record the model's fingerprint."""
    path = Path(directory)
    config = _read_config(path)
    embeddings, fingerprint = _read_embeddings(path)
    if embeddings.dim() != 2:
        raise CartridgeFileError(path, f"prompt_embeddings must be 2-D, got {list(embeddings.shape)}")
    layers, heads, token_dim = (_count(path, config, k) for k in ("num_layers", "num_attention_heads", "token_dim"))
    tokens = _count(path, config, "num_virtual_tokens", embeddings.shape[0])
    frozen = _count(path, config, "num_frozen_tokens", 0)
    if heads < 1 or token_dim % heads:
        raise CartridgeFileError(path, f"token_dim {token_dim} is not a multiple of num_attention_heads {heads}")
    head_dim = token_dim // heads
    if tuple(embeddings.shape) != (tokens, layers * 2 * token_dim):
        raise CartridgeFileError(path, f"prompt_embeddings is {list(embeddings.shape)}, expected "
                               f"[{tokens}, {layers * 2 * token_dim}] (num_virtual_tokens, num_layers*2*token_dim)")
    if _count(path, config, "num_transformer_submodules", 1) != 1:
        raise CartridgeFileError(path, "only decoder-only adapters (num_transformer_submodules 1) are supported")
    kv = embeddings.reshape(tokens, layers * 2, heads, head_dim).permute(1, 2, 0, 3)  # [2L, heads, tokens, dim]
    try:
        cartridge = Cartridge([kv[2 * i].contiguous() for i in range(layers)],
                              [kv[2 * i + 1].contiguous() for i in range(layers)],
                              num_frozen=min(frozen, tokens), fingerprint=fingerprint,
                              config={"imported_from": "peft", "base_model": config.get("base_model_name_or_path")})
    except ValueError as error:
        raise CartridgeFileError(path, str(error)) from None
    if model is not None:
        cartridge.check_model(model, path)
        cartridge.fingerprint = model_fingerprint(model)
    return cartridge


def _count(path: Path, config: dict[str, Any], key: str, default: int | None = None) -> int:
    """A non-negative integer of the adapter's config (`default` when absent or null)."""
    value = config.get(key)
    if value is None and default is not None:
        return int(default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise CartridgeFileError(path, f"{CONFIG_NAME}: {key} must be a non-negative integer, got {value!r}")
    return value


def _read_config(path: Path) -> dict[str, Any]:
    try:
        config = json.loads((path / CONFIG_NAME).read_text())
    except FileNotFoundError:
        raise CartridgeFileError(path, f"no {CONFIG_NAME}: not a PEFT adapter directory") from None
    except (OSError, ValueError) as error:
        raise CartridgeFileError(path, f"{CONFIG_NAME} is not readable JSON: {error}") from None
    if not isinstance(config, dict) or config.get("peft_type") != PEFT_TYPE:
        kind = config.get("peft_type") if isinstance(config, dict) else None
        raise CartridgeFileError(path, f"a {kind} adapter, not a {PEFT_TYPE} one")
    return config


def _read_embeddings(path: Path) -> tuple[torch.Tensor, str]:
    """`prompt_embeddings`, and the fingerprint this package wrote ("" from elsewhere)."""
    try:
        if (path / WEIGHTS_NAME).exists():
            from safetensors import safe_open

            with safe_open(str(path / WEIGHTS_NAME), "pt") as handle:
                fingerprint = (handle.metadata() or {}).get("cartridges.fingerprint", "")
            tensors = load_file(str(path / WEIGHTS_NAME))
        elif (path / LEGACY_WEIGHTS_NAME).exists():
            tensors, fingerprint = torch.load(str(path / LEGACY_WEIGHTS_NAME), map_location="cpu",
                                              weights_only=True), ""
        else:
            raise CartridgeFileError(path, f"no {WEIGHTS_NAME} (nor {LEGACY_WEIGHTS_NAME})")
    except CartridgeFileError:
        raise
    except Exception as error:  # safetensors and torch raise many kinds for a damaged file
        raise CartridgeFileError(path, f"the adapter's weights are not readable: {error}") from None
    if not isinstance(tensors, dict) or "prompt_embeddings" not in tensors:
        raise CartridgeFileError(path, "the adapter's weights hold no prompt_embeddings")
    return tensors["prompt_embeddings"].detach(), fingerprint
