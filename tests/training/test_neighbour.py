"""Composition training: the neighbour's conversations and how they join a corpus's."""

from __future__ import annotations

import pytest
import torch

import cartridges_core
from cartridges.selfstudy import TrainConfig
from cartridges.selfstudy.neighbour import NEIGHBOUR_TEXT, make_neighbour, neighbour_samples, with_neighbour

from .tiny import tiny_model

# The character-level tokenizer makes the neighbour ~2,700 tokens: a context that holds it.
CONTEXT = 8192


def neighbour_config(**kw) -> TrainConfig:
    base = dict(num_tokens=24, num_samples=8, teacher_tokens=4096, synthesis_batch_size=4, max_question_tokens=10,
                max_answer_tokens=14, top_k=5, seed=3, written_fraction=0.5)
    base.update(kw)
    return TrainConfig(**base)


@pytest.fixture(scope="module")
def model():
    return tiny_model(context=CONTEXT)


def test_neighbour_rows_behind_its_kv_are_the_teacher(model):
    """With the neighbour's KV in front and no cartridge, the student's top-k at every target is
    the teacher's: a cartridge that draws no attention from these questions has nothing to learn
    from them, one that does is pulled back."""
    config = neighbour_config()
    neighbour = make_neighbour(model, config, 8, config.num_tokens)
    assert neighbour is not None and neighbour.data is not None
    data = neighbour.data
    assert data.tokens.shape[0] == 8
    assert neighbour.companion.num_tokens > len(model.tokenizer.encode(NEIGHBOUR_TEXT))  # the text in its prompt
    starts = data.target_mask.sum(1).cumsum(0) - data.target_mask.sum(1)
    for r in range(8):
        n = int(data.lengths[r])
        logits = model.core.forward(data.tokens[r : r + 1, :n], prefixes=[[neighbour.companion]])[0]
        targets = data.target_mask[r, :n].nonzero().flatten()
        values, ids = torch.log_softmax(logits[targets], -1).topk(config.top_k, -1)
        first = int(starts[r])
        torch.testing.assert_close(data.topk_logprobs[first : first + len(targets)], values, rtol=1e-4, atol=1e-4)
        assert torch.equal(data.topk_ids[first : first + len(targets), 0], ids[:, 0])


def test_neighbour_is_made_once_per_model(model):
    config = neighbour_config()
    first = make_neighbour(model, config, 8, config.num_tokens)
    # Training-only settings do not change it; what synthesis reads does.
    assert make_neighbour(model, neighbour_config(lr=1e-3, epochs=5), 8, config.num_tokens) is first
    assert make_neighbour(model, neighbour_config(seed=4), 8, config.num_tokens) is not first


def test_neighbour_is_left_out_where_it_does_not_fit():
    small = tiny_model(context=1024)
    assert make_neighbour(small, neighbour_config(), 8, 24) is None
    # A teacher window too short to read it whole: left out too.
    model = tiny_model(context=CONTEXT)
    assert make_neighbour(model, neighbour_config(teacher_tokens=512), 8, 24) is None


def test_with_neighbour_flags_every_nth_corpus_row_and_every_neighbour_row(model):
    config = neighbour_config()
    neighbour = make_neighbour(model, config, 8, config.num_tokens)
    n, width = 7, 5
    tokens = torch.randint(4, 90, (n, width))
    mask = torch.zeros(n, width, dtype=torch.bool)
    mask[:, 1] = True
    corpus = cartridges_core.TrainingData(tokens, torch.full((n,), width, dtype=torch.long), mask,
                                          torch.zeros(n, config.top_k, dtype=torch.long),
                                          torch.zeros(n, config.top_k))
    joined = with_neighbour(corpus, neighbour, companion_every=3)
    m = neighbour.data.tokens.shape[0]
    assert joined.tokens.shape == (n + m, max(width, neighbour.data.tokens.shape[1]))
    assert joined.with_companion.tolist() == [r % 3 == 0 for r in range(n)] + [True] * m
    assert torch.equal(joined.tokens[:n, :width], tokens) and torch.equal(joined.tokens[n:], neighbour.data.tokens)
    assert joined.topk_ids.shape[0] == n + neighbour.data.topk_ids.shape[0]
    joined.validate(model.config.vocab_size)
    # companion_every=0: the neighbour's rows only.
    assert with_neighbour(corpus, neighbour, 0).with_companion.tolist() == [False] * n + [True] * m


def test_neighbour_samples_follow_the_fraction():
    assert neighbour_samples(TrainConfig(num_samples=256)) == 64  # the default quarter
    assert neighbour_samples(TrainConfig(num_samples=256, neighbour_fraction=0)) == 0
    assert neighbour_samples(TrainConfig(num_samples=8, neighbour_fraction=0.1)) == 16  # at least one batch
    assert neighbour_samples(TrainConfig(num_samples=8192)) == 2048
    with pytest.raises(ValueError, match="neighbour_fraction"):
        TrainConfig(neighbour_fraction=1.5)
