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
- ``KVBRIDGE_SGLANG_INSTANCE_NAME``: a decode server's ``instance_name`` (overrides the file's), set
  per server since one file often serves several. Never guessed: SGLang's host and port are
  the same in two containers of one host (``0.0.0.0:30001``), and the bootstrap port and DP rank
  are the same on every decode server, so a default could give two live servers one name (each
  one's handshake would fail the other's rooms). With ``dp_size`` > 1 each DP rank's scheduler
  appends ``-dp<rank>`` (:func:`for_dp_rank`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import replace

from kvbridge.config import ConfigError, TransferConfig

__all__ = ["BACKEND_ENV", "CONFIG_ENV", "INSTANCE_ENV", "enabled", "for_dp_rank", "transfer_config"]

BACKEND_ENV = "KVBRIDGE_SGLANG_BACKEND"
CONFIG_ENV = "KVBRIDGE_SGLANG_CONFIG"
INSTANCE_ENV = "KVBRIDGE_SGLANG_INSTANCE_NAME"


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
    if env.get(INSTANCE_ENV):
        values["instance_name"] = env[INSTANCE_ENV]
    try:
        return TransferConfig.from_dict(values)
    except ConfigError as exc:
        where = f" (from {CONFIG_ENV}={path!r})" if path else ""
        if exc.field == "instance_name" and env.get(INSTANCE_ENV):
            where = f" (from {INSTANCE_ENV})"
        raise ConfigError(f"kvbridge's SGLang settings{where}: {exc}", exc.field) from None


def for_dp_rank(config: TransferConfig, dp_rank: int | None, dp_size: int) -> TransferConfig:
    """``config`` for the scheduler of data-parallel rank ``dp_rank`` of ``dp_size``: a named decode's
    name gets ``-dp<rank>``, since every DP rank's scheduler reads the same settings."""
    if not config.instance_name or dp_size <= 1:
        return config
    if dp_rank is None:
        raise ConfigError(f"instance_name {config.instance_name!r} with dp_size {dp_size}: SGLang gave this "
                          "scheduler no DP rank (KVArgs.system_dp_rank), so its name would be shared; unset "
                          f"{INSTANCE_ENV} / instance_name", "instance_name")
    try:
        return replace(config, instance_name=f"{config.instance_name}-dp{dp_rank}")
    except ConfigError as exc:
        raise ConfigError(f"kvbridge's SGLang settings: {exc} (with dp_size > 1 kvbridge appends -dp<rank>)",
                          exc.field) from None
