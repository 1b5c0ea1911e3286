"""A cartridge's initial KV by attention matching: the corpus' own KV, compacted (after Zweiger
et al., "Fast KV Compaction via Attention Matching", arXiv 2602.16284).

The corpus is read window by window (each window fits the context however long the corpus).
For each window, one pass over the window read twice gives its KV (first copy) and reference
queries (the second copy's: tokens that come after the window and look back at it, at the
right relative positions). Windows after the first are read behind the corpus' first token,
which takes the attention sink's role there as it does in the cartridge's first slot, so that
no window's own first token is kept as a second sink. Then, per layer and key-value head:

- keys: the window's keys that the reference queries attend to most (the window's first
  token always, in the first window: the attention sink), in their order;
- optionally (`bias=True`), attention biases (the paper's beta): one per kept key, fitted by
  non-negative least squares so that each reference query's attention mass on the kept keys,
  sum exp(score + bias), matches its mass on the whole window. Without them a window's few kept
  keys draw a fraction of the attention the window drew; with them each window weighs what it
  weighed in the full context. On the default model and a corpus twice its context they
  lowered the recovered fraction and broke the replies (the corpus' full mass, beyond the
  context, drowns the conversation), so they are off by default;
- values: solved by least squares so that attention over the kept keys (with their biases)
  reproduces each reference query's attention output over the whole window
  (ridge-regularized toward the kept keys' own values);
- the kept keys are rotated from their position in the window to their slot in the cartridge.

Each window gets a share of the cartridge's tokens proportional to its length, so every part
of the corpus is represented. Biases, when asked for, travel with the cartridge
(`Cartridge.biases`, its file, the engine's attention); training keeps them fixed."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

import cartridges_core

DEFAULT_WINDOW = 2048  # corpus tokens compacted at a time (read twice: 4,096 positions)
DEFAULT_QUERIES = 512  # reference queries per window (evenly spaced over its second copy)
RIDGE = 1e-3  # pull of the solved values toward the kept keys' own values (relative to the Gram's scale)
MASS_STEPS = 300  # multiplicative updates of the mass-matching weights
MIN_WEIGHT = 1e-6  # smallest mass weight (a bias of about -13.8): a key the fit drops still exists


def window_shares(corpus_tokens: int, num_tokens: int, window: int) -> list[tuple[int, int, int]]:
    """(start, end, kept tokens) per window: kept tokens proportional to the window's length,
    at least one each, summing to `num_tokens`."""
    bounds = [(start, min(start + window, corpus_tokens)) for start in range(0, corpus_tokens, window)]
    if num_tokens < len(bounds):
        raise ValueError(f"a {num_tokens}-token cartridge cannot keep a token of each of the corpus' {len(bounds)} "
                         f"windows of {window} tokens: compact it to at least {len(bounds)} tokens")
    exact = [(end - start) * num_tokens / corpus_tokens for start, end in bounds]
    kept = [max(1, math.floor(x)) for x in exact]
    # hand out what rounding left, to the windows that lost most to it
    by_loss = sorted(range(len(bounds)), key=lambda i: kept[i] - exact[i])
    for i in by_loss[: num_tokens - sum(kept)]:
        kept[i] += 1
    while sum(kept) > num_tokens:  # the at-least-one rule overshot
        i = max(range(len(kept)), key=lambda j: kept[j])
        kept[i] -= 1
    return [(start, end, k) for (start, end), k in zip(bounds, kept)]


@torch.no_grad()
def compact_prefix(native: Any, tokens: list[int], num_tokens: int, *, window: int = DEFAULT_WINDOW,
                   queries: int = DEFAULT_QUERIES, bias: bool = False,
                   on_window: Callable[[int, int], object] | None = None) -> cartridges_core.KVPrefix:
    """A `num_tokens`-token KV prefix (float32, keys at positions 0..num_tokens-1) compacted from
    the KV of `tokens` by attention matching. `native`: the C++ model. `bias`: give each kept key
    an attention bias so that the kept keys carry their window's attention mass (off by default:
    it lowered what the compact KV recovers, docs/experiments.md, "Do per-key attention biases
    help the compact KV?"). `on_window(done, total)` is called after each window (a 100K-token
    corpus has 49 of 2,048 tokens, each some seconds); an exception it raises stops the work."""
    config = native.config
    if num_tokens >= len(tokens):
        return native.prefix_from_tokens(torch.tensor(tokens, dtype=torch.long))
    window = min(window, (config.max_position_embeddings - 1) // 2)  # sink + the window twice fit the context
    group = config.num_heads // config.num_kv_heads
    keys: list[list[torch.Tensor]] = [[] for _ in range(config.num_layers)]
    values: list[list[torch.Tensor]] = [[] for _ in range(config.num_layers)]
    biases: list[list[torch.Tensor]] = [[] for _ in range(config.num_layers)]
    slot = 0
    shares = window_shares(len(tokens), num_tokens, window)
    for done, (start, end, kept) in enumerate(shares):
        piece = tokens[start:end]
        width, sink = len(piece), [tokens[0]] if start > 0 else []
        first = len(sink)  # the window's first copy starts here
        sequence = torch.tensor(sink + piece + piece, dtype=torch.long)
        layer_queries, prefix = native.queries_and_prefix(sequence)
        rows = torch.linspace(first + width, first + 2 * width - 1, min(queries, width)).round().long()
        for layer in range(config.num_layers):
            q_all = layer_queries[layer][:, rows].float()  # [H, n, D]
            k_all = prefix.keys[layer][:, first : first + width].float()  # [Hkv, W, D]
            v_all = prefix.values[layer][:, first : first + width].float()
            layer_keys, layer_values, layer_biases = [], [], []
            for head in range(config.num_kv_heads):
                q = q_all[head * group : (head + 1) * group].reshape(-1, config.head_dim)
                chosen, solved, key_bias = _match_head(q, k_all[head], v_all[head], kept, keep_first=start == 0,
                                                       with_bias=bias)
                # from the key's position in the pass to its slot in the cartridge
                positions = torch.arange(slot, slot + kept, device=chosen.device) - (first + chosen)
                layer_keys.append(native.rotate(k_all[head][chosen].unsqueeze(0), positions)[0])
                layer_values.append(solved)
                layer_biases.append(key_bias)
            keys[layer].append(torch.stack(layer_keys))
            values[layer].append(torch.stack(layer_values))
            biases[layer].append(torch.stack(layer_biases))
        slot += kept
        if on_window is not None:
            on_window(done + 1, len(shares))
    return cartridges_core.KVPrefix([torch.cat(k, 1).contiguous() for k in keys],
                                    [torch.cat(v, 1).contiguous() for v in values],
                                    [torch.cat(b, 1).float().contiguous() for b in biases] if bias else None)


def _match_head(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kept: int, keep_first: bool,
                with_bias: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Kept key indexes (ascending), solved values [kept, D] and attention biases [kept] (zero
    without `with_bias`) for one head: q [n, D] reference queries that see all of k, v [W, D]."""
    scores = q @ k.T / math.sqrt(k.shape[-1])  # [n, W]
    weights = scores.softmax(-1)
    importance = weights.amax(0) + weights.mean(0)  # keys some query relies on, and keys many use
    if keep_first:
        importance[0] = float("inf")
    chosen = importance.topk(kept).indices.sort().values
    bias = _mass_bias(scores, chosen) if with_bias else scores.new_zeros(kept)
    target = weights @ v  # [n, D] attention output over the whole window
    compact = (scores[:, chosen] + bias).softmax(-1)  # [n, kept] attention over the kept keys alone
    gram = compact.T @ compact
    ridge = RIDGE * gram.diagonal().mean().clamp_min(1e-12)
    eye = torch.eye(kept, dtype=gram.dtype, device=gram.device)
    solved = torch.linalg.solve(gram + ridge * eye, compact.T @ target + ridge * v[chosen])
    return chosen, solved, bias


def _mass_bias(scores: torch.Tensor, chosen: torch.Tensor, steps: int = MASS_STEPS) -> torch.Tensor:
    """Per kept key, the log-weight b >= log(MIN_WEIGHT) such that for every reference query the
    kept keys' attention mass, sum_j exp(s_j + b_j), matches the whole window's, sum_all exp(s):
    non-negative least squares on the weights exp(b), relative to each query's mass, by
    multiplicative updates (Lee and Seung), which keep the weights non-negative."""
    shifted = scores - scores.amax(-1, keepdim=True)
    full = shifted.exp().sum(-1, keepdim=True)  # [n, 1] the window's mass per query
    a = shifted[:, chosen].exp() / full  # [n, kept]: each kept key's share of its query's mass
    gram, target = a.T @ a, a.T @ a.new_ones(a.shape[0], 1)
    weights = a.new_full((a.shape[1], 1), float(a.shape[0] / a.sum().clamp_min(1e-30)))
    for _ in range(steps):
        weights = weights * target / (gram @ weights).clamp_min(1e-30)
    return weights.squeeze(1).clamp_min(MIN_WEIGHT).log()
