"""Load a Hugging Face model directory: config.json, *.safetensors, tokenizer files."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from tokenizers import Tokenizer

from .config import ModelConfig, _id_list
from .errors import ModelLoadError
from .loaded import LoadedModel, check_tensors, merge_ids
from .tokenizer import ChatTokenizer

_INDEX_FILE = "model.safetensors.index.json"


def load_hf_dir(path: str | os.PathLike[str]) -> LoadedModel:
    root = Path(path)
    if not root.is_dir():
        raise ModelLoadError(root, "not a directory")
    config = ModelConfig.from_hf_dict(_read_json(root / "config.json"), root / "config.json")
    # generation_config.json often lists more stop ids than config.json (Llama 3.x: eot_id).
    generation = root / "generation_config.json"
    if generation.is_file():
        config.eos_token_ids = merge_ids(
            config.eos_token_ids, _id_list(_read_json(generation).get("eos_token_id"))
        )
    tokenizer = _load_tokenizer(root, stop_token_ids=config.eos_token_ids)
    config.eos_token_ids = merge_ids(config.eos_token_ids, tokenizer.eos_token_ids)
    tensors = _load_tensors(root, config)
    return LoadedModel(config=config, tensors=tensors, tokenizer=tokenizer, source=root)


def _load_tensors(root: Path, config: ModelConfig) -> dict[str, torch.Tensor]:
    wanted = config.expected_tensors()
    index = root / _INDEX_FILE
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ModelLoadError(index, "no 'weight_map' object")
        # Only the shards holding wanted tensors are opened; a name absent from the map is
        # reported as missing by check_tensors below.
        files: dict[Path, list[str]] = {}
        for name in wanted:
            if name in weight_map:
                files.setdefault(root / weight_map[name], []).append(name)
    else:
        single = root / "model.safetensors"
        shards = [single] if single.is_file() else sorted(root.glob("*.safetensors"))
        if not shards:
            raise ModelLoadError(root, "no *.safetensors file")
        files = {shard: list(wanted) for shard in shards}

    tensors: dict[str, torch.Tensor] = {}
    origin: dict[str, str] = {}
    for file, names in files.items():
        if not file.is_file():
            raise ModelLoadError(file, "file not found (listed in " + _INDEX_FILE + ")")
        try:
            with safe_open(file, framework="pt") as f:
                present = set(f.keys())
                for name in names:
                    if name in present:
                        # bf16/f16 checkpoints become float32: the CPU path computes in fp32.
                        tensors[name] = f.get_tensor(name).to(torch.float32).contiguous()
                        origin[name] = str(file)
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise ModelLoadError(file, f"corrupt or truncated safetensors file ({e})") from e
    check_tensors(config, tensors, index if index.is_file() else root, origin)
    return tensors


def _load_tokenizer(root: Path, stop_token_ids: list[int]) -> ChatTokenizer:
    tokenizer_file = root / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise ModelLoadError(tokenizer_file, "file not found")
    try:
        tokenizer = Tokenizer.from_file(str(tokenizer_file))
    except Exception as e:  # the Rust library raises a bare Exception on a bad file
        raise ModelLoadError(tokenizer_file, f"invalid tokenizer file ({e})") from e

    config_file = root / "tokenizer_config.json"
    tok_config = _read_json(config_file) if config_file.is_file() else {}
    return ChatTokenizer(
        tokenizer,
        _chat_template(root, tok_config),
        bos_token=_token_text(tok_config.get("bos_token")),
        eos_token=_token_text(tok_config.get("eos_token")),
        unk_token=_token_text(tok_config.get("unk_token")),
        pad_token=_token_text(tok_config.get("pad_token")),
        stop_token_ids=stop_token_ids,
    )


def _chat_template(root: Path, tok_config: dict[str, Any]) -> str | None:
    # Newer transformers save the template as chat_template.jinja; it wins over the
    # copy in tokenizer_config.json, as in transformers.
    jinja_file = root / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = tok_config.get("chat_template")
    if isinstance(template, list):
        # Several named templates: [{"name": "default", "template": "..."}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _token_text(value: Any) -> str | None:
    # A special token is written either as its text or as a serialized AddedToken.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelLoadError(path, "file not found") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(path, f"invalid JSON ({e})") from e
    if not isinstance(data, dict):
        raise ModelLoadError(path, "expected a JSON object")
    return data
