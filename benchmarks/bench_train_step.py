"""Training speed (on the CPU, or --device cuda): one distillation step (forward and backward through the cartridge)
with the core (`cartridges_core.distillation_loss_sum`, what `train_cartridge` runs) against the
same step written in plain PyTorch on the same float32 weights (batched rows, ATen's
scaled_dot_product_attention, autograd), in the same process.

    .venv/bin/python benchmarks/bench_train_step.py [--cartridge-tokens 1024] [--rows 4]
        [--row-tokens 320] [--top-k 20] [--repeats 5] [--dtype float32|bfloat16] [--device cpu|cuda]

The data is random conversations of `row-tokens` tokens with the last half as targets and a
random top-k teacher: the step's cost depends on the shapes, not on the text. Both steps
compute the same loss (checked to 1e-3 relative) and the gradients of the same cartridge.
Tokens per second count the conversations' tokens of a step. Target (issue 32): ≥ 2x plain
PyTorch. `--dtype bfloat16`: both steps compute in bfloat16 (the model's weights, the
activations, the cartridge as read), with float32 master copies of the cartridge and float32
log-softmax, as the core does for a bfloat16 model. `--device cuda`: both steps on the GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import cartridges
import cartridges_core

RESULTS = Path(__file__).resolve().parent / "results" / "train_step.json"


def plain_loss_sum(weights: dict[str, torch.Tensor], c, data, keys: list[torch.Tensor],
                   values: list[torch.Tensor]) -> torch.Tensor:
    """The distillation loss of every row of `data`, batched, in plain PyTorch."""
    device = keys[0].device
    tokens = data.tokens.to(device)  # every row is full length
    B, S = tokens.shape
    P, H, Hkv, D = keys[0].shape[1], c.num_heads, c.num_kv_heads, c.head_dim
    inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, D, 2, dtype=torch.float32, device=device) / D))
    angles = torch.arange(P, P + S, dtype=torch.float32, device=device)[:, None] * inv_freq[None]
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    positions = torch.arange(P + S, device=device)
    visible = positions[None, :] <= (P + positions[:S])[:, None]  # causal, prefix all visible
    mask = torch.zeros(S, P + S, device=device).masked_fill(~visible, float("-inf"))

    linear = torch.nn.functional.linear

    def rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps) * w

    def rotate(x: torch.Tensor) -> torch.Tensor:
        half = D // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin

    dtype = weights["model.embed_tokens.weight"].dtype
    mask = mask.to(dtype)
    cos, sin = cos.to(dtype), sin.to(dtype)
    keys, values = [k.to(dtype) for k in keys], [v.to(dtype) for v in values]
    x = weights["model.embed_tokens.weight"][tokens]  # [B, S, hidden]
    for layer in range(c.num_layers):
        p = f"model.layers.{layer}."
        h = rms(x, weights[p + "input_layernorm.weight"])
        q = rotate(linear(h, weights[p + "self_attn.q_proj.weight"]).view(B, S, H, D).transpose(1, 2))
        k = rotate(linear(h, weights[p + "self_attn.k_proj.weight"]).view(B, S, Hkv, D).transpose(1, 2))
        v = linear(h, weights[p + "self_attn.v_proj.weight"]).view(B, S, Hkv, D).transpose(1, 2)
        k_all = torch.cat([keys[layer].unsqueeze(0).expand(B, -1, -1, -1), k], 2)
        v_all = torch.cat([values[layer].unsqueeze(0).expand(B, -1, -1, -1), v], 2)
        attn = torch.nn.functional.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, enable_gqa=True)
        x = x + linear(attn.transpose(1, 2).reshape(B, S, H * D), weights[p + "self_attn.o_proj.weight"])
        h = rms(x, weights[p + "post_attention_layernorm.weight"])
        gate, up = linear(h, weights[p + "mlp.gate_proj.weight"]), linear(h, weights[p + "mlp.up_proj.weight"])
        x = x + linear(torch.nn.functional.silu(gate) * up, weights[p + "mlp.down_proj.weight"])
    hidden = rms(x, weights["model.norm.weight"])[data.target_mask.to(device)]  # targets in row-major order
    head = weights.get("lm_head.weight", weights["model.embed_tokens.weight"])
    logprobs = torch.log_softmax(linear(hidden, head).float(), -1)
    return -(data.topk_logprobs.to(device).exp() * logprobs.gather(1, data.topk_ids.to(device))).sum()


def random_data(vocab: int, rows: int, row_tokens: int, top_k: int) -> cartridges_core.TrainingData:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(vocab, (rows, row_tokens), generator=g)
    lengths = torch.full((rows,), row_tokens, dtype=torch.long)
    mask = torch.zeros(rows, row_tokens, dtype=torch.bool)
    mask[:, row_tokens // 2: row_tokens - 1] = True
    targets = int(mask.sum())
    ids = torch.randint(vocab, (targets, top_k), generator=g)
    logprobs = torch.log_softmax(torch.randn(targets, top_k, generator=g), -1)
    return cartridges_core.TrainingData(tokens, lengths, mask, ids, logprobs)


def timed(step, repeats: int) -> tuple[float, float]:
    step()  # warm-up
    times, loss = [], 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        loss = step()
        times.append(time.perf_counter() - start)
    return statistics.median(times), loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cartridge-tokens", type=int, default=1024)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--row-tokens", type=int, default=320)
    parser.add_argument("--top-k", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args()

    from cartridges.models import load_weights

    loaded = load_weights()
    model = cartridges.Model.from_loaded(loaded, device=args.device, dtype=args.dtype)
    weights = {name: t.to(args.device, getattr(torch, args.dtype)) for name, t in loaded.tensors.items()}
    config = model.native.config
    data = random_data(config.vocab_size, args.rows, args.row_tokens, args.top_k)
    prefix = model.native.prefix_from_tokens(torch.randint(config.vocab_size, (args.cartridge_tokens,)))
    params = cartridges_core.CartridgeParams(prefix, 1)  # float32 master copies
    rows = list(range(args.rows))

    def core_step() -> float:
        for t in (*params.trainable_keys, *params.trainable_values):
            t.grad = None
        loss, _ = cartridges_core.distillation_loss_sum(model.native, params, data, rows)
        loss.backward()
        return loss.item()

    keys = [k.detach().float().clone().requires_grad_(True) for k in prefix.keys]
    values = [v.detach().float().clone().requires_grad_(True) for v in prefix.values]

    def plain_step() -> float:
        for t in (*keys, *values):
            t.grad = None
        loss = plain_loss_sum(weights, config, data, keys, values)
        loss.backward()
        return loss.item()

    core_s, core_loss = timed(core_step, args.repeats)
    plain_s, plain_loss = timed(plain_step, args.repeats)
    tolerance = 1e-3 if args.dtype == "float32" else 1e-2  # bfloat16 keeps 8 bits of mantissa
    assert abs(core_loss - plain_loss) <= tolerance * abs(plain_loss), (core_loss, plain_loss)
    step_tokens = args.rows * args.row_tokens
    print(f"step: {args.rows} conversations x {args.row_tokens} tokens behind a {args.cartridge_tokens}-token "
          f"cartridge, top-{args.top_k} teacher, {args.dtype} on {args.device}, {torch.get_num_threads()} threads")
    print(f"core         {core_s:6.2f} s/step  {step_tokens / core_s:7.1f} tok/s  loss {core_loss:.4f}")
    print(f"plain PyTorch {plain_s:5.2f} s/step  {step_tokens / plain_s:7.1f} tok/s  loss {plain_loss:.4f}")
    print(f"core / plain: {plain_s / core_s:.2f}x   target ≥ 2x")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    key = args.dtype if args.device == "cpu" else f"{args.device}-{args.dtype}"
    results[key] = {"args": vars(args), "core_s": core_s, "plain_s": plain_s, "ratio": plain_s / core_s,
                    "threads": torch.get_num_threads()}
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
