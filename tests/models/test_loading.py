"""Model loading: HF directories and GGUF files against transformers, and damaged files.
The default GGUF against transformers: test_default_gguf.py."""

from __future__ import annotations


import jinja2
import pytest
import torch
from transformers import (
    AutoTokenizer,
)

from model_files import hf_config, make_hf_model, write_gguf
from model_texts import CHATS, TEXTS
from cartridges.models import (
    ModelConfig,
    ModelLoadError,
    load_hf_dir,
    load_weights,
)

# ---------------------------------------------------------------------------------------
# Tiny Hugging Face models


HF_CASES = {
    "llama-llama3rope": dict(arch="llama"),
    "qwen2-tied-bf16": dict(arch="qwen2", dtype=torch.bfloat16, template_in_config=True),
    "qwen3-sharded": dict(arch="qwen3", shard=True),
}


@pytest.mark.parametrize("case", HF_CASES)
def test_hf_dir_matches_transformers(case, tiny_tokenizer, tmp_path):
    kw = HF_CASES[case]
    expected = make_hf_model(tokenizer=tiny_tokenizer, out=tmp_path, **kw)
    if kw.get("shard"):
        assert (tmp_path / "model.safetensors.index.json").is_file()
        assert len(list(tmp_path.glob("*.safetensors"))) > 1
    loaded = load_weights(tmp_path)
    cfg = loaded.config

    if cfg.tie_word_embeddings:
        expected.pop("lm_head.weight")
    assert set(loaded.tensors) == set(expected)
    for name, tensor in expected.items():
        assert loaded.tensors[name].dtype == torch.float32
        assert torch.equal(loaded.tensors[name], tensor), name

    arch = kw["arch"]
    assert cfg.architecture == arch
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size) == (tiny_tokenizer.get_vocab_size(), 64, 256)
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == (2, 4, 2)
    assert cfg.head_dim == {"llama": 32, "qwen2": 16, "qwen3": 24}[arch]
    assert cfg.rms_norm_eps == pytest.approx(1e-5)
    assert cfg.attention_bias == (arch == "qwen2")
    assert cfg.qk_norm == (arch == "qwen3")
    assert cfg.tie_word_embeddings == (arch == "qwen2")
    assert cfg.max_position_embeddings == 131072
    assert cfg.bos_token_id == 1
    assert cfg.eos_token_ids[0] == 2 and 0 in cfg.eos_token_ids  # + <|endoftext|>
    if arch == "llama":
        assert (cfg.rope_type, cfg.rope_theta, cfg.rope_factor) == ("llama3", 10000.0, 8.0)
        assert (cfg.rope_low_freq_factor, cfg.rope_high_freq_factor) == (1.0, 4.0)
        assert cfg.rope_original_max_position_embeddings == 8192
    else:
        assert cfg.rope_type == "default"
        assert cfg.rope_theta == (1e6 if arch == "qwen2" else 10000.0)
    d = cfg.to_dict()
    assert all(type(v) in (int, float, bool, str) for k, v in d.items() if k != "eos_token_ids")

    reference = AutoTokenizer.from_pretrained(tmp_path)
    ours = loaded.tokenizer
    for text in TEXTS:
        assert ours.encode(text) == reference.encode(text, add_special_tokens=False), text
    for chat in CHATS:
        want = reference.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)["input_ids"]
        assert ours.encode_chat(chat) == want
    if arch == "llama":
        assert ours.render_chat(CHATS[0]).startswith("<|im_start|><|im_start|>user")  # bos_token
        with pytest.raises(jinja2.TemplateError, match="bad role"):
            ours.render_chat([{"role": "robot", "content": "x"}])


def test_config_mapping_variants():
    base = dict(vocab_size=10, hidden_size=64, intermediate_size=8, num_hidden_layers=1,
                num_attention_heads=8)
    # Hub-style llama config: top-level rope_theta, rope_scaling with "rope_type"
    cfg = ModelConfig.from_hf_dict(
        dict(base, architectures=["LlamaForCausalLM"], rope_theta=500000.0,
             eos_token_id=[128001, 128008, 128009], rope_scaling=dict(
                 rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                 original_max_position_embeddings=8192)), "x")
    assert (cfg.rope_type, cfg.rope_theta, cfg.rope_factor) == ("llama3", 500000.0, 32.0)
    assert (cfg.num_kv_heads, cfg.head_dim, cfg.eos_token_ids) == (8, 8, [128001, 128008, 128009])
    # model_type is enough when architectures is absent
    assert ModelConfig.from_hf_dict(dict(base, model_type="qwen3"), "x").qk_norm
    with pytest.raises(ModelLoadError, match="unsupported rope type 'yarn'"):
        ModelConfig.from_hf_dict(dict(base, model_type="qwen2", rope_scaling=dict(type="yarn", factor=4.0)), "x")


# ---------------------------------------------------------------------------------------
# GGUF files we write ourselves, the way llama.cpp's converter writes them

@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_gguf_round_trip(arch, tiny_tokenizer, tmp_path):
    hf_dir = tmp_path / "hf"
    state = make_hf_model(arch, tiny_tokenizer, hf_dir)
    hf_cfg = hf_config(arch, tiny_tokenizer.get_vocab_size())
    expected = write_gguf(tmp_path / "m.gguf", arch, state, tiny_tokenizer, hf_cfg)
    loaded = load_weights(tmp_path / "m.gguf")
    assert set(loaded.tensors) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(loaded.tensors[name], tensor), name
    # Same config as from the HF directory (eos ids aside: config.json says only 2 there).
    from_dir = load_hf_dir(hf_dir).config
    for field in ("architecture", "vocab_size", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
                  "attention_bias", "qk_norm", "tie_word_embeddings", "rope_type", "rope_theta",
                  "rope_factor", "rope_original_max_position_embeddings", "max_position_embeddings"):
        assert getattr(loaded.config, field) == pytest.approx(getattr(from_dir, field)), field
    assert loaded.config.rope_low_freq_factor == pytest.approx(from_dir.rope_low_freq_factor, rel=1e-4)
    assert loaded.config.rope_high_freq_factor == pytest.approx(from_dir.rope_high_freq_factor, rel=1e-4)

    reference = AutoTokenizer.from_pretrained(tmp_path, gguf_file="m.gguf")
    for text in TEXTS:
        assert loaded.tokenizer.encode(text) == reference.encode(text, add_special_tokens=False), text
