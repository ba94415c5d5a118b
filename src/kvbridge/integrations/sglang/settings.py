"""Which kvbridge backend and settings SGLang's transfers use: environment variables and an optional file.

- ``KVBRIDGE_SGLANG_BACKEND``: the switch. Set (to what ``--transfer-backend``
  takes: a backend name from ``kvbridge plugins``, third-party ones included, or
  lanes separated by commas; or ``default`` for kvbridge's default choice),
  SGLang's transfers go through kvbridge; unset, the plugin changes nothing.
- ``KVBRIDGE_SGLANG_CONFIG``: a JSON file of :class:`~kvbridge.config.TransferConfig`
  fields (``backend_options``, timeouts, ``host``, ``bootstrap``, ``secret_file``,
  ...). Setting it alone also switches kvbridge on (its ``backend``, or the default).
- The secret that authenticates control messages: ``secret_file`` in that file,
  or kvbridge's usual ``KVBRIDGE_SECRET_FILE`` / ``KVBRIDGE_SECRET``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

from kvbridge.config import ConfigError, TransferConfig

__all__ = ["BACKEND_ENV", "CONFIG_ENV", "enabled", "transfer_config"]

BACKEND_ENV = "KVBRIDGE_SGLANG_BACKEND"
CONFIG_ENV = "KVBRIDGE_SGLANG_CONFIG"


def enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether SGLang should use kvbridge (either variable set and non-empty)."""
    env = os.environ if environ is None else environ
    return bool(env.get(BACKEND_ENV) or env.get(CONFIG_ENV))


def transfer_config(environ: Mapping[str, str] | None = None) -> TransferConfig:
    """The settings from the environment (and the file it names); :class:`ConfigError` says what is wrong."""
    env = os.environ if environ is None else environ
    values: dict[str, object] = {}
    path = env.get(CONFIG_ENV)
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                loaded = json.load(f)
        except OSError as exc:
            raise ConfigError(f"{CONFIG_ENV}={path!r}: cannot read it ({exc.strerror})") from None
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{CONFIG_ENV}={path!r}: not valid JSON ({exc})") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"{CONFIG_ENV}={path!r} must hold a JSON object of transfer settings, got {type(loaded).__name__}")
        values.update(loaded)
    backend = env.get(BACKEND_ENV, "")
    if backend:
        values["backend"] = "" if backend == "default" else backend
    try:
        return TransferConfig.from_dict(values)
    except ConfigError as exc:
        where = f" (from {CONFIG_ENV}={path!r})" if path else ""
        raise ConfigError(f"kvbridge's SGLang settings{where}: {exc}", exc.field) from None
