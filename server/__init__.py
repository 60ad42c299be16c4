"""The HTTP edge of ktserve: FastAPI app, OpenAI wire models, routes, SSE, auth, errors."""
from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("ktserve")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+source"
