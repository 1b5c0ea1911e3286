"""The dtype a cartridge trains in, decided for a model and its device (`TrainConfig.training_dtype`)."""

from __future__ import annotations

import cartridges_core
import torch


def multiplies_bfloat16_natively(device: str) -> bool:
    """Whether `device` has bfloat16 matrix instructions: a CPU with AVX-512 BF16 or AMX (read
    from Linux's /proc/cpuinfo; False where it cannot be read), a CUDA GPU from compute
    capability 8.0."""
    if device.startswith("cuda"):
        return torch.cuda.is_available() and torch.cuda.get_device_capability(torch.device(device))[0] >= 8
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            flags = next((line.split(":", 1)[1].split() for line in cpuinfo if line.startswith("flags")), [])
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolved_training_dtype(native: cartridges_core.LlamaModel, training_dtype: str) -> str:
    """`TrainConfig.training_dtype` with "auto" decided for `native`: "bfloat16" for a float32
    model on a device that multiplies bfloat16 natively, "model" otherwise."""
    if training_dtype != "auto":
        return training_dtype
    return "bfloat16" if native.dtype == "float32" and multiplies_bfloat16_natively(native.device) else "model"
