"""Registration records that plugins return from the ``kvbridge_register_*`` hooks.

A plugin module stays cheap to import: a record names its implementation as a
``"module:attribute"`` string that is imported only when that backend or
handler is selected, so listing plugins never imports an engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

__all__ = ["BackendCapabilities", "BackendSpec", "StateHandlerSpec"]


class BackendCapabilities(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What a transport can do, declared by the backend (never inferred).

    ``None`` for a limit means the engine has none that kvbridge must respect.
    """

    #: Memory kinds it can read from and write to ("dram", "vram").
    memory_kinds: tuple[str, ...] = ("dram",)
    #: Most descriptors one engine call may carry.
    max_descriptors_per_batch: int | None = None
    #: Most descriptors in flight to one peer at once (e.g. Mooncake's TCP lane queue).
    max_descriptors_in_flight: int | None = None
    #: The engine tells the receiver that a transfer landed.
    native_notifications: bool = False
    #: Prefill writes into decode memory without decode posting receives.
    one_sided: bool = True


@dataclass(frozen=True, kw_only=True)
class BackendSpec:
    """A transport registration.

    ``factory`` is ``"module:attribute"``; ``requires`` lists the engine's
    top-level modules, checked (without importing them) to say whether the
    backend is available and, if not, which pip ``extra`` installs it.
    """

    name: str
    factory: str
    capabilities: BackendCapabilities = BackendCapabilities()
    description: str = ""
    requires: tuple[str, ...] = ()
    extra: str | None = None

    def __post_init__(self) -> None:
        _check_name("backend", self.name)
        _check_factory(self.name, self.factory)
        if not isinstance(self.capabilities, BackendCapabilities):
            raise TypeError(
                f"backend {self.name!r}: capabilities must be a BackendCapabilities, "
                f"got {type(self.capabilities).__name__}"
            )


@dataclass(frozen=True, kw_only=True)
class StateHandlerSpec:
    """A state-handler registration.

    ``pool_types`` are the pool classes it serves, as classes or
    ``"module:QualName"`` strings (strings keep host-server classes unimported).
    A pool whose class derives from one of them is served by this handler
    unless a handler registered for a more specific class exists.
    """

    name: str
    factory: str
    pool_types: tuple[type | str, ...]
    capabilities: dict[str, Any] = field(default_factory=dict)
    description: str = ""

    def __post_init__(self) -> None:
        _check_name("state handler", self.name)
        _check_factory(self.name, self.factory)
        if not self.pool_types:
            raise ValueError(f"state handler {self.name!r} registers no pool_types")
        for t in self.pool_types:
            if not isinstance(t, (type, str)) or (isinstance(t, str) and ":" not in t):
                raise ValueError(
                    f"state handler {self.name!r}: pool type {t!r} must be a class or "
                    "a 'module:QualName' string"
                )


def _check_name(kind: str, name: str) -> None:
    if not isinstance(name, str) or not name or not name.replace("_", "").replace("-", "").isalnum():
        raise ValueError(f"{kind} name {name!r} must be a non-empty word (letters, digits, '_', '-')")


def _check_factory(name: str, factory: str) -> None:
    if not isinstance(factory, str) or factory.count(":") != 1 or factory.startswith(":") or factory.endswith(":"):
        raise ValueError(f"{name!r}: factory {factory!r} must be a 'module:attribute' string")
