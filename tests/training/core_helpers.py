"""What the tests of the C++ training core share: random training data, a cartridge to train,
its plain-PyTorch twin, and the RMS ratios the learning-rate scales are made of."""

from __future__ import annotations

import torch

import cartridges_core
from cartridges.selfstudy import Corpus, TrainConfig
from cartridges.training import init_params



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
