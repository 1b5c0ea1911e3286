"""The C++ training core against plain PyTorch: loss and gradient, and the loop (loss goes
down, schedules and weightings, resume equals an uninterrupted run, cancellation). Adam and
the learning-rate scales: test_adam.py."""

from __future__ import annotations

import math
import threading

import pytest
import torch

import cartridges_core
from cartridges.selfstudy import TrainConfig

from . import reference
from .core_helpers import channel_leaves, from_channels, prefix_params, random_data, reference_prefix, rms_ratios


# seq 40: over 64 targets (on a CPU the loss runs in the fused loops, float32 here; the block-wise
# path serves other dtypes and devices).
@pytest.mark.parametrize("seq", [14, 40])
def test_loss_and_gradient_match_plain_pytorch(model, seq):
    data = random_data(model.config.vocab_size, seq=seq)
    params = prefix_params(model)
    rows = [3, 0, 4, 1]
    loss, count = cartridges_core.distillation_loss_sum(model.native, params, data, rows)
    assert count == int(data.target_mask[rows].sum())
    loss.backward()

    ref_trainable, keys, values = reference_prefix(model, params)
    ref_loss = reference.distillation_loss_sum(model.weights, model.config, data, rows, keys, values)
    ref_loss.backward()

    torch.testing.assert_close(loss.detach(), ref_loss.detach(), rtol=1e-5, atol=1e-5)
    for got, want in zip((*params.trainable_keys, *params.trainable_values), ref_trainable):
        assert got.grad is not None and got.grad.abs().sum() > 0
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-4, atol=1e-6)
    # The frozen token gets no gradient: it is not a parameter at all.
    assert all(not f.requires_grad for f in params.frozen_keys)


# The loop at its plainest (one epoch, constant learning rate, the same for every layer and
# channel), which each test changes where it tests something else.
PLAIN = {"epochs": 1, "cosine": False, "layer_scaled_lr": False, "channel_scaled_lr": False}


def options(**kw) -> cartridges_core.TrainOptions:
    o = cartridges_core.TrainOptions()
    kw = {**PLAIN, **kw}
    for k, v in kw.items():
        setattr(o, k, v)
    return o


def snapshot(params) -> list[torch.Tensor]:
    return [t.detach().clone() for t in (*params.trainable_keys, *params.trainable_values)]


def test_loss_decreases_and_frozen_token_stays(model):
    data = random_data(model.config.vocab_size, n=6)
    params = prefix_params(model)
    frozen = [t.clone() for t in params.frozen_keys]
    result = cartridges_core.train_cartridge(model.native, params, data, options(epochs=15, batch_size=3, grad_accum=2))
    assert result.steps == 15 and not result.cancelled
    # Each step sees the whole data set (6 = 3 x 2 accumulated): the loss goes down every step.
    assert all(b < a for a, b in zip(result.losses, result.losses[1:])), result.losses
    assert result.losses[-1] < 0.9 * result.losses[0], result.losses
    assert all(torch.equal(a, b) for a, b in zip(frozen, params.frozen_keys))


def test_an_anchor_holds_the_cartridge_near_its_start(model):
    """TrainOptions.anchor (TrainConfig.anchor) reaches the loop's Adam: with each step pulling
    98% of the way back, the cartridge ends far closer to its start than without."""
    data = random_data(model.config.vocab_size, n=6)
    moved = {}
    for anchor in (0.0, 49.0):
        params = prefix_params(model)
        start = snapshot(params)
        cartridges_core.train_cartridge(model.native, params, data, options(epochs=6, batch_size=3, anchor=anchor))
        moved[anchor] = sum((a - b).norm().item() for a, b in zip(snapshot(params), start))
    assert moved[49.0] < 0.2 * moved[0.0], moved
    with pytest.raises(ValueError, match="anchor"):
        TrainConfig(anchor=-1.0)
    with pytest.raises(ValueError, match="anchor"):
        TrainConfig(anchor=50.0)  # lr 2e-2: past the whole way back


def with_targets(data: cartridges_core.TrainingData, per_row: list[int]) -> cartridges_core.TrainingData:
    """`data` with only the first per_row[r] targets of each row r kept."""
    mask = data.target_mask.clone()
    keep = []
    for r, n in enumerate(per_row):
        positions = data.target_mask[r].nonzero().squeeze(1)
        mask[r, positions[n:]] = False
        keep.append(torch.arange(len(positions)) < n)
    keep = torch.cat(keep)
    return cartridges_core.TrainingData(data.tokens, data.lengths, mask, data.topk_ids[keep].contiguous(),
                                        data.topk_logprobs[keep].contiguous())


def reference_lr(lr: float, step: int, total: int, warmup: float, cosine: bool) -> float:
    """Linear warmup over warmup * total steps rounded half up (at least 1), then cosine decay to 0."""
    w = max(1, math.floor(warmup * total + 0.5)) if warmup > 0 else 0
    if step < w:
        return lr * (step + 1) / w
    return lr * 0.5 * (1 + math.cos(math.pi * (step - w) / (total - w))) if cosine else lr


@pytest.mark.parametrize("warmup", [0.0, 0.25, 0.1, 0.5])
@pytest.mark.parametrize("cosine", [False, True])
def test_learning_rate_schedule(model, warmup, cosine):
    o = options(learning_rate=0.04, warmup=warmup, cosine=cosine)
    total = 10
    want = [reference_lr(0.04, s, total, warmup, cosine) for s in range(total)]
    assert [o.lr_at(s, total) for s in range(total)] == pytest.approx(want, rel=1e-12)
    if warmup * total > 1:  # a warmup of one step is the full lr at once
        assert want[0] < want[1] and max(want) == pytest.approx(0.04)
    # The loop steps at these rates (10 conversations, one a step).
    seen = []
    cartridges_core.train_cartridge(model.native, prefix_params(model), random_data(model.config.vocab_size, n=10),
                                    options(learning_rate=0.04, warmup=warmup, cosine=cosine, batch_size=1),
                                    lambda p: seen.append(p.lr) or True)
    assert seen == pytest.approx(want, rel=1e-12)


def test_bad_warmup_is_refused(model):
    with pytest.raises(RuntimeError, match="warmup"):
        cartridges_core.train_cartridge(model.native, prefix_params(model), random_data(model.config.vocab_size),
                                        options(warmup=1.0))
    with pytest.raises(RuntimeError, match="step"):
        options(warmup=0.1).lr_at(10, 10)
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError, match="warmup"):
            TrainConfig(warmup=bad)


@pytest.mark.parametrize("weighting, layer_scaled, warmup", [("step", False, 0.0), ("token", False, 0.0),
                                                             ("row", False, 0.0), ("step", True, 0.0),
                                                             ("step", True, 0.3)])
def test_training_loop_matches_plain_pytorch(model, weighting, layer_scaled, warmup):
    """The loop against torch.optim.Adam on the reference loss, with steps of very different
    target counts. A step's summed loss is divided by its own targets ("step") or by the run's
    mean targets per step ("token"); "row" averages each row's mean loss over the step's rows.
    layer_scaled: each tensor's lr is scaled by its initial RMS over its group's (keys, values).
    warmup: the lr rises over the first steps and then decays by cosine (the schedule's own
    figures are checked in test_learning_rate_schedule)."""
    data = with_targets(random_data(model.config.vocab_size, n=6), [9, 1, 8, 2, 1, 9])
    schedule = dict(warmup=warmup, cosine=True) if warmup else {}
    kw = dict(epochs=2, batch_size=2, seed=3, loss_weighting=weighting, layer_scaled_lr=layer_scaled, **schedule)
    params = prefix_params(model)
    ref_trainable, _, _ = reference_prefix(model, params)
    L = model.config.num_layers
    scales = [1.0] * (2 * L)
    if layer_scaled:
        scales = rms_ratios(ref_trainable[:L]) + rms_ratios(ref_trainable[L:])
    cartridges_core.train_cartridge(model.native, params, data, options(**kw))

    counts = data.target_mask.sum(1)
    mean_step_targets = float(counts.sum()) * 2 / 6
    adam = torch.optim.Adam([{"params": [t], "lr": options().learning_rate * s} for t, s in zip(ref_trainable, scales)])
    for epoch in range(2):
        order = cartridges_core.training_order(6, 3, epoch)
        for j in range(3):
            lr = reference_lr(options().learning_rate, 3 * epoch + j, 6, warmup, bool(schedule))
            for group, scale in zip(adam.param_groups, scales):
                group["lr"] = lr * scale
            rows = order[2 * j : 2 * j + 2]
            keys = [torch.cat([f, t], 1) for f, t in zip(params.frozen_keys, ref_trainable[:L])]
            values = [torch.cat([f, t], 1) for f, t in zip(params.frozen_values, ref_trainable[L:])]

            def loss_of(rows):
                return reference.distillation_loss_sum(model.weights, model.config, data, rows, keys, values)

            if weighting == "row":
                loss = sum(loss_of([r]) / float(counts[r]) for r in rows) / len(rows)
            else:
                loss = loss_of(rows) / (mean_step_targets if weighting == "token" else float(counts[rows].sum()))
            loss.backward()
            adam.step()
            adam.zero_grad()
    for got, want in zip((*params.trainable_keys, *params.trainable_values), ref_trainable):
        torch.testing.assert_close(got.detach(), want.detach(), rtol=1e-4, atol=1e-5)


def test_training_loop_with_channel_scales_matches_plain_pytorch(model):
    """channel_scaled_lr: every channel of every key and value tensor steps at lr x its initial
    RMS over the group's (torch.optim.Adam with one parameter group per channel)."""
    data = random_data(model.config.vocab_size, n=6)
    params = prefix_params(model)
    scales = [c.clone() for c in cartridges_core.channel_lr_scales(params)]
    leaves = [channel_leaves(t) for t in (*params.trainable_keys, *params.trainable_values)]
    cartridges_core.train_cartridge(model.native, params, data,
                                    options(epochs=2, batch_size=2, seed=4, layer_scaled_lr=True,
                                            channel_scaled_lr=True))

    L = model.config.num_layers
    adam = torch.optim.Adam([{"params": [leaf], "lr": options().learning_rate * float(c[h, 0, d])}
                             for p_leaves, c in zip(leaves, scales)
                             for h, row in enumerate(p_leaves) for d, leaf in enumerate(row)])
    for epoch in range(2):
        order = cartridges_core.training_order(6, 4, epoch)
        for j in range(3):
            rows = order[2 * j : 2 * j + 2]
            trainable = [from_channels(p_leaves) for p_leaves in leaves]
            keys = [torch.cat([f, t], 1) for f, t in zip(params.frozen_keys, trainable[:L])]
            values = [torch.cat([f, t], 1) for f, t in zip(params.frozen_values, trainable[L:])]
            loss = reference.distillation_loss_sum(model.weights, model.config, data, rows, keys, values)
            (loss / float(data.target_mask[rows].sum())).backward()
            adam.step()
            adam.zero_grad()
    for got, p_leaves in zip((*params.trainable_keys, *params.trainable_values), leaves):
        torch.testing.assert_close(got.detach(), from_channels(p_leaves).detach(), rtol=1e-4, atol=1e-5)


def test_channel_scaled_lr_needs_layer_scaled_lr(model):
    """channel_scaled_lr refines layer_scaled_lr: without it, training is unscaled."""
    data = random_data(model.config.vocab_size, n=4)
    runs = []
    for layer, channel in ((False, False), (False, True), (True, True)):
        params = prefix_params(model)
        cartridges_core.train_cartridge(model.native, params, data, options(
            epochs=1, batch_size=2, layer_scaled_lr=layer, channel_scaled_lr=channel))
        runs.append(snapshot(params))
    assert all(torch.equal(a, b) for a, b in zip(runs[0], runs[1]))
    assert not all(torch.equal(a, b) for a, b in zip(runs[0], runs[2]))


def test_loss_weightings_train_different_cartridges(model):
    data = with_targets(random_data(model.config.vocab_size, n=6), [9, 1, 8, 2, 1, 9])
    trained = []
    for weighting in ("step", "token", "row"):
        params = prefix_params(model)
        cartridges_core.train_cartridge(model.native, params, data, options(epochs=2, batch_size=2, loss_weighting=weighting))
        trained.append(snapshot(params))
    for a, b in ((0, 1), (0, 2), (1, 2)):
        assert any(not torch.allclose(x, y) for x, y in zip(trained[a], trained[b])), (a, b)


def test_unknown_loss_weighting_is_refused():
    with pytest.raises(Exception, match="step.*token.*row"):
        cartridges_core.TrainOptions().loss_weighting = "tokens"
    with pytest.raises(ValueError, match="loss_weighting"):
        TrainConfig(loss_weighting="tokens")


@pytest.mark.parametrize("scaling", ["none", "layer", "channel"])
def test_resume_equals_uninterrupted_run(model, tmp_path, scaling):
    """With layer_scaled_lr or channel_scaled_lr, the scales come from the initialization, not
    from the checkpoint."""
    data = random_data(model.config.vocab_size, n=7)
    kw = dict(epochs=3, batch_size=2, grad_accum=2, cosine=True, seed=5, layer_scaled_lr=scaling != "none",
              channel_scaled_lr=scaling == "channel")
    full = prefix_params(model)
    cartridges_core.train_cartridge(model.native, full, data, options(**kw))

    path = str(tmp_path / "ckpt.pt")
    part = prefix_params(model)
    stopped = cartridges_core.train_cartridge(
        model.native, part, data, options(checkpoint_path=path, checkpoint_every=2, **kw), lambda p: p.step < 4
    )
    assert stopped.cancelled and stopped.steps == 4
    resumed = prefix_params(model)  # a fresh start: everything comes from the checkpoint
    result = cartridges_core.train_cartridge(
        model.native, resumed, data, options(checkpoint_path=path, checkpoint_every=2, resume=True, **kw)
    )
    assert result.steps == options(**kw).total_steps(7) == 6 and len(result.losses) == 2
    for a, b in zip(snapshot(full), snapshot(resumed)):
        assert torch.equal(a, b)
    # torch.load reads the checkpoint too.
    saved = torch.load(path, weights_only=True)
    assert int(dict(zip(saved[::2], saved[1::2]))["step"]) == 6


def test_cancel_stops_within_a_step(model):
    data = random_data(model.config.vocab_size, n=8)
    token = cartridges_core.CancelToken()

    def on_progress(p):
        if p.step == 2:
            token.cancel()  # the next step's first micro-batch sees it

    params = prefix_params(model)
    result = cartridges_core.train_cartridge(
        model.native, params, data, options(epochs=5, batch_size=1, grad_accum=4), on_progress, token
    )
    assert result.cancelled and result.steps == 2 and token.cancelled

    # From another thread, while the C++ loop runs with the GIL released: cancelled once a step
    # has run (waiting for it rather than sleeping keeps the test independent of machine speed).
    token = cartridges_core.CancelToken()
    big = random_data(model.config.vocab_size, n=8, seq=64)
    out = {}
    stepped = threading.Event()
    worker = threading.Thread(
        target=lambda: out.update(r=cartridges_core.train_cartridge(
            model.native, prefix_params(model), big, options(epochs=10_000, batch_size=1),
            lambda p: stepped.set(), token))
    )
    worker.start()
    stepped_in_time = stepped.wait(timeout=60)
    token.cancel()  # also when no step came, so that a failure leaves no thread training on
    worker.join(timeout=10)
    assert stepped_in_time and not worker.is_alive()
    assert out["r"].cancelled and 0 < out["r"].steps < 80_000


def test_bad_training_data_is_refused(model):
    data = random_data(model.config.vocab_size)
    bad = cartridges_core.TrainingData(data.tokens, data.lengths, data.target_mask, data.topk_ids[1:], data.topk_logprobs[1:])
    with pytest.raises(RuntimeError, match="topk_ids"):
        cartridges_core.train_cartridge(model.native, prefix_params(model), bad, options())


def test_companion_stands_in_front_of_every_nth_conversation(model):
    """Rows r with r % companion_every == 0 are trained with the companion's KV before the
    cartridge (composition), the others with the cartridge alone: loss and gradient as plain
    PyTorch computes them with those prefixes."""
    data = random_data(model.config.vocab_size)
    params = prefix_params(model)
    companion = model.native.prefix_from_tokens(torch.tensor([40, 41, 42, 43, 44], dtype=torch.long))
    rows = [3, 0, 4, 1, 2]
    loss, count = cartridges_core.distillation_loss_sum(model.native, params, data, rows, companion, 2)
    assert count == int(data.target_mask[rows].sum())
    loss.backward()

    ref_trainable, keys, values = reference_prefix(model, params)
    behind = [r for r in rows if r % 2 == 0]
    alone = [r for r in rows if r % 2 != 0]
    ref_loss = reference.distillation_loss_sum(model.weights, model.config, data, alone, keys, values)
    ref_loss = ref_loss + reference.distillation_loss_sum(
        model.weights, model.config, data, behind,
        [torch.cat([c, k], 1) for c, k in zip(companion.keys, keys)],
        [torch.cat([c, v], 1) for c, v in zip(companion.values, values)])
    ref_loss.backward()
    torch.testing.assert_close(loss.detach(), ref_loss.detach(), rtol=1e-5, atol=1e-5)
    for got, want in zip((*params.trainable_keys, *params.trainable_values), ref_trainable):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-4, atol=1e-6)
    # Without the companion, the same rows give another loss: it is really in front.
    plain, _ = cartridges_core.distillation_loss_sum(model.native, params, data, rows)
    assert abs(float(plain.detach()) - float(loss.detach())) > 1e-4
