"""cartridges: train and serve compact trained KV-cache prefixes that stand in for documents."""

from importlib.metadata import PackageNotFoundError, version

import torch  # noqa: F401  (loads libtorch before the compiled core)

from .cartridge import Cartridge, CartridgeFileError, load_cartridge, load_cartridges, save_cartridges
from .client import Client
from .engine import CacheFullError, ContextLengthError, Engine, EngineBusyError
from .stream import Completion, Delta, GenerationError, Stream, TokenLogprob
from .model import Model, load_model
from .models import ModelLoadError
from .parts import train_parts
from .selfstudy import TrainConfig
from .training import train

try:
    __version__ = version("cartridges")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0"

__all__ = [
    "CacheFullError",
    "Cartridge",
    "CartridgeFileError",
    "Client",
    "Completion",
    "ContextLengthError",
    "Delta",
    "Engine",
    "EngineBusyError",
    "GenerationError",
    "Stream",
    "TokenLogprob",
    "Model",
    "ModelLoadError",
    "TrainConfig",
    "load_cartridge",
    "load_cartridges",
    "load_model",
    "save_cartridges",
    "train",
    "train_parts",
    "__version__",
]
