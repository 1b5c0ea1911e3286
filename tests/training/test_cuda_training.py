"""Training on CUDA (skipped without a GPU): the training loop on the GPU follows the CPU's on
the same data, in float32 and in bfloat16; self-study runs end to end there (synthesis on the
GPU's engine, compaction, training, the quality report); the cartridge stays float32."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import cartridges_core
from cartridges.training import resolved_training_dtype, train

from .test_selfstudy import TEXT, small_config
from .tiny import TinyModel, tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def on_cuda(cpu: TinyModel, dtype: str) -> TinyModel:
    native = cartridges_core.LlamaModel(cpu.config, cpu.weights, "cuda", dtype)
    return dataclasses.replace(cpu, native=native)


@pytest.fixture(scope="module")
def cpu_model():
    return tiny_model()


def max_relative_error(ours: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    return max(float((a.float().cpu() - b).abs().max() / b.abs().max()) for a, b in zip(ours, reference))


def test_training_on_cuda_follows_the_cpu_on_the_same_data(cpu_model):
    config = small_config(quality_samples=0, training_dtype="float32")
    reference = train(cpu_model, [TEXT], config, progress=False)
    data = reference.stats["data"]

    f32 = train(on_cuda(cpu_model, "float32"), [TEXT], config, progress=False, data=data)
    assert f32.stats["steps"] == reference.stats["steps"]
    assert f32.stats["losses"] == pytest.approx(reference.stats["losses"], rel=1e-3)
    assert max_relative_error(f32.keys + f32.values, reference.keys + reference.values) < 1e-3

    model = on_cuda(cpu_model, "bfloat16")
    assert resolved_training_dtype(model.native, "auto") == "model"  # bfloat16 already
    bf16 = train(model, [TEXT], config.replace(training_dtype="auto"), progress=False, data=data)
    assert bf16.config["training_dtype"] == "model"
    assert all(k.dtype == torch.float32 for k in bf16.keys + bf16.values)  # the cartridge is float32
    assert bf16.stats["losses"] == pytest.approx(reference.stats["losses"], rel=0.03)
    assert max_relative_error(bf16.keys + bf16.values, reference.keys + reference.values) < 0.05


def test_self_study_runs_end_to_end_on_cuda(cpu_model):
    """Synthesis on the GPU's engine, the compact start, training and the quality report; the
    cartridge then answers on the GPU as its KV in front of the prompt."""
    model = on_cuda(cpu_model, "bfloat16")
    seen = []
    cart = train(model, [TEXT], small_config(init="compact"), progress=False,
                 on_progress=lambda *a: seen.append(a[0]))
    assert {"compaction", "synthesis", "training"} <= set(seen)
    assert cart.stats["steps"] == 6 and all(math.isfinite(x) for x in cart.stats["losses"])
    assert cart.stats["losses"][-1] < cart.stats["losses"][0]
    assert all(k.dtype == torch.float32 and torch.isfinite(k).all() for k in cart.keys + cart.values)
    quality = cart.stats["quality"]
    assert quality is not None and math.isfinite(quality["loss"]) and math.isfinite(quality["init_loss"])
    prompt = model.tokenizer.encode_chat([{"role": "user", "content": "Bells?"}])
    reply = model.engine.submit(prompt, prefixes=[cart], max_new_tokens=8, stop_token_ids=[]).result()
    assert len(reply.tokens) == 8
