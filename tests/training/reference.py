"""Plain-PyTorch reference: the Llama forward with a KV prefix, and the distillation loss."""

from __future__ import annotations

import math

import torch


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


def hidden_with_prefix(w, c, tokens: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
    """Final-norm hidden states [S, hidden] of one row `tokens` [S] after a prefix of per-layer
    keys/values [H_kv, P, D] (keys after RoPE)."""
    S, P, H, Hkv, D = tokens.shape[0], keys[0].shape[1], c.num_heads, c.num_kv_heads, c.head_dim
    inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    angles = torch.arange(P, P + S, dtype=torch.float32)[:, None] * inv_freq[None]
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()  # [S, D]
    visible = torch.arange(P + S)[None, :] <= (P + torch.arange(S))[:, None]  # [S, P + S]
    x = w["model.embed_tokens.weight"][tokens]
    for layer in range(c.num_layers):
        p = f"model.layers.{layer}."
        h = _rms(x, w[p + "input_layernorm.weight"], c.rms_norm_eps)
        q = (h @ w[p + "self_attn.q_proj.weight"].T).view(S, H, D).transpose(0, 1)
        k = (h @ w[p + "self_attn.k_proj.weight"].T).view(S, Hkv, D).transpose(0, 1)
        v = (h @ w[p + "self_attn.v_proj.weight"].T).view(S, Hkv, D).transpose(0, 1)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        k_all = torch.cat([keys[layer], k], 1).repeat_interleave(H // Hkv, 0)  # [H, P + S, D]
        v_all = torch.cat([values[layer], v], 1).repeat_interleave(H // Hkv, 0)
        scores = (q @ k_all.transpose(1, 2)) / math.sqrt(D)
        scores = scores.masked_fill(~visible, float("-inf"))
        attn = (scores.softmax(-1) @ v_all).transpose(0, 1).reshape(S, H * D)
        x = x + attn @ w[p + "self_attn.o_proj.weight"].T
        h = _rms(x, w[p + "post_attention_layernorm.weight"], c.rms_norm_eps)
        gate, up = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
        x = x + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    return _rms(x, w["model.norm.weight"], c.rms_norm_eps)


def distillation_loss_sum(w, c, data, rows, keys, values) -> torch.Tensor:
    """-sum over the rows' targets of sum_k exp(teacher_k) * log p_student(id_k)."""
    counts = data.target_mask.sum(1)
    starts = counts.cumsum(0) - counts
    total = torch.zeros(())
    for r in rows:
        n = int(data.lengths[r])
        hidden = hidden_with_prefix(w, c, data.tokens[r, :n], keys, values)
        positions = data.target_mask[r, :n].nonzero().squeeze(1)
        logprobs = torch.log_softmax(hidden[positions] @ w["model.embed_tokens.weight"].T, -1)
        t = slice(int(starts[r]), int(starts[r] + counts[r]))
        total = total - (data.topk_logprobs[t].exp() * logprobs.gather(1, data.topk_ids[t])).sum()
    return total
