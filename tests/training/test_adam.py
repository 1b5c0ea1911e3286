"""The C++ Adam against torch.optim.Adam (anchor, per-parameter and per-channel scales) and
the learning-rate scales the training loop derives from a cartridge's initialization."""

from __future__ import annotations

import pytest
import torch

import cartridges_core

from .core_helpers import channel_leaves, from_channels, prefix_params, rms_ratios


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


def test_adam_refuses_bad_lr_scales():
    params = [torch.zeros(2, requires_grad=True) for _ in range(2)]
    with pytest.raises(Exception, match="2 parameters"):
        cartridges_core.Adam(params, lr_scales=[1.0])
    with pytest.raises(Exception, match="finite"):
        cartridges_core.Adam(params, lr_scales=[1.0, float("nan")])


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
