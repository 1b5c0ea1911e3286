"""The C++ training core against plain PyTorch: loss and gradient, Adam, and the loop
(loss goes down, resume equals an uninterrupted run, cancellation)."""

from __future__ import annotations

import math
import threading
import time

import pytest
import torch

import cartridges_core
from cartridges.selfstudy import TrainConfig, Corpus
from cartridges.training import init_params, train_options

from . import reference
from .tiny import tiny_model


def random_data(vocab: int, n: int = 5, seq: int = 14, k: int = 4, seed: int = 0) -> cartridges_core.TrainingData:
    """Right-padded rows of different lengths, targets on a suffix of each row, a random
    teacher top-k (log-probabilities of a softmax, so not summing to 1 over the k)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(vocab, (n, seq), generator=g)
    lengths = torch.tensor([seq - (i % 4) for i in range(n)])
    mask = torch.zeros(n, seq, dtype=torch.bool)
    for i in range(n):
        mask[i, 3 : int(lengths[i]) - 1] = True
        tokens[i, int(lengths[i]) :] = 0
    t = int(mask.sum())
    ids = torch.stack([torch.randperm(vocab, generator=g)[:k] for _ in range(t)])
    logprobs = torch.log_softmax(torch.randn(t, vocab, generator=g), -1).gather(1, ids).contiguous()
    return cartridges_core.TrainingData(tokens, lengths, mask, ids, logprobs)


def prefix_params(model, n: int = 6, frozen: int = 1) -> cartridges_core.CartridgeParams:
    corpus = Corpus(list(range(10, 10 + n)))
    return init_params(model, corpus, TrainConfig(num_tokens=n, num_frozen=frozen))


def reference_prefix(model, params):
    """Leaf copies of the trainable tensors, and the full keys and values made from them."""
    ref_trainable = [t.detach().clone().requires_grad_(True) for t in (*params.trainable_keys, *params.trainable_values)]
    L = model.config.num_layers
    keys = [torch.cat([f, t], 1) for f, t in zip(params.frozen_keys, ref_trainable[:L])]
    values = [torch.cat([f, t], 1) for f, t in zip(params.frozen_values, ref_trainable[L:])]
    return ref_trainable, keys, values


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def test_loss_and_gradient_match_plain_pytorch(model):
    data = random_data(model.config.vocab_size)
    params = prefix_params(model)
    rows = [3, 0, 4, 1]
    loss, count = cartridges_core.distillation_loss_sum(model.core, params, data, rows)
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


@pytest.mark.parametrize("anchor, lr_scales", [(0.0, []), (5.0, []), (0.0, [0.1, 3.0]), (5.0, [0.1, 3.0])])
def test_adam_matches_torch_optim(anchor, lr_scales):
    """With an anchor, each step then moves every parameter lr * anchor of the way back to its
    start; with lr_scales, parameter i steps at lr * lr_scales[i] (a parameter group of its own)."""
    g = torch.Generator().manual_seed(1)
    ours = [torch.randn(3, 5, 4, generator=g).requires_grad_(True) for _ in range(2)]
    theirs = [p.detach().clone().requires_grad_(True) for p in ours]
    starts = [p.detach().clone() for p in ours]
    scales = lr_scales or [1.0, 1.0]
    adam = cartridges_core.Adam(ours, lr=2e-2, anchor=anchor, lr_scales=lr_scales)
    torch_adam = torch.optim.Adam([{"params": [q], "lr": 2e-2 * s} for q, s in zip(theirs, scales)])
    for _ in range(5):
        grads = [torch.randn(p.shape, generator=g) for p in ours]
        for p, q, grad in zip(ours, theirs, grads):
            p.grad, q.grad = grad.clone(), grad.clone()
        adam.step(2e-2)
        torch_adam.step()
        with torch.no_grad():
            for q, start, scale in zip(theirs, starts, scales):
                q.lerp_(start, 2e-2 * scale * anchor)
        adam.zero_grad()
    assert adam.steps == 5
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=1e-7)
        assert p.grad is None


def test_train_options_carry_the_config():
    config = TrainConfig(lr=0.03, anchor=2.0, epochs=3, batch_size=5, grad_accum=2, cosine=False, warmup=0.2,
                         layer_scaled_lr=False, channel_scaled_lr=True, loss_weighting="row", seed=7)
    o = train_options(config)
    got = (o.lr, o.anchor, o.epochs, o.batch_size, o.grad_accum, o.cosine, o.warmup, o.layer_scaled_lr,
           o.channel_scaled_lr, o.weighting, o.seed)
    assert got == (0.03, 2.0, 3, 5, 2, False, 0.2, False, True, "row", 7)
    defaults = train_options(TrainConfig())
    assert (defaults.cosine, defaults.warmup, defaults.layer_scaled_lr, defaults.channel_scaled_lr,
            defaults.weighting) == (True, 0.0, True, True, "step")


def test_adam_refuses_bad_lr_scales():
    params = [torch.zeros(2, requires_grad=True) for _ in range(2)]
    with pytest.raises(Exception, match="2 parameters"):
        cartridges_core.Adam(params, lr_scales=[1.0])
    with pytest.raises(Exception, match="finite"):
        cartridges_core.Adam(params, lr_scales=[1.0, float("nan")])


def rms_ratios(group: list[torch.Tensor]) -> list[float]:
    """Each tensor's RMS over the RMS of all of them (the reference for layer_lr_scales)."""
    group = [t.detach() for t in group]
    group_rms = torch.cat([t.flatten() for t in group]).square().mean().sqrt()
    return [float(t.square().mean().sqrt() / group_rms) for t in group]


def channel_leaves(t: torch.Tensor) -> list[list[torch.Tensor]]:
    """[H, T, D] as H x D leaf tensors of [T], one per channel, so that torch.optim.Adam can give
    each channel its own parameter group (and so its own lr)."""
    return [[t[h, :, d].detach().clone().requires_grad_(True) for d in range(t.shape[2])] for h in range(t.shape[0])]


def from_channels(leaves: list[list[torch.Tensor]]) -> torch.Tensor:
    return torch.stack([torch.stack(row, -1) for row in leaves])


@pytest.mark.parametrize("anchor", [0.0, 5.0])
def test_adam_with_channel_scales_matches_torch_optim(anchor):
    """Channel scales multiply each element's step: Adam with a parameter group per channel."""
    g = torch.Generator().manual_seed(2)
    ours = [torch.randn(2, 5, 3, generator=g).requires_grad_(True) for _ in range(2)]
    starts = [p.detach().clone() for p in ours]
    channel_scales = [torch.rand(2, 1, 3, generator=g) * 3 for _ in ours]
    leaves = [channel_leaves(p) for p in ours]
    groups = [{"params": [leaf], "lr": 2e-2 * float(c[h, 0, d])}
              for p_leaves, c in zip(leaves, channel_scales)
              for h, row in enumerate(p_leaves) for d, leaf in enumerate(row)]
    adam = cartridges_core.Adam(ours, lr=2e-2, anchor=anchor, channel_scales=channel_scales)
    torch_adam = torch.optim.Adam(groups)
    for _ in range(5):
        grads = [torch.randn(p.shape, generator=g) for p in ours]
        for p, p_leaves, grad in zip(ours, leaves, grads):
            p.grad = grad.clone()
            for h, row in enumerate(p_leaves):
                for d, leaf in enumerate(row):
                    leaf.grad = grad[h, :, d].clone()
        adam.step(2e-2)
        torch_adam.step()
        with torch.no_grad():
            for p_leaves, start, c in zip(leaves, starts, channel_scales):
                for h, row in enumerate(p_leaves):
                    for d, leaf in enumerate(row):
                        leaf.lerp_(start[h, :, d], 2e-2 * float(c[h, 0, d]) * anchor)
        adam.zero_grad()
    for p, p_leaves in zip(ours, leaves):
        torch.testing.assert_close(p.detach(), from_channels(p_leaves).detach(), rtol=0, atol=1e-6)


def test_adam_refuses_bad_channel_scales():
    params = [torch.zeros(2, 4, 3, requires_grad=True)]
    with pytest.raises(Exception, match="broadcast"):
        cartridges_core.Adam(params, channel_scales=[torch.ones(2, 1, 4)])
    with pytest.raises(Exception, match="finite"):
        cartridges_core.Adam(params, channel_scales=[-torch.ones(2, 1, 3)])
    with pytest.raises(Exception, match="1 parameters"):
        cartridges_core.Adam(params, channel_scales=[torch.ones(2, 1, 3)] * 2)


def test_channel_lr_scales_are_channel_rms_ratios(model):
    """Each channel's RMS over the trainable tokens, over the RMS of all trainable keys (values);
    a layer's channels' scales have that layer's scale as their RMS."""
    params = prefix_params(model, n=7, frozen=2)
    scales = cartridges_core.channel_lr_scales(params)
    layer_scales = cartridges_core.layer_lr_scales(params)
    L = model.config.num_layers
    for group, got in ((params.trainable_keys, scales[:L]), (params.trainable_values, scales[L:])):
        group_rms = torch.cat([t.detach().double().flatten() for t in group]).square().mean().sqrt()
        for t, c in zip(group, got):
            want = t.detach().double().square().mean(1, keepdim=True).sqrt() / group_rms
            assert c.shape == want.shape == (t.shape[0], 1, t.shape[2])
            torch.testing.assert_close(c.double(), want, rtol=1e-6, atol=0)
    for c, layer in zip(scales, layer_scales):
        assert float(c.double().square().mean().sqrt()) == pytest.approx(layer, rel=1e-6)
    assert len({round(float(x), 4) for x in scales[0].flatten()}) > 1  # channels differ


def test_layer_lr_scales_are_rms_ratios(model):
    """Each layer's keys (values) over the RMS of all trainable keys (values), frozen token excluded."""
    params = prefix_params(model, n=7, frozen=2)
    scales = cartridges_core.layer_lr_scales(params)
    L = model.config.num_layers
    assert len(scales) == 2 * L
    for group, got in ((params.trainable_keys, scales[:L]), (params.trainable_values, scales[L:])):
        want = rms_ratios([t.double() for t in group])
        assert got == pytest.approx(want, rel=1e-9)
        assert len(set(round(x, 6) for x in got)) > 1  # the tiny model's layers differ in scale


def options(**kw) -> cartridges_core.TrainOptions:
    o = cartridges_core.TrainOptions()
    for k, v in kw.items():
        setattr(o, k, v)
    return o


def snapshot(params) -> list[torch.Tensor]:
    return [t.detach().clone() for t in (*params.trainable_keys, *params.trainable_values)]


def test_loss_decreases_and_frozen_token_stays(model):
    data = random_data(model.config.vocab_size, n=6)
    params = prefix_params(model)
    frozen = [t.clone() for t in params.frozen_keys]
    result = cartridges_core.train_cartridge(model.core, params, data, options(epochs=15, batch_size=3, grad_accum=2))
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
        cartridges_core.train_cartridge(model.core, params, data, options(epochs=6, batch_size=3, anchor=anchor))
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
    o = options(lr=0.04, warmup=warmup, cosine=cosine)
    total = 10
    want = [reference_lr(0.04, s, total, warmup, cosine) for s in range(total)]
    assert [o.lr_at(s, total) for s in range(total)] == pytest.approx(want, rel=1e-12)
    if warmup * total > 1:  # a warmup of one step is the full lr at once
        assert want[0] < want[1] and max(want) == pytest.approx(0.04)
    # The loop steps at these rates (10 conversations, one a step).
    seen = []
    cartridges_core.train_cartridge(model.core, prefix_params(model), random_data(model.config.vocab_size, n=10),
                                    options(lr=0.04, warmup=warmup, cosine=cosine, batch_size=1),
                                    lambda p: seen.append(p.lr) or True)
    assert seen == pytest.approx(want, rel=1e-12)


def test_bad_warmup_is_refused(model):
    with pytest.raises(RuntimeError, match="warmup"):
        cartridges_core.train_cartridge(model.core, prefix_params(model), random_data(model.config.vocab_size),
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
    kw = dict(epochs=2, batch_size=2, seed=3, weighting=weighting, layer_scaled_lr=layer_scaled, **schedule)
    params = prefix_params(model)
    ref_trainable, _, _ = reference_prefix(model, params)
    L = model.config.num_layers
    scales = [1.0] * (2 * L)
    if layer_scaled:
        scales = rms_ratios(ref_trainable[:L]) + rms_ratios(ref_trainable[L:])
    cartridges_core.train_cartridge(model.core, params, data, options(**kw))

    counts = data.target_mask.sum(1)
    mean_step_targets = float(counts.sum()) * 2 / 6
    adam = torch.optim.Adam([{"params": [t], "lr": options().lr * s} for t, s in zip(ref_trainable, scales)])
    for epoch in range(2):
        order = cartridges_core.training_order(6, 3, epoch)
        for j in range(3):
            lr = reference_lr(options().lr, 3 * epoch + j, 6, warmup, bool(schedule))
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
    cartridges_core.train_cartridge(model.core, params, data,
                                    options(epochs=2, batch_size=2, seed=4, layer_scaled_lr=True,
                                            channel_scaled_lr=True))

    L = model.config.num_layers
    adam = torch.optim.Adam([{"params": [leaf], "lr": options().lr * float(c[h, 0, d])}
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
        cartridges_core.train_cartridge(model.core, params, data, options(
            epochs=1, batch_size=2, layer_scaled_lr=layer, channel_scaled_lr=channel))
        runs.append(snapshot(params))
    assert all(torch.equal(a, b) for a, b in zip(runs[0], runs[1]))
    assert not all(torch.equal(a, b) for a, b in zip(runs[0], runs[2]))


def test_loss_weightings_train_different_cartridges(model):
    data = with_targets(random_data(model.config.vocab_size, n=6), [9, 1, 8, 2, 1, 9])
    trained = []
    for weighting in ("step", "token", "row"):
        params = prefix_params(model)
        cartridges_core.train_cartridge(model.core, params, data, options(epochs=2, batch_size=2, weighting=weighting))
        trained.append(snapshot(params))
    for a, b in ((0, 1), (0, 2), (1, 2)):
        assert any(not torch.allclose(x, y) for x, y in zip(trained[a], trained[b])), (a, b)


def test_unknown_loss_weighting_is_refused():
    with pytest.raises(Exception, match="step.*token.*row"):
        cartridges_core.TrainOptions().weighting = "tokens"
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
    cartridges_core.train_cartridge(model.core, full, data, options(**kw))

    path = str(tmp_path / "ckpt.pt")
    part = prefix_params(model)
    stopped = cartridges_core.train_cartridge(
        model.core, part, data, options(checkpoint_path=path, checkpoint_every=2, **kw), lambda p: p.step < 4
    )
    assert stopped.cancelled and stopped.steps == 4
    resumed = prefix_params(model)  # a fresh start: everything comes from the checkpoint
    result = cartridges_core.train_cartridge(
        model.core, resumed, data, options(checkpoint_path=path, checkpoint_every=2, resume=True, **kw)
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
        model.core, params, data, options(epochs=5, batch_size=1, grad_accum=4), on_progress, token
    )
    assert result.cancelled and result.steps == 2 and token.cancelled

    # From another thread, while the C++ loop runs with the GIL released.
    token = cartridges_core.CancelToken()
    big = random_data(model.config.vocab_size, n=8, seq=64)
    out = {}
    worker = threading.Thread(
        target=lambda: out.update(r=cartridges_core.train_cartridge(
            model.core, prefix_params(model), big, options(epochs=10_000, batch_size=1), None, token))
    )
    worker.start()
    time.sleep(0.3)
    token.cancel()
    worker.join(timeout=10)
    assert not worker.is_alive()
    assert out["r"].cancelled and 0 < out["r"].steps < 80_000


def test_bad_training_data_is_refused(model):
    data = random_data(model.config.vocab_size)
    bad = cartridges_core.TrainingData(data.tokens, data.lengths, data.target_mask, data.topk_ids[1:], data.topk_logprobs[1:])
    with pytest.raises(RuntimeError, match="topk_ids"):
        cartridges_core.train_cartridge(model.core, prefix_params(model), bad, options())


def test_companion_stands_in_front_of_every_nth_conversation(model):
    """Rows r with r % companion_every == 0 are trained with the companion's KV before the
    cartridge (composition), the others with the cartridge alone: loss and gradient as plain
    PyTorch computes them with those prefixes."""
    data = random_data(model.config.vocab_size)
    params = prefix_params(model)
    companion = model.core.prefix_from_tokens(torch.tensor([40, 41, 42, 43, 44], dtype=torch.long))
    rows = [3, 0, 4, 1, 2]
    loss, count = cartridges_core.distillation_loss_sum(model.core, params, data, rows, companion, 2)
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
    plain, _ = cartridges_core.distillation_loss_sum(model.core, params, data, rows)
    assert abs(float(plain.detach()) - float(loss.detach())) > 1e-4
