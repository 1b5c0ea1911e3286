"""cartridges: train and serve compact trained KV-cache prefixes that stand in for documents."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("cartridges")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0"
