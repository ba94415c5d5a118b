"""``kv_connector_extra_config``: kvbridge's transfer settings plus the connector's own keys."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from kvbridge.config import ConfigError, TransferConfig

__all__ = ["ConnectorSettings", "CONNECTOR_KEYS"]

#: Keys the connector reads itself; every other key goes to ``TransferConfig.from_dict``.
CONNECTOR_KEYS = ("serve_bootstrap",)


@dataclass(frozen=True)
class ConnectorSettings:
    """``transfer``: what ``TransferConfig.from_dict`` made of the extra config (backend, options,
    bootstrap, secret file, timeouts, instance name). ``serve_bootstrap``: prefill's TP rank 0 worker runs the
    bootstrap endpoint at ``transfer.bootstrap`` (default true; false when it runs elsewhere).

    ``instance_name`` (decode) is never guessed: vLLM's ``engine_id`` is a new random id at every start
    unless set, and nothing else in its config is both kept across a restart and unique among live
    engines, so a decode is unnamed unless the extra config names it. With data parallelism every DP
    engine reads the same extra config, so each one's name gets ``-dp<rank>`` (vLLM's global DP rank),
    as vLLM suffixes ``engine_id``: two engines of one name would fail each other's rooms."""

    transfer: TransferConfig
    serve_bootstrap: bool = True

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None, kv_role: str | None, *, dp_rank: int = 0,
                          dp_size: int = 1) -> ConnectorSettings:
        """The settings of one engine: ``kv_connector_extra_config`` checked, its name made unique per DP rank."""
        extra = dict(extra or {})
        serve = extra.pop("serve_bootstrap", True)
        if isinstance(serve, str) and serve.strip().lower() in ("true", "1", "yes", "false", "0", "no"):
            serve = serve.strip().lower() in ("true", "1", "yes")
        if not isinstance(serve, bool):
            raise ConfigError(f"kv_connector_extra_config.serve_bootstrap must be true or false, got {serve!r}")
        try:
            transfer = TransferConfig.from_dict(extra)
        except ConfigError as exc:
            raise ConfigError(f"kv_connector_extra_config: {exc} (the connector's own keys: "
                              f"{', '.join(CONNECTOR_KEYS)})", exc.field) from None
        if kv_role in ("kv_producer", "kv_both") and transfer.bootstrap is None:
            raise ConfigError(
                f"kv_role {kv_role!r} needs kv_connector_extra_config.bootstrap = \"HOST:PORT\": the address decode "
                "servers reach this prefill server's bootstrap endpoint at (its TP rank 0 worker serves it)",
                "bootstrap",
            )
        if transfer.instance_name and dp_size > 1:
            try:
                transfer = replace(transfer, instance_name=f"{transfer.instance_name}-dp{dp_rank}")
            except ConfigError as exc:
                raise ConfigError(f"kv_connector_extra_config: {exc} (with data parallelism the connector appends "
                                  f"-dp<rank> to instance_name)", exc.field) from None
        return cls(transfer, serve)
