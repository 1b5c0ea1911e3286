"""The default GGUF (SmolLM2-135M-Instruct, Q4_1) against transformers' GGUF loader: its
tensors, its tokenizer and chat template, and the tokenizer's streaming decode."""

from __future__ import annotations

import random

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig
from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS

from cartridges.models import default_model_path, load_gguf
from model_texts import CHATS, TEXTS


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
    # Any ids at all (special tokens, bytes that are not UTF-8), with special tokens skipped or not.
    rng = random.Random(0)
    for _ in range(300):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 24))]
        for skip in (True, False):
            stream = tok.stream_decoder(skip)
            assert "".join(stream.feed(i) for i in ids) + stream.flush() == tok.decode(ids, skip), ids
