"""The quality report of a cartridge (cartridges.quality): held-out conversations synthesized
beside the training ones and never trained on; the trained cartridge's distillation loss on
them against the untrained initialization's and the teacher's own, on a tiny model."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

import cartridges_core
from cartridges import Cartridge, load_cartridge
from cartridges.quality import describe, held_out_loss, quality_report, teacher_floor
from cartridges.selfstudy import Corpus
from cartridges.training import init_params, train

from . import reference
from .test_selfstudy import TEXT, small_config
from .tiny import tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def config():
    return small_config(num_samples=12, epochs=2)


@pytest.fixture(scope="module")
def trained(model, config) -> Cartridge:
    return train(model, [TEXT], config, progress=False)


def reference_loss(model, keys, values, data) -> float:
    """Mean per answer token of the plain-PyTorch distillation loss (tests/training/reference.py)."""
    rows = list(range(int(data.tokens.shape[0])))
    with torch.no_grad():
        total = reference.distillation_loss_sum(model.weights, model.config, data, rows, keys, values)
    return float(total) / int(data.target_mask.sum())


def test_default_quality_samples():
    assert small_config(num_samples=12).quality_samples == 8
    assert small_config(num_samples=16 * 20).quality_samples == 20
    assert small_config(num_samples=10_000).quality_samples == 32
    assert small_config(num_samples=12, quality_samples=3).quality_samples == 3
    with pytest.raises(ValueError, match="quality_samples"):
        small_config(quality_samples=-1)


def test_trained_cartridge_beats_its_initialization_on_held_out_conversations(model, config, trained):
    report = trained.stats["quality"]
    held_out = trained.stats["held_out"]
    # quality_samples were made; any that came out the same as a training one was dropped.
    assert 0 < report["held_out_conversations"] == held_out.tokens.shape[0] <= config.quality_samples == 8
    assert report["held_out_tokens"] == held_out.topk_ids.shape[0] > 0
    json.dumps(report)  # JSON-serializable as it is

    # Held out: none of these conversations is one training saw.
    train_rows = {tuple(r[: int(n)].tolist()) for r, n in zip(trained.stats["data"].tokens, trained.stats["data"].lengths)}
    held_rows = {tuple(r[: int(n)].tolist()) for r, n in zip(held_out.tokens, held_out.lengths)}
    assert not train_rows & held_rows

    # The figures, recomputed independently: the plain-PyTorch loss with the trained tensors,
    # with a fresh initialization, and the teacher's top-k entropy.
    loss = reference_loss(model, trained.keys, trained.values, held_out)
    init = Cartridge.from_params(init_params(model, Corpus.from_texts(model.tokenizer, [TEXT]), config))
    init_loss = reference_loss(model, init.keys, init.values, held_out)
    p = held_out.topk_logprobs.exp()
    floor = float(-(p * held_out.topk_logprobs).sum(-1).mean())
    assert report["loss"] == pytest.approx(loss, rel=1e-5)
    assert report["init_loss"] == pytest.approx(init_loss, rel=1e-5)
    assert report["teacher_floor"] == pytest.approx(floor, rel=1e-5)
    assert report["recovered"] == pytest.approx((init_loss - loss) / (init_loss - floor), rel=1e-4)

    assert floor < report["loss"] < report["init_loss"]
    assert report["better_than_init"] is True and 0 < report["recovered"] < 1
    lines = describe(report)
    assert len(lines) == 2 and "held-out" in lines[0] and "by tenth of the corpus" in lines[1]


def test_the_quality_report_per_tenth_of_the_corpus(model, trained):
    report, held_out, parts = trained.stats["quality"], trained.stats["held_out"], trained.stats["held_out_parts"]
    assert len(report["by_part"]) == 10 and len(parts) == held_out.tokens.shape[0]
    assert sum(p["held_out_conversations"] for p in report["by_part"] if p) == report["held_out_conversations"]
    assert sum(p is not None for p in report["by_part"]) >= 7  # 8 conversations over 8 tenths (some dropped)
    ends = held_out.target_mask.sum(1).cumsum(0).tolist()
    for tenth, figures in enumerate(report["by_part"]):
        rows = [r for r, p in enumerate(parts) if p == tenth]
        assert (figures is None) == (not rows)
        if rows:  # the same figures on the tenth's own rows, recomputed in plain PyTorch
            targets = torch.cat([torch.arange(ends[r - 1] if r else 0, ends[r]) for r in rows])
            sub = cartridges_core.TrainingData(held_out.tokens[rows], held_out.lengths[rows],
                                               held_out.target_mask[rows], held_out.topk_ids[targets],
                                               held_out.topk_logprobs[targets])
            assert figures["loss"] == pytest.approx(reference_loss(model, trained.keys, trained.values, sub),
                                                    rel=1e-5)
            p = sub.topk_logprobs.exp()
            assert figures["teacher_floor"] == pytest.approx(float(-(p * sub.topk_logprobs).sum(-1).mean()), rel=1e-5)


def test_held_out_conversations_change_no_training_conversation(model, config, trained):
    plain = train(model, [TEXT], small_config(num_samples=12, epochs=2, quality_samples=0), progress=False)
    assert plain.stats["quality"] is None and plain.stats["held_out"] is None
    assert torch.equal(plain.stats["data"].tokens, trained.stats["data"].tokens)
    assert all(torch.equal(a, b) for a, b in zip((*plain.keys, *plain.values), (*trained.keys, *trained.values)))
    assert plain.config["quality_samples"] == 0 and trained.config["quality_samples"] == 8


def test_corrupted_cartridge_scores_worse_than_its_initialization(model, config, trained):
    held_out = trained.stats["held_out"]
    init = init_params(model, Corpus.from_texts(model.tokenizer, [TEXT]), config)
    f = trained.num_frozen
    g = torch.Generator().manual_seed(0)

    def noise(t: torch.Tensor) -> torch.Tensor:  # the trained tokens replaced by noise of their scale
        return torch.cat([t[:, :f], torch.randn(t[:, f:].shape, generator=g) * t[:, f:].std()], 1)

    corrupted = Cartridge([noise(k) for k in trained.keys], [noise(v) for v in trained.values], f)
    report = quality_report(model, corrupted, init, held_out)
    assert report["loss"] == pytest.approx(held_out_loss(model, corrupted, held_out))
    assert report["loss"] == pytest.approx(reference_loss(model, corrupted.keys, corrupted.values, held_out), rel=1e-5)
    assert report["init_loss"] == pytest.approx(trained.stats["quality"]["init_loss"], rel=1e-6)
    assert report["loss"] > report["init_loss"]
    assert report["better_than_init"] is False and report["recovered"] < 0
    lines = describe(report)
    assert len(lines) == 2 and lines[1].startswith("WARNING") and "--num-samples" in lines[1]

    # The untrained initialization scored against itself: no better, no worse.
    same = quality_report(model, init, init, held_out)
    assert same["loss"] == same["init_loss"] and same["recovered"] == 0 and same["better_than_init"] is False
    assert teacher_floor(held_out) == pytest.approx(same["teacher_floor"])


def test_report_round_trips_through_the_file(model, trained, tmp_path):
    path = tmp_path / "cart.safetensors"
    trained.save(path)
    with safe_open(str(path), framework="pt") as f:
        assert json.loads(f.metadata()["quality"]) == trained.quality
    loaded = load_cartridge(path, model)
    assert loaded.quality == trained.stats["quality"] == loaded.stats["quality"]
    assert trained.to(torch.bfloat16).quality == trained.quality


def test_no_report_without_quality_samples(model, tmp_path):
    cart = train(model, [TEXT], small_config(quality_samples=0), progress=False)
    assert cart.stats["quality"] is None and cart.quality is None
    path = tmp_path / "plain.safetensors"
    cart.save(path)
    with safe_open(str(path), framework="pt") as f:
        assert "quality" not in f.metadata()
    assert load_cartridge(path, model).quality is None  # files without a report load as before
    # The ablation objective has no teacher, so no report either.
    assert train(model, [TEXT], small_config(objective="next_token"), progress=False).quality is None


def test_report_survives_a_resumed_run(model, tmp_path):
    """Held-out data is checkpointed with the training data: a run cancelled during training
    and resumed reports what the uninterrupted run does."""
    config = small_config(num_samples=6, epochs=2, quality_samples=4, checkpoint_every=1)
    full = train(model, [TEXT], config, progress=False)
    token = cartridges_core.CancelToken()

    def stop_at_three(stage, done, total, loss):
        if stage == "training" and done == 3:
            token.cancel()

    ckpt = tmp_path / "run.ckpt"
    part = train(model, [TEXT], config, progress=False, checkpoint=ckpt, cancel=token, on_progress=stop_at_three)
    assert part.stats["cancelled"] and part.quality is None
    resumed = train(model, [TEXT], config, progress=False, checkpoint=ckpt, resume=True)
    assert resumed == full
    by_part = resumed.quality.pop("by_part"), full.quality.pop("by_part")  # also checkpointed: the rows' tenths
    assert resumed.quality == pytest.approx(full.quality)
    assert [p is None for p in by_part[0]] == [p is None for p in by_part[1]]
    assert all(a == pytest.approx(b) for a, b in zip(*by_part) if a is not None)
    assert resumed.quality["held_out_conversations"] == full.quality["held_out_conversations"] > 0


def test_train_command_prints_the_report(model, tmp_path, monkeypatch, capsys):
    import cartridges.model
    import cartridges.training
    from cartridges.cli import main

    monkeypatch.setattr(cartridges.model, "load_model", lambda path=None, **kw: model)
    (tmp_path / "doc.txt").write_text(TEXT)
    out = tmp_path / "cart.safetensors"
    args = ["train", str(tmp_path / "doc.txt"), "--out", str(out), "--num-tokens", "24", "--num-samples", "4",
            "--quality-samples", "2", "--chunk-tokens", "60", "--teacher-tokens", "120",
            "--synthesis-batch-size", "2", "--max-question-tokens", "8", "--max-answer-tokens", "8",
            "--top-k", "4", "--no-progress"]
    assert main(args) == 0
    err = capsys.readouterr().err
    held = load_cartridge(out).quality["held_out_conversations"]
    assert 1 <= held <= 2  # 2 made; one that came out as a training one's twin is dropped
    assert f"quality on {held} held-out conversations" in err
    assert "training signal by tenth of the corpus: " in err and "gap recovered by tenth of the corpus: " in err

    real = cartridges.training.quality_report

    def worse(*a, **kw):
        return {**real(*a, **kw), "better_than_init": False, "recovered": -0.5}

    monkeypatch.setattr(cartridges.training, "quality_report", worse)
    assert main(args) == 0
    assert "WARNING: the cartridge is no better than its untrained initialization" in capsys.readouterr().err
