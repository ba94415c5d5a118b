"""Host-server integration: transfer settings from command-line arguments or a plain dict.

A server that uses argparse adds kvbridge's arguments to its own parser and
builds the managers from the parsed namespace::

    parser = argparse.ArgumentParser()
    kvbridge.cli.add_transfer_args(parser)
    args = parser.parse_args()          # bad backend names and options exit with status 2
    cfg = TransferConfig.from_args(args)
    mgr = PrefillManager(kvargs, cfg.backend, bootstrap=cfg.bootstrap, config=cfg.session_config())

A server without argparse builds the same object from a mapping (its own
config file)::

    cfg = TransferConfig.from_dict({"backend": "nixl", "backend_options": {"xfer_mode": "prepped"},
                                    "bootstrap": "10.0.0.5:8998", "transfer_timeout": 30})

Choices come from the installed plugins. The default backend is the first
*available* one (engine installed) in :data:`BACKEND_PREFERENCE`, then any
other available backend by name. Backend options are checked against the
options the backend declares (``kvbridge plugins`` lists them).
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from kvbridge import ui
from kvbridge.core.description.plugins import BACKEND_PREFERENCE, SAME_HOST_LANES, BackendUnavailableError, PluginError, Registry, get_registry
from kvbridge.core.description.records import OptionError, assign_options
from kvbridge.core.sessions.session import SessionConfig

__all__ = [
    "BACKEND_PREFERENCE",
    "ConfigError",
    "TransferConfig",
    "add_transfer_args",
    "available_backends",
    "default_backend",
]

_SESSION = SessionConfig()
_TIMEOUTS = ("bootstrap_timeout", "waiting_timeout", "transfer_timeout", "heartbeat_interval", "heartbeat_timeout",
             "sender_grace")
# The command-line flag of each field, for error messages.
_FLAGS = {
    "backend": "--transfer-backend",
    "backend_options": "--transfer-option",
    "bootstrap": "--transfer-bootstrap",
    "host": "--transfer-host",
    "bootstrap_timeout": "--transfer-bootstrap-timeout",
    "waiting_timeout": "--transfer-waiting-timeout",
    "transfer_timeout": "--transfer-timeout",
    "heartbeat_interval": "--transfer-heartbeat-interval",
    "heartbeat_timeout": "--transfer-heartbeat-timeout",
    "sender_grace": "--transfer-sender-grace",
    "warm_timeout": "--transfer-warm-timeout",
    "fence_timeout": "--transfer-fence-timeout",
    "strict_index_lengths": "--transfer-strict-index-lengths",
    "checksum": "--transfer-checksum",
    "staging": "--transfer-staging",
    "secret_file": "--transfer-secret-file",
    "instance_name": "--transfer-instance-name",
}

#: What ``instance_name`` may be: short, printable, no spaces (it appears in logs and failure reasons).
INSTANCE_NAME = re.compile(r"[A-Za-z0-9._:@/+-]{1,128}")


class ConfigError(ValueError):
    """A transfer setting is wrong; the text says which, the value, and what is allowed.

    ``field`` names the :class:`TransferConfig` field at fault, when there is one.
    """

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


def available_backends(registry: Registry | None = None) -> list[str]:
    """Installed backends whose engine is installed too, best first (see :data:`BACKEND_PREFERENCE`)."""
    return (registry or get_registry()).available_backends()


def default_backend(registry: Registry | None = None) -> str | None:
    """The best available backend that moves bytes between hosts, or None if there is none."""
    return (registry or get_registry()).default_backend()


def _check_address(value: str) -> str:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{value!r} is not HOST:PORT (a port from 1 to 65535)")
    return value


def _check_instance_name(value: object) -> str:
    """``value`` if it is a valid ``instance_name`` ("" for none); ValueError saying what is allowed otherwise."""
    if not isinstance(value, str) or (value and not INSTANCE_NAME.fullmatch(value)):
        raise ValueError(
            f"instance_name must be a short printable name, 1 to 128 of letters, digits and . _ : @ / + - "
            f"(e.g. the decode server's address, 'decode-3:8200'), or empty for none; got {value!r:.200}"
        )
    return value


def _parse_option(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"expected KEY=VALUE, got {text!r}")
    return key.strip(), value


@dataclass(frozen=True)
class TransferConfig:
    """Everything a host server decides about transfers, validated on construction.

    ``backend`` empty means the best available one. ``backend_options`` are
    checked against the backend's declared options; ``bootstrap`` is the
    prefill bootstrap endpoint (``HOST:PORT``, needed by prefill managers);
    ``host`` is the address this rank's control and engine endpoints listen
    on. The rest are :class:`~kvbridge.core.sessions.session.SessionConfig` settings.
    Raises :class:`ConfigError`.
    """

    backend: str = ""
    backend_options: Mapping[str, str] = field(default_factory=dict)
    bootstrap: str | None = None
    host: str = _SESSION.host
    bootstrap_timeout: float = _SESSION.bootstrap_timeout
    waiting_timeout: float = _SESSION.waiting_timeout
    transfer_timeout: float = _SESSION.transfer_timeout
    heartbeat_interval: float = _SESSION.heartbeat_interval
    heartbeat_timeout: float = _SESSION.heartbeat_timeout
    sender_grace: float = _SESSION.sender_grace
    #: Prefill: how long a handshake's answer waits for the lanes to prepare for the peer (0: answer at
    #: once; see SessionConfig.warm_timeout).
    warm_timeout: float = _SESSION.warm_timeout
    #: None: ``transfer_timeout + heartbeat_timeout`` (see SessionConfig.fence_timeout).
    fence_timeout: float | None = _SESSION.fence_timeout
    strict_index_lengths: bool = _SESSION.strict_index_lengths
    #: Verify each room end to end with a hash (host and GPU memory; see SessionConfig.checksum).
    checksum: bool = _SESSION.checksum
    #: Staging of fragmented host-memory windows: gather, auto, on or off (see SessionConfig.staging).
    staging: str = _SESSION.staging
    #: A file holding the secret that authenticates control messages (docs/security.md);
    #: unset: ``$KVBRIDGE_SECRET_FILE`` or ``$KVBRIDGE_SECRET``. The secret itself is never a setting.
    secret_file: str | None = _SESSION.secret_file
    #: Decode: this instance's name, kept across its restarts and used by no other live instance
    #: ("": unnamed). A prefill rank fails a restarted named decode's old rooms as soon as the new
    #: process handshakes, instead of when its lease lapses (see SessionConfig.instance_name).
    instance_name: str = _SESSION.instance_name

    def __post_init__(self) -> None:
        registry = get_registry()
        try:
            backend = self.backend or registry.default_lanes(same_host=False)[-1]
            specs = registry.lanes(backend)
        except (PluginError, BackendUnavailableError) as exc:
            raise ConfigError(str(exc), "backend") from None
        try:
            options: dict[str, str] = {}
            for spec, mine in zip(specs, assign_options(specs, self.backend_options)):
                options.update(spec.check_options(mine))
        except OptionError as exc:
            raise ConfigError(str(exc), "backend_options") from None
        object.__setattr__(self, "backend", backend)
        object.__setattr__(self, "backend_options", options)
        if self.bootstrap is not None:
            try:
                _check_address(self.bootstrap)
            except ValueError as exc:
                raise ConfigError(f"bootstrap address {exc}", "bootstrap") from None
        if not isinstance(self.host, str) or not self.host:
            raise ConfigError(f"host must be a non-empty address, got {self.host!r}", "host")
        for flag in ("strict_index_lengths", "checksum"):
            if not isinstance(getattr(self, flag), bool):
                raise ConfigError(f"{flag} must be true or false, got {getattr(self, flag)!r}", flag)
        if self.secret_file is not None and (not isinstance(self.secret_file, str) or not self.secret_file):
            raise ConfigError(f"secret_file must be a file name, got {self.secret_file!r}", "secret_file")
        try:
            _check_instance_name(self.instance_name)
        except ValueError as exc:
            raise ConfigError(str(exc), "instance_name") from None
        for name in _TIMEOUTS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ConfigError(f"{name} must be a number of seconds, got {value!r}", name)
            object.__setattr__(self, name, float(value))
        if isinstance(self.warm_timeout, bool) or not isinstance(self.warm_timeout, (int, float)) or not self.warm_timeout >= 0:
            raise ConfigError(f"warm_timeout must be a number of seconds >= 0, got {self.warm_timeout!r}", "warm_timeout")
        object.__setattr__(self, "warm_timeout", float(self.warm_timeout))
        if self.fence_timeout is not None:
            if isinstance(self.fence_timeout, bool) or not isinstance(self.fence_timeout, (int, float)):
                raise ConfigError(f"fence_timeout must be a number of seconds or None, got {self.fence_timeout!r}",
                                  "fence_timeout")
            object.__setattr__(self, "fence_timeout", float(self.fence_timeout))
        try:
            self.session_config()
        except ValueError as exc:
            name = str(exc).split(" ", 1)[0]
            raise ConfigError(str(exc), name if name in _FLAGS else None) from None

    def session_config(self) -> SessionConfig:
        """The :class:`SessionConfig` for :class:`PrefillManager` / :class:`DecodeManager`."""
        return SessionConfig.from_fields(self)

    def to_dict(self) -> dict[str, Any]:
        """Plain data that :meth:`from_dict` accepts."""
        out = asdict(self)
        out["backend_options"] = dict(self.backend_options)
        return out

    @classmethod
    def from_dict(cls, mapping: Mapping[str, Any]) -> TransferConfig:
        """Build from a plain mapping whose keys are this class's field names.

        Unknown keys are an error listing the known ones. ``backend_options``
        may be a mapping or a list of ``"KEY=VALUE"`` strings; timeouts may
        be numbers or numeric strings.
        """
        if not isinstance(mapping, Mapping):
            raise ConfigError(f"transfer config must be a mapping, got {type(mapping).__name__}")
        known = [f.name for f in fields(cls)]
        unknown = sorted(str(k) for k in mapping if k not in known)
        if unknown:
            raise ConfigError(f"unknown transfer config key(s) {', '.join(map(repr, unknown))}; known keys: {', '.join(known)}")
        values = dict(mapping)
        for name in ("backend", "instance_name"):  # JSON null: the default
            if name in values and values[name] is None:
                values.pop(name)
        if "backend_options" in values:
            values["backend_options"] = _options_from(values["backend_options"])
        for name in (*_TIMEOUTS, "warm_timeout"):
            if isinstance(values.get(name), str):
                try:
                    values[name] = float(values[name])
                except ValueError:
                    raise ConfigError(f"{name} must be a number of seconds, got {values[name]!r}", name) from None
        if isinstance(values.get("fence_timeout"), str):
            text = values["fence_timeout"].strip()
            try:
                values["fence_timeout"] = None if text.lower() in ("", "none", "default") else float(text)
            except ValueError:
                raise ConfigError(f"fence_timeout must be a number of seconds or none, got {text!r}", "fence_timeout") from None
        for flag in ("strict_index_lengths", "checksum"):
            if isinstance(values.get(flag), str):
                text = values[flag].strip().lower()
                if text in ("true", "1", "yes", "on", "false", "0", "no", "off"):
                    values[flag] = text in ("true", "1", "yes", "on")
        return cls(**values)

    @classmethod
    def from_args(cls, namespace: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> TransferConfig:
        """Build from arguments parsed by a parser that :func:`add_transfer_args` extended.

        The transfer arguments are checked together here (a backend's options
        depend on the backend chosen). Pass the ``parser`` to report a problem
        through ``parser.error`` (usage, exit status 2); without it a
        :class:`ConfigError` is raised.
        """
        missing = [d for d in _ARG_DESTS.values() if not hasattr(namespace, d)]
        if missing:
            raise ConfigError(
                f"the parsed arguments lack {', '.join(missing)}; call add_transfer_args(parser) before parsing"
            )
        values: dict[str, Any] = {name: getattr(namespace, dest) for name, dest in _ARG_DESTS.items()}
        values["backend"] = values["backend"] or ""
        try:
            values["backend_options"] = _options_from(values["backend_options"] or ())
            return cls(**values)
        except ConfigError as exc:
            if parser is None:
                raise
            flag = _FLAGS.get(exc.field or "")
            parser.error(f"argument {flag}: {exc}" if flag else str(exc))
            raise  # parser.error exits; this keeps type checkers content


# TransferConfig field -> argparse dest
_ARG_DESTS = {
    "backend": "transfer_backend",
    "backend_options": "transfer_options",
    "bootstrap": "transfer_bootstrap",
    "host": "transfer_host",
    "bootstrap_timeout": "transfer_bootstrap_timeout",
    "waiting_timeout": "transfer_waiting_timeout",
    "transfer_timeout": "transfer_timeout",
    "heartbeat_interval": "transfer_heartbeat_interval",
    "heartbeat_timeout": "transfer_heartbeat_timeout",
    "sender_grace": "transfer_sender_grace",
    "warm_timeout": "transfer_warm_timeout",
    "fence_timeout": "transfer_fence_timeout",
    "strict_index_lengths": "transfer_strict_index_lengths",
    "checksum": "transfer_checksum",
    "staging": "transfer_staging",
    "secret_file": "transfer_secret_file",
    "instance_name": "transfer_instance_name",
}


def _options_from(value: Any) -> dict[str, str]:
    """Options as a dict, from a mapping or ``KEY=VALUE`` strings (a later key wins)."""
    if isinstance(value, Mapping):
        return {str(k): v if isinstance(v, str) else str(v) for k, v in value.items()}
    if isinstance(value, str) or not isinstance(value, Iterable):
        raise ConfigError(
            f"backend_options must be a mapping or a list of KEY=VALUE strings, got {value!r}", "backend_options"
        )
    out: dict[str, str] = {}
    for item in value:
        if isinstance(item, tuple) and len(item) == 2:
            key, text = item
        else:
            try:
                key, text = _parse_option(str(item))
            except ValueError as exc:
                raise ConfigError(f"backend option {exc}", "backend_options") from None
        out[str(key)] = str(text)
    return out


# -- argparse --------------------------------------------------------------------------
def _backend_type(name: str) -> str:
    """Check a ``--transfer-backend`` value (a name, or names separated by commas) against the installed plugins."""
    try:
        get_registry().lanes(name)
    except PluginError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return name


def _option_type(text: str) -> tuple[str, str]:
    try:
        return _parse_option(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


_seconds_type = ui.positive_number("seconds")


def _address_type(text: str) -> str:
    try:
        return _check_address(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _instance_name_type(text: str) -> str:
    try:
        return _check_instance_name(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_transfer_args(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """Add kvbridge's transfer arguments to a host server's ``parser``; returns their group.

    ``--transfer-backend`` (choices: the installed, available backends;
    default: the best available, see :data:`BACKEND_PREFERENCE`; an unknown
    name lists the installed ones and says a plugin may be missing),
    repeatable ``--transfer-option KEY=VALUE``, ``--transfer-bootstrap
    HOST:PORT``, ``--transfer-host`` and the timeouts. Build the settings with
    ``TransferConfig.from_args(args, parser)`` right after parsing: it checks
    the options against the chosen backend's declared ones, and every error
    exits through ``parser.error`` (status 2). The host's parser is not
    modified beyond the added arguments.
    """
    registry = get_registry()
    names = available_backends(registry)
    best = registry.default_backend()
    group = parser.add_argument_group("kvbridge transfer")
    order = " > ".join(BACKEND_PREFERENCE) + " > others that reach other hosts"
    group.add_argument(
        "--transfer-backend", dest="transfer_backend", type=_backend_type, default=best,
        metavar="{" + ",".join(names) + "}" if names else "NAME",
        help=f"transfer backend, or backends in order separated by commas (lanes: each pair of memory regions goes "
             f"to the first that moves it, e.g. cuda_ipc,nixl); one name gets the installed same-host lanes "
             f"({', '.join(SAME_HOST_LANES)}) before it (default: {best or 'none available'}, the first available "
             f"of {order})",
    )
    declared = "; ".join(
        f"{name}: {', '.join(o.name for o in registry.backend_spec(name).options) or '-'}" for name in names
    )
    group.add_argument(
        "--transfer-option", dest="transfer_options", type=_option_type, action="append", default=[],
        metavar="KEY=VALUE",
        help="a setting of the chosen backend, repeatable; a later KEY wins"
        + (f" (options: {declared}; `kvbridge plugins` explains them)" if declared else ""),
    )
    group.add_argument("--transfer-bootstrap", dest="transfer_bootstrap", type=_address_type, metavar="HOST:PORT",
                       help="the prefill bootstrap endpoint")
    group.add_argument("--transfer-host", dest="transfer_host", default=_SESSION.host, metavar="HOST",
                       help=f"address this rank's control and engine endpoints listen on (default: {_SESSION.host})")
    for name, what in (
        ("bootstrap_timeout", "find and handshake with the prefill ranks"),
        ("waiting_timeout", "decode waits for a whole room"),
        ("transfer_timeout", "one chunk's write"),
        ("heartbeat_interval", "between heartbeats"),
        ("heartbeat_timeout", "silence before a peer is declared dead"),
        ("sender_grace", "prefill keeps a request whose room has no sender yet, then fails it"),
    ):
        group.add_argument(
            _FLAGS[name], dest=_ARG_DESTS[name], type=_seconds_type, default=getattr(_SESSION, name), metavar="SECONDS",
            help=f"{what} (default: {getattr(_SESSION, name):g})",
        )
    group.add_argument(
        _FLAGS["fence_timeout"], dest=_ARG_DESTS["fence_timeout"], type=_seconds_type, default=None, metavar="SECONDS",
        help="decode waits this long for prefill to confirm it stopped writing a given-up room before reporting "
             "FAILED (default: transfer timeout + heartbeat timeout)",
    )
    group.add_argument(
        _FLAGS["warm_timeout"], dest=_ARG_DESTS["warm_timeout"], type=ui.non_negative_number("seconds"),
        default=_SESSION.warm_timeout, metavar="SECONDS",
        help="prefill answers a decode rank's handshake once its lanes prepared for that peer's writes (compiled "
             f"the GPU copy's kernels, connected), at most this long; 0: at once (default: {_SESSION.warm_timeout:g})",
    )
    group.add_argument("--transfer-strict-index-lengths", dest="transfer_strict_index_lengths", action="store_true",
                       help="treat every index-length mismatch as an error (default: trim page lists with a warning)")
    group.add_argument("--transfer-checksum", dest="transfer_checksum", action="store_true",
                       help="verify every room end to end with a hash before SUCCESS (either side may ask; "
                            "host memory: xxh3 with kvbridge[checksum], else crc32; GPU memory: wmix64 with torch)")
    group.add_argument("--transfer-staging", dest="transfer_staging", choices=("gather", "auto", "on", "off"),
                       default=_SESSION.staging,
                       help="stage fragmented host-memory writes: gather small pieces into a registered buffer and "
                            "write few large descriptors; auto/on also scatter them on decode (both sides, opt-in: "
                            "docs/performance.md) (default: gather, on prefill where the destination merges them)")
    group.add_argument("--transfer-secret-file", dest="transfer_secret_file", default=None, metavar="PATH",
                       help="file holding the secret that authenticates control messages (default: "
                            "$KVBRIDGE_SECRET_FILE, else $KVBRIDGE_SECRET; without one, loopback only)")
    group.add_argument(_FLAGS["instance_name"], dest=_ARG_DESTS["instance_name"], type=_instance_name_type,
                       default=_SESSION.instance_name, metavar="NAME",
                       help="decode: this instance's name, the same across its restarts and used by no other live "
                            "instance (e.g. its server's HOST:PORT); prefill then fails a restarted decode's old "
                            "rooms as soon as the new process handshakes, not when its lease lapses. Two live "
                            "instances of one name fail each other's rooms (default: none, unnamed)")
    return group
