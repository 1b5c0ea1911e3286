"""The engine on CUDA in bfloat16 (skipped without a GPU): the forward against transformers
in float32, and the engine's own guarantees (requests batched equal each alone, a cartridge
equals its text in context, log-probabilities equal a full forward's)."""

from __future__ import annotations

import pytest
import torch

from cartridges import Engine
from tiny_models import VOCAB, build_pair, requests_across_a_compaction

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def pair(request):
    hf, model = build_pair(request.param, device="cuda")
    assert model.device.startswith("cuda") and model.dtype == "bfloat16"
    return hf, model


def test_forward_as_close_to_float32_as_transformers_in_bfloat16(pair):
    """bfloat16 keeps ~3 significant digits: the reference for our error against float32 is
    transformers' own error when it runs in bfloat16 on the same GPU."""
    hf, model = pair
    tokens = torch.randint(VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        exact = hf(tokens).logits
        theirs = hf.to("cuda", torch.bfloat16)(tokens.cuda()).logits.float().cpu()
        hf.to("cpu", torch.float32)
    ours = model.native.forward(tokens).float().cpu()
    scale = exact.abs().max()
    our_error, their_error = (ours - exact).abs().max() / scale, (theirs - exact).abs().max() / scale
    assert our_error < 0.05 and our_error <= 2 * their_error + 0.005, (float(our_error), float(their_error))


def test_batched_requests_equal_each_alone(pair):
    _, model = pair
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(VOCAB, (n,), generator=g).tolist() for n in (3, 17, 9, 30)]
    batched = model.generate(prompts, max_new_tokens=12, stop_token_ids=[])
    for prompt, got in zip(prompts, batched):
        alone = model.generate([prompt], max_new_tokens=12, stop_token_ids=[])[0]
        assert got.tokens == alone.tokens


def test_cartridge_equals_its_text_in_context(pair):
    _, model = pair
    doc = torch.randint(VOCAB, (12,), generator=torch.Generator().manual_seed(2))
    prefix = model.native.prefix_from_tokens(doc.cuda())
    prompt = [5, 6, 7, 8]
    with_cartridge = model.generate([prompt], prefixes=[prefix], max_new_tokens=10, stop_token_ids=[], logprobs=1)[0]
    in_context = model.generate([doc.tolist() + prompt], max_new_tokens=10, stop_token_ids=[], logprobs=1)[0]
    a = torch.tensor([lp.logprob for lp in with_cartridge.logprobs])
    b = torch.tensor([lp.logprob for lp in in_context.logprobs])
    assert with_cartridge.tokens[:3] == in_context.tokens[:3]
    assert torch.allclose(a[:3], b[:3], atol=0.1)


def test_logprobs_close_to_a_full_forward(pair):
    _, model = pair
    prompt = [3, 1, 4, 1, 5, 9]
    completion = model.generate([prompt], max_new_tokens=6, stop_token_ids=[], logprobs=3)[0]
    full = torch.log_softmax(model.native.forward(torch.tensor([prompt + completion.tokens]))[0].float(), -1).cpu()
    for i, lp in enumerate(completion.logprobs):
        assert lp.logprob == pytest.approx(full[len(prompt) - 1 + i, lp.token].item(), abs=0.1)


def test_mixture_of_two_cartridges_close_to_the_bayesian_mixture_of_full_forwards(pair):
    _, model = pair
    g = torch.Generator().manual_seed(5)
    docs = [torch.randint(VOCAB, (n,), generator=g) for n in (8, 11)]
    kv = [model.native.prefix_from_tokens(d.cuda()) for d in docs]
    prompt = torch.randint(VOCAB, (20,), generator=g).tolist()
    mixed = model.generate([prompt], prefixes=kv, max_new_tokens=6, stop_token_ids=[], logprobs=1)[0]
    text = prompt + mixed.tokens
    each = []
    for doc in docs:
        logits = model.native.forward(torch.tensor([doc.tolist() + text]))[0, len(doc):-1].float().cpu()
        each.append(torch.log_softmax(logits, -1).gather(1, torch.tensor(text[1:])[:, None])[:, 0])
    each = torch.stack(each).double()
    before = torch.cat([torch.zeros(2, 1, dtype=torch.float64), each.cumsum(1)[:, :-1]], 1)
    mixture = torch.logsumexp(before + each, 0) - torch.logsumexp(before, 0)
    got = torch.tensor([lp.logprob for lp in mixed.logprobs], dtype=torch.float64)
    assert torch.allclose(got, mixture[len(prompt) - 1:], atol=0.1)
    twice = model.generate([prompt], prefixes=[kv[0], kv[0]], max_new_tokens=6, stop_token_ids=[])[0]
    single = model.generate([prompt], prefixes=[kv[0]], max_new_tokens=6, stop_token_ids=[])[0]
    assert twice.tokens == single.tokens


def test_requests_get_what_they_get_alone_across_a_pool_compaction(pair):
    """The running requests' KV (a mixture's two sequences included) moves on the device."""
    requests_across_a_compaction(pair[1], seed=9, device="cuda")


def test_decode_steps_replay_cuda_graphs_with_the_eager_steps_numbers(pair):
    """Decode steps replay CUDA graphs by default. A replay runs the eager fixed-shape step's
    kernels on the same shapes: the same tokens, log-probabilities within bfloat16's rounding
    (cuBLAS may choose another algorithm under capture). Against the packed step (no graphs),
    which rounds a shared cartridge's attention differently, the first tokens agree too."""
    _, model = pair
    g = torch.Generator().manual_seed(11)
    shared = model.native.prefix_from_tokens(torch.randint(VOCAB, (20,), generator=g).cuda())
    own = [model.native.prefix_from_tokens(torch.randint(VOCAB, (n,), generator=g).cuda()) for n in (5, 70)]
    prompts = [torch.randint(VOCAB, (n,), generator=g).tolist() for n in (4, 9, 60, 3, 17)]
    prefixes = [[shared], [shared], [own[0]], [own[1]], []]

    def run(**options):
        engine = Engine(model, kv_tokens=4096, **options)
        try:  # submitted together: every run takes the same steps
            streams = engine.submit_many(prompts, prefixes=prefixes, max_new_tokens=24, stop_token_ids=[], logprobs=1)
            return [[(d.token, d.logprob.logprob) for d in s] for s in streams], engine.stats()
        finally:
            engine.close()

    def assert_close(ours, theirs, tokens, atol):
        for a, b in zip(ours, theirs):
            assert [t for t, _ in a[:tokens]] == [t for t, _ in b[:tokens]]
            assert all(abs(x[1] - y[1]) < atol for x, y in zip(a[:tokens], b[:tokens]))

    graphed, stats = run()
    assert stats.cuda_graph_captures > 0 and stats.fixed_shape_steps > 0
    eager, eager_stats = run(cuda_graphs=False, fixed_shape_decode=True)
    assert eager_stats.cuda_graph_captures == 0 and eager_stats.fixed_shape_steps > 0
    print("graph replays equal the eager fixed-shape steps to the bit:", graphed == eager)
    assert_close(graphed, eager, 12, 0.05)
    packed, packed_stats = run(cuda_graphs=False)
    assert packed_stats.fixed_shape_steps == 0
    assert_close(graphed, packed, 3, 0.1)
