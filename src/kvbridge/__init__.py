"""kvbridge: moves KV cache, model state and request metadata from prefill to decode."""

from importlib.metadata import PackageNotFoundError, version as _version

from .core import *  # noqa: F401,F403
from .core import __all__ as _core_all

try:
    __version__ = _version("kvbridge")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0+unknown"

__all__ = ["__version__", *_core_all]
