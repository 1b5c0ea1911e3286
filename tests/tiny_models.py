"""Tiny random Hugging Face models, and our engine built on the very same weights.

Shared by the test suites (tests/ is on pytest's pythonpath)."""

from __future__ import annotations

import torch
import transformers

from cartridges import Model
from cartridges.models import ModelConfig

VOCAB = 256


def tiny_hf_config(kind: str) -> transformers.PretrainedConfig:
    common = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
        initializer_range=0.2,  # large enough that logits differ in earnest
    )
    if kind == "llama":
        return transformers.LlamaConfig(**common, tie_word_embeddings=False)
    if kind == "llama-tied":
        return transformers.LlamaConfig(**common, tie_word_embeddings=True)
    if kind == "llama3-rope":
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
        return transformers.LlamaConfig(**common, rope_parameters=rope, tie_word_embeddings=True)
    if kind == "qwen2":
        return transformers.Qwen2Config(**common, tie_word_embeddings=False)
    if kind == "qwen3":
        return transformers.Qwen3Config(**common, head_dim=32, tie_word_embeddings=True)  # head_dim != hidden/heads
    raise ValueError(kind)


KINDS = ["llama", "llama-tied", "llama3-rope", "qwen2", "qwen3"]


def build_pair(kind: str, seed: int = 0, device: str = "cpu") -> tuple[transformers.PreTrainedModel, Model]:
    torch.manual_seed(seed)
    hf_config = tiny_hf_config(kind)
    hf = transformers.AutoModelForCausalLM.from_config(hf_config, attn_implementation="eager").eval()
    # Biases and norm weights start at 0 / 1: randomize them so that they are really checked.
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    config = ModelConfig.from_hf_dict(hf_config.to_dict(), f"<tiny {kind}>")
    tensors = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    return hf, Model(config, tensors, None, name=f"tiny-{kind}", device=device)



def requests_across_a_compaction(model: Model, seed: int, composition: str = "mixture",
                                 device: str = "cpu") -> None:
    """Four requests whose last fits the pool's free slots only once the first ends, and none of
    its free ranges, so that the running requests' KV (a two-cartridge request's two sequences
    included) moves: each gets what it gets alone."""
    from cartridges import Engine

    g = torch.Generator().manual_seed(seed)
    cartridges = [model.native.prefix_from_tokens(torch.randint(VOCAB, (n,), generator=g).to(device))
                  for n in (6, 4)]
    specs = [(4, 10, []), (5, 25, cartridges), (3, 30, []), (6, 52, [])]  # 14, 2 x 30, 33 and 58 of 160 slots
    prompts = [torch.randint(VOCAB, (n,), generator=g).tolist() for n, _, _ in specs]
    engine = Engine(model, kv_tokens=160, cache_openings=False)
    try:
        streams = [engine.submit(p, prefixes=pre, max_new_tokens=m, stop_token_ids=[], composition=composition)
                   for p, (_, m, pre) in zip(prompts, specs)]
        got = [[d.token for d in s] for s in streams]
        assert engine.stats().kv_compactions == 1
    finally:
        engine.close()
    for p, (_, m, pre), tokens in zip(prompts, specs, got):
        assert tokens == model.generate([p], prefixes=pre, max_new_tokens=m, stop_token_ids=[],
                                        composition=composition)[0].tokens
