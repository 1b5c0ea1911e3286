"""The fixed-shape decode step (the path CUDA graphs replay, engine/fixed_decode.h) checked on
CPU, where it runs eagerly: rows, prefix keys and own keys padded to buckets, every cartridge
copied into one slab, and still the same tokens and log-probabilities as the packed step."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import cartridges_core as core
from cartridges import Engine
from tiny_models import VOCAB, build_pair


@pytest.fixture(scope="module")
def model():
    return build_pair("llama", seed=7)[1]


def random_prefix(model, tokens: int, seed: int, biases: bool = False):
    """A cartridge of `tokens` random tokens' KV; with `biases`, random attention biases."""
    g = torch.Generator().manual_seed(seed)
    prefix = model.native.prefix_from_tokens(torch.randint(VOCAB, (tokens,), generator=g))
    if not biases:
        return prefix
    bias = [torch.randn(k.shape[:2], generator=g) for k in prefix.keys]
    return core.KVPrefix(list(prefix.keys), list(prefix.values), bias)


def run(engine: Engine, prompts, prefixes, max_new_tokens=12, composition="mixture"):
    streams = [engine.submit(p, prefixes=c, max_new_tokens=max_new_tokens, stop_token_ids=[], logprobs=1,
                             composition=composition)
               for p, c in zip(prompts, prefixes)]
    out = []
    for s in streams:
        deltas = list(s)
        out.append(([d.token for d in deltas], torch.tensor([d.logprob.logprob for d in deltas])))
    return out


def assert_same(got, expected):
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, expected):
        assert tokens == want_tokens
        assert torch.allclose(logprobs, want_logprobs, atol=1e-4), (logprobs - want_logprobs).abs().max()


def test_fixed_shape_decode_equals_the_packed_step(model):
    """Rows with their own cartridge, rows sharing one, a cartridge with attention biases, two
    cartridges concatenated, a mixture and a row without any, decoding together past the first
    key bucket (64): the same tokens and log-probabilities as the default path."""
    shared = random_prefix(model, 20, 1)
    own = [random_prefix(model, n, 10 + n) for n in (5, 33, 70)]
    biased = random_prefix(model, 9, 2, biases=True)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(VOCAB, (n,), generator=g).tolist() for n in (4, 9, 60, 3, 17, 30, 7, 12)]
    prefixes = [[shared], [shared], [own[0]], [own[1]], [own[2]], [biased], [], [own[0], biased]]
    fixed = Engine(model, kv_tokens=4096, fixed_shape_decode=True)
    plain = Engine(model, kv_tokens=4096)
    try:
        expected = run(plain, prompts, prefixes, max_new_tokens=20)
        got = run(fixed, prompts, prefixes, max_new_tokens=20)
        assert_same(got, expected)
        expected = run(plain, prompts[-2:], [prefixes[-1]] * 2, composition="concatenate")
        got = run(fixed, prompts[-2:], [prefixes[-1]] * 2, composition="concatenate")
        assert_same(got, expected)
        stats = fixed.stats()
        assert stats.fixed_shape_steps > 0 and stats.cuda_graph_captures == 0
        assert plain.stats().fixed_shape_steps == 0
    finally:
        fixed.close()
        plain.close()


def test_cartridges_that_come_and_go_refill_the_slab(model):
    """Requests one after another, each with a new 300-token cartridge: the slab (1,024 rows at
    first) fills, is refilled with the cartridges in use and grows for a step that needs more,
    and every answer stays the packed step's."""
    fixed = Engine(model, kv_tokens=8192, fixed_shape_decode=True)
    plain = Engine(model, kv_tokens=8192)
    try:
        prompt = [3, 1, 4, 1, 5]
        for i in range(5):
            cartridge = [random_prefix(model, 300, 100 + i)]
            assert_same(run(fixed, [prompt], [cartridge], max_new_tokens=6),
                        run(plain, [prompt], [cartridge], max_new_tokens=6))
        many = [[random_prefix(model, 300, 200 + i)] for i in range(4)]  # 1,200 rows in one step
        assert_same(run(fixed, [prompt] * 4, many, max_new_tokens=6), run(plain, [prompt] * 4, many, max_new_tokens=6))
    finally:
        fixed.close()
        plain.close()


def test_cuda_graphs_are_off_on_cpu(model):
    engine = Engine(model, kv_tokens=1024, cuda_graphs=True)
    try:
        run(engine, [[1, 2, 3]], [[]], max_new_tokens=4)
        stats = engine.stats()
        assert stats.fixed_shape_steps == 0 and stats.cuda_graph_captures == 0
    finally:
        engine.close()


def test_a_cartridge_no_one_holds_is_let_go_at_the_next_step(model):
    """The fixed-shape path copies each cartridge a step reads into its slab and holds it there
    (so that its address cannot come back as another cartridge's). Once its requests have ended
    and no one else holds it, the next step lets it go: its memory does not wait for the slab
    to be refilled. Seen through a weak reference to one of its key tensors."""
    engine = Engine(model, kv_tokens=4096, fixed_shape_decode=True)
    try:
        kept, dropped = random_prefix(model, 20, 1), random_prefix(model, 24, 2)
        kept_keys, dropped_keys = weakref.ref(kept.keys[0]), weakref.ref(dropped.keys[0])
        first = run(engine, [[5, 6, 7], [8, 9]], [[kept], [dropped]])
        del dropped
        gc.collect()
        assert dropped_keys() is not None  # still in the slab until a step runs
        run(engine, [[5, 6, 8]], [[]])
        gc.collect()
        assert dropped_keys() is None and kept_keys() is not None
        assert_same(run(engine, [[5, 6, 7]], [[kept]]), first[:1])  # what stays is read as before
    finally:
        engine.close()
