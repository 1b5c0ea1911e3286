"""Attention-matching compaction (cartridges.selfstudy.compaction): RoPE moves keys between
positions exactly; the compact KV keeps the sink, covers every window, and reproduces the
corpus' attention outputs better than the corpus' first tokens do."""

from __future__ import annotations

import math

import pytest
import torch

import cartridges
import cartridges_core
from cartridges import TrainConfig
from cartridges.training import CheckpointMismatch, TrainingCancelled
from cartridges.selfstudy.chunking import Corpus
from cartridges.selfstudy.compaction import compact_prefix, window_shares

from .tiny import CharTokenizer

TEXT = ("The lighthouse keeper Arven logs each ship. Ferries cross at nine and at four. The mill by the river "
        "grinds rye on Tuesdays. Salt comes from the eastern flats in June. ") * 4


def test_rotation_moves_keys_between_positions(model) -> None:
    keys = model.native.prefix_from_tokens(torch.tensor(CharTokenizer().encode(TEXT[:40]))).keys[0]
    positions = torch.arange(40)
    assert torch.equal(model.native.rotate(keys, torch.zeros(40, dtype=torch.long)), keys)
    there = model.native.rotate(keys, positions * 3)
    assert torch.allclose(model.native.rotate(there, -positions * 3), keys, atol=1e-5)
    assert torch.allclose(model.native.rotate(model.native.rotate(keys, positions), positions),
                          model.native.rotate(keys, 2 * positions), atol=1e-5)
    assert torch.allclose(there.norm(dim=-1), keys.norm(dim=-1), atol=1e-5)  # a rotation
    # queries and keys rotated alike keep their scores: what depends only on relative position
    q = torch.randn(2, 40, keys.shape[-1])
    shift = torch.full((40,), 17)
    assert torch.allclose(model.native.rotate(q, shift) @ model.native.rotate(keys, shift).transpose(1, 2),
                          q @ keys.transpose(1, 2), atol=1e-4)


def test_window_shares_cover_the_corpus() -> None:
    shares = window_shares(10_000, 600, 2048)
    assert [(s, e) for s, e, _ in shares] == [(0, 2048), (2048, 4096), (4096, 6144), (6144, 8192), (8192, 10_000)]
    assert sum(k for _, _, k in shares) == 600 and all(k >= 100 for _, _, k in shares)
    assert sum(k for _, _, k in window_shares(5, 3, 2)) == 3
    with pytest.raises(ValueError):
        window_shares(10_000, 3, 2048)


def attention_scores(prefix, queries: torch.Tensor, layer: int = 0) -> torch.Tensor:
    """Logits [Hkv, n, P] of `queries` [Hkv, n, D] on the prefix's keys, with its biases."""
    k = prefix.keys[layer]
    scores = queries @ k.transpose(1, 2) / math.sqrt(k.shape[-1])
    return scores if prefix.biases is None else scores + prefix.biases[layer].unsqueeze(1)


def attention_error(prefix, full, queries: torch.Tensor) -> float:
    """Mean squared difference of layer 0's attention outputs over `prefix` and over `full`,
    for `queries` [Hkv, n, D] placed after both."""
    def output(p) -> torch.Tensor:
        return attention_scores(p, queries).softmax(-1) @ p.values[0]

    return (output(prefix) - output(full)).pow(2).mean().item()


def test_the_compact_kv_matches_the_corpus_attention(model) -> None:
    tokens = CharTokenizer().encode(TEXT)  # 600+ tokens, read in windows of 128
    full = model.native.prefix_from_tokens(torch.tensor(tokens))
    compact = compact_prefix(model.native, tokens, 64, window=128)
    assert compact.num_tokens == 64 and compact.keys[0].shape == full.keys[0][:, :64].shape
    assert all(torch.equal(c[:, 0], f[:, 0]) for c, f in zip(compact.keys, full.keys))  # the sink, in place
    # every slot holds a key of the corpus (moved), no slot is left empty
    assert all(torch.isfinite(k).all() and torch.isfinite(v).all() for k, v in zip(compact.keys, compact.values))
    # queries that read the whole corpus (its last tokens', at the end) are answered closer to
    # the full KV's answers by the compact KV than by the corpus' first 64 tokens
    queries = model.native.queries_and_prefix(torch.tensor(tokens + tokens[-64:]))[0][0][:, -64:]
    kv_heads = compact.keys[0].shape[0]
    grouped = queries.reshape(kv_heads, -1, queries.shape[-1])
    first = model.native.prefix_from_tokens(torch.tensor(tokens[:64]))
    assert attention_error(compact, full, grouped) < attention_error(first, full, grouped)


def test_a_cartridge_starts_from_the_compact_kv(model) -> None:
    config = TrainConfig(num_tokens=32, init="compact", num_samples=4, epochs=1, batch_size=2, chunk_tokens=48,
                         teacher_tokens=96, max_question_tokens=8, max_answer_tokens=8, synthesis_batch_size=2,
                         top_k=4)
    from cartridges.training import init_params

    corpus = Corpus.from_texts(model.tokenizer, [TEXT])
    params = init_params(model, corpus, config)
    assert params.num_tokens == 32
    expected = compact_prefix(model.native, list(corpus.tokens), 32)
    assert torch.equal(cartridges.Cartridge.from_params(params).keys[1], expected.keys[1])


# A run small enough to train in seconds, from the compaction, with checkpoints.
SMALL_COMPACT_RUN = TrainConfig(num_tokens=32, init="compact", num_samples=4, epochs=1, batch_size=2, chunk_tokens=48,
                                teacher_tokens=96, max_question_tokens=8, max_answer_tokens=8, synthesis_batch_size=2,
                                top_k=4, quality_samples=0)


def test_a_resumed_run_reads_its_compaction_back(model, tmp_path, monkeypatch) -> None:
    """The compaction is kept beside the checkpoint: a resumed run does not compute it again
    (minutes on a long corpus) and trains to the same cartridge."""
    config = SMALL_COMPACT_RUN
    checkpoint = tmp_path / "run.ckpt"
    first = cartridges.train(model, TEXT, config, progress=False, checkpoint=checkpoint)
    assert (tmp_path / "run.ckpt.init.pt").exists()

    def compact_again(*args, **kwargs):
        raise AssertionError("the compaction was computed again")

    monkeypatch.setattr("cartridges.selfstudy.compaction.compact_prefix", compact_again)
    again = cartridges.train(model, TEXT, config, progress=False, checkpoint=checkpoint, resume=True)
    assert all(torch.equal(a, b) for a, b in zip(first.keys, again.keys))
    assert all(torch.equal(a, b) for a, b in zip(first.values, again.values))


def test_a_resume_refuses_checkpoints_made_for_another_corpus_or_config(model, tmp_path) -> None:
    """CHECKPOINT.key says what the files beside it were made from: a resume with another
    corpus or config stops with a clear error rather than training on that run's
    conversations and compaction; the checkpoint cadence alone may change."""
    config = SMALL_COMPACT_RUN
    checkpoint = tmp_path / "run.ckpt"
    first = cartridges.train(model, TEXT, config, progress=False, checkpoint=checkpoint)
    assert (tmp_path / "run.ckpt.key").exists()
    with pytest.raises(CheckpointMismatch, match="another model, corpus or config"):
        cartridges.train(model, TEXT + " One more sentence.", config, progress=False, checkpoint=checkpoint,
                         resume=True)
    with pytest.raises(CheckpointMismatch):
        cartridges.train(model, TEXT, config.replace(num_tokens=24), progress=False, checkpoint=checkpoint,
                         resume=True)
    again = cartridges.train(model, TEXT, config.replace(checkpoint_every=1), progress=False, checkpoint=checkpoint,
                             resume=True)
    assert all(torch.equal(a, b) for a, b in zip(first.keys, again.keys))
    # Without resume the run starts over and the checkpoint is its own from then on.
    cartridges.train(model, TEXT, config.replace(num_tokens=24), progress=False, checkpoint=checkpoint)
    cartridges.train(model, TEXT, config.replace(num_tokens=24), progress=False, checkpoint=checkpoint, resume=True)


def test_the_compact_objective_trains_nothing(model) -> None:
    cartridge = cartridges.train(model, TEXT, TrainConfig(objective="compact", num_tokens=32), progress=False)
    assert cartridge.stats["steps"] == 0 and cartridge.stats["num_conversations"] == 0
    assert cartridge.config["objective"] == "compact" and cartridge.num_frozen == 1
    expected = compact_prefix(model.native, CharTokenizer().encode(TEXT), 32)
    assert all(torch.equal(a, b) for a, b in zip(cartridge.values, expected.values))


def test_compaction_reports_each_window_and_stops_when_cancelled(model) -> None:
    """A long corpus' compaction takes minutes: the bar and a job see it window by window
    (the tiny model's 1,024-token context gives windows of 511 tokens: two for TEXT)."""
    seen = []
    cartridges.train(model, TEXT, TrainConfig(objective="compact", num_tokens=32), progress=False,
                     on_progress=lambda stage, done, total, loss: seen.append((stage, done, total)))
    assert seen == [("compaction", 1, 2), ("compaction", 2, 2)]
    cancel = cartridges_core.CancelToken()

    def cancel_after_first(stage, done, total, loss) -> None:
        cancel.cancel()

    with pytest.raises(TrainingCancelled, match="compaction"):
        cartridges.train(model, TEXT, TrainConfig(objective="compact", num_tokens=32), progress=False,
                         cancel=cancel, on_progress=cancel_after_first)


def test_the_biases_carry_the_corpus_attention_mass(model) -> None:
    """Without biases the kept keys draw a fraction of the attention the corpus drew; with them,
    each query's mass (its log-sum-exp over the keys) comes closer to the full KV's, so that a
    query reading the compact KV beside other keys splits its attention more as it would with
    the whole corpus."""
    tokens = CharTokenizer().encode(TEXT)
    full = model.native.prefix_from_tokens(torch.tensor(tokens))
    biased = compact_prefix(model.native, tokens, 64, window=128, bias=True)
    plain = compact_prefix(model.native, tokens, 64, window=128)
    assert biased.biases is not None and plain.biases is None
    assert all(b.shape == k.shape[:2] and torch.isfinite(b).all() for b, k in zip(biased.biases, biased.keys))
    assert all(torch.equal(a, b) for a, b in zip(biased.keys, plain.keys))  # the same keys are kept
    queries = model.native.queries_and_prefix(torch.tensor(tokens + tokens[-64:]))[0][0][:, -64:]
    grouped = queries.reshape(biased.keys[0].shape[0], -1, queries.shape[-1])

    def log_mass(prefix) -> torch.Tensor:
        return attention_scores(prefix, grouped).logsumexp(-1)

    # queries the fit did not see (after the whole corpus, not after each window): the gap to
    # the full KV's mass halves (on this tiny model 0.88 against 1.75 nats)
    target = log_mass(full)
    assert (log_mass(biased) - target).abs().mean() < 0.7 * (log_mass(plain) - target).abs().mean()
    assert (log_mass(biased) - target).mean().abs() < 0.6 * (log_mass(plain) - target).mean().abs()
