"""kvbridge: moves KV cache, model state and request metadata from prefill to decode.

The public names are :mod:`kvbridge.core`'s; they load on first use (PEP 562), so that
``import kvbridge.<module>`` costs only that module: the ``kvbridge`` command catches a
Ctrl-C from its first line (``kvbridge.entry``), and a small tool need not load the
whole library.
"""

from __future__ import annotations

import importlib


def __getattr__(name: str) -> object:  # no typing import: it costs what the laziness saves
    if name == "__version__":
        from importlib.metadata import PackageNotFoundError, version

        try:
            value = version("kvbridge")
        except PackageNotFoundError:  # running from a source tree that is not installed
            value = "0.0.0+unknown"
    elif name == "__all__":
        value = ["__version__", *importlib.import_module(".core", __name__).__all__]
    else:
        core = importlib.import_module(".core", __name__)
        if name == "core":  # ``import kvbridge`` used to load it: ``kvbridge.core.X`` keeps working
            return core
        if name not in core.__all__:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        value = getattr(core, name)
    globals()[name] = value  # once: later reads are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__getattr__("__all__")})
