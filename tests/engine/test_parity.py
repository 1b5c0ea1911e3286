"""Logit parity with Hugging Face transformers on tiny random models (fp32, ≤ 1e-4)."""

from __future__ import annotations

import torch
import transformers

from tiny_models import VOCAB

TOL = 1e-4


def test_prefill_and_decode_match_transformers(model_pair):
    hf, ours = model_pair
    assert ours.config.rope_type == ("llama3" if "rope" in ours.name else "default")
    torch.manual_seed(1)
    tokens = torch.randint(VOCAB, (2, 11))
    with torch.no_grad():
        out = hf(tokens, use_cache=True)
    cache = ours.native.new_cache(2, 11 + 16)
    logits = ours.native.forward(tokens, cache=cache)
    assert (logits - out.logits).abs().max().item() <= TOL
    # A logit scale that makes the tolerance meaningful.
    assert out.logits.abs().max().item() > 1.0

    past = out.past_key_values
    next_tokens = out.logits[:, -1].argmax(-1, keepdim=True)
    for step in range(16):
        with torch.no_grad():
            out = hf(next_tokens, past_key_values=past, use_cache=True)
        step_logits = ours.native.forward(next_tokens, cache=cache)
        diff = (step_logits - out.logits).abs().max().item()
        assert diff <= TOL, f"decode step {step}: max |Δ| = {diff}"
        past = out.past_key_values
        next_tokens = out.logits[:, -1].argmax(-1, keepdim=True)
    assert cache.lengths == [27, 27]


def test_greedy_generation_matches_transformers(model_pair):
    hf, ours = model_pair
    prompt = torch.randint(VOCAB, (1, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = hf.generate(prompt, max_new_tokens=20, do_sample=False, eos_token_id=None,
                               pad_token_id=0, generation_config=transformers.GenerationConfig())
    got = ours.generate([prompt[0].tolist()], max_new_tokens=20, stop_token_ids=[])[0]
    assert got.tokens == expected[0, 7:].tolist()
    assert got.finish_reason == "length"


def test_prefix_equals_tokens_in_context(model_pair):
    """Prompt X after a prefix made from the KV of T gives the logits of T + X in one
    sequence; two concatenated prefixes likewise."""
    _, ours = model_pair
    g = torch.Generator().manual_seed(3)
    doc, other, prompt = (torch.randint(VOCAB, (n,), generator=g) for n in (9, 5, 6))
    first = ours.native.prefix_from_tokens(doc)
    in_context = ours.native.forward(torch.cat([doc, prompt])[None])[0, 9:]
    with_prefix = ours.native.forward(prompt[None], prefixes=[[first]])[0]
    assert (with_prefix - in_context).abs().max().item() <= TOL

    # The second prefix: KV of `other` computed after `doc` (positions 9..13).
    cache = ours.native.new_cache(1, 14)
    ours.native.forward(torch.cat([doc, other])[None], cache=cache)
    import cartridges_core as core

    second = core.KVPrefix([k[0, :, 9:14].clone() for k in cache.keys], [v[0, :, 9:14].clone() for v in cache.values])
    in_context = ours.native.forward(torch.cat([doc, other, prompt])[None])[0, 14:]
    composed = ours.native.forward(prompt[None], prefixes=[[first, second]])[0]
    assert (composed - in_context).abs().max().item() <= TOL


def test_ragged_batch_equals_each_alone(model_pair):
    _, ours = model_pair
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(VOCAB, (n,), generator=g).tolist() for n in (3, 12, 7, 1)]
    batched = ours.generate(prompts, max_new_tokens=12, stop_token_ids=[])
    for prompt, result in zip(prompts, batched):
        alone = ours.generate([prompt], max_new_tokens=12, stop_token_ids=[])[0]
        assert result.tokens == alone.tokens


def test_seeded_sampling_repeats(model_pair):
    _, ours = model_pair
    kwargs = dict(max_new_tokens=16, temperature=1.0, top_p=0.9, top_k=50, stop_token_ids=[])
    a = ours.generate([[1, 2, 3]], seed=11, **kwargs)[0].tokens
    b = ours.generate([[1, 2, 3]], seed=11, **kwargs)[0].tokens
    c = ours.generate([[1, 2, 3]], seed=12, **kwargs)[0].tokens
    assert a == b
    assert a != c
