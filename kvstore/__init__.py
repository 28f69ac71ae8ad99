"""kvstore: tiered KV-cache offload storage for LLM serving."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("kvstore")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"
