"""Tiny models written to disk the ways users bring them: a BPE tokenizer, Hugging Face
directories (llama with llama3 RoPE, qwen2, qwen3) and GGUF files written the way llama.cpp's
converter writes them. The loading tests build every file they read with these."""

from __future__ import annotations

import json
import math
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from model_texts import CHATS, TEXTS

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


def make_tiny_tokenizer() -> Tokenizer:
    """A byte-level BPE of 400 tokens trained on the test texts, with ChatML's specials."""
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


def hf_config(arch: str, vocab_size: int):
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


MODEL_CLASSES = {"llama": LlamaForCausalLM, "qwen2": Qwen2ForCausalLM, "qwen3": Qwen3ForCausalLM}


def make_hf_model(arch: str, tokenizer: Tokenizer, out: Path, *, dtype=torch.float32,
                  shard: bool = False, template_in_config: bool = False) -> dict[str, torch.Tensor]:
    """Save a random tiny model + tokenizer to `out`; return its state dict as float32."""
    torch.manual_seed(0)
    model = MODEL_CLASSES[arch](hf_config(arch, tokenizer.get_vocab_size()))
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


# Longer than 60 lines: every key and tensor llama.cpp's converter writes, in its order.
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
