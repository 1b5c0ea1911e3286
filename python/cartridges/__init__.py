"""cartridges: train and serve compact trained KV-cache prefixes that stand in for documents."""

from importlib.metadata import PackageNotFoundError, version

import torch  # noqa: F401  (loads libtorch before the compiled core)

from .model import Completion, Model, load_model
from .models import ModelLoadError

try:
    __version__ = version("cartridges")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0"

__all__ = ["Completion", "Model", "ModelLoadError", "load_model", "__version__"]
