"""The HTTP service: an OpenAI-compatible API over the store and the engine.

`create_app(settings)` builds the FastAPI application; nothing is built at import time.
"""

from cartridges.server.app import create_app
from cartridges.server.settings import Settings

__all__ = ["Settings", "create_app"]
