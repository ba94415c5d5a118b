"""The plugin registry once built: what is registered, who provides it, what failed to load, and
the choices made from it (the default backend, the default lanes, a ``--transfer-backend`` value).

Building it (entry points, hooks, load errors, duplicates) is :mod:`.plugins`.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

from .records import BackendSpec, StateHandlerSpec
from .state import StateResolver

__all__ = [
    "BACKEND_PREFERENCE",
    "SAME_HOST_LANES",
    "PluginError",
    "BackendUnavailableError",
    "UnknownBackendError",
    "Provider",
    "Registered",
    "LoadError",
    "Registry",
    "import_object",
    "duplicate_message",
]

#: The default backend is the first available one of these, then any other
#: available backend that moves bytes between hosts, by name. NIXL first: the
#: engine inference servers most often ship already, with RDMA and NVLink
#: paths; then UCX (one-sided puts with peer-failure detection); then Mooncake.
BACKEND_PREFERENCE: tuple[str, ...] = ("nixl", "ucx", "mooncake")
#: Lanes put before the default backend where available: same-host copies that take over what they
#: can reach (GPU -> GPU on one host) and leave the rest to it.
SAME_HOST_LANES: tuple[str, ...] = ("cuda_ipc",)


class PluginError(RuntimeError):
    """A plugin could not be loaded, or two plugins claim one name."""


class UnknownBackendError(PluginError, LookupError):
    """No installed plugin provides the requested backend."""


class BackendUnavailableError(PluginError, ImportError):
    """The backend is registered but its engine package is not installed."""


@dataclass(frozen=True)
class Provider:
    """Where a registration came from."""

    plugin: str  # entry-point name
    distribution: str
    version: str
    module: str

    def __str__(self) -> str:
        return f"{self.distribution} {self.version} (entry point {self.plugin!r}, {self.module})"


Kind = Literal["backend", "state_handler"]


@dataclass(frozen=True)
class Registered:
    kind: Kind
    spec: BackendSpec | StateHandlerSpec
    provider: Provider

    @property
    def name(self) -> str:
        return self.spec.name


@dataclass(frozen=True)
class LoadError:
    """A plugin, or a name, that could not be used, and why."""

    plugin: str
    distribution: str
    error: str

    def __str__(self) -> str:
        return f"plugin {self.plugin!r} from {self.distribution}: {self.error}"


@dataclass
class Registry:
    """What the installed plugins provide. Build it with :func:`get_registry`."""

    backends: dict[str, Registered] = field(default_factory=dict)
    state_handlers: dict[str, Registered] = field(default_factory=dict)
    errors: list[LoadError] = field(default_factory=list)
    #: Plugins that loaded through a deprecated form of the contract, and what to write instead.
    deprecations: list[LoadError] = field(default_factory=list)
    #: name -> every provider, for names claimed more than once (unusable until fixed).
    duplicates: dict[tuple[Kind, str], list[Provider]] = field(default_factory=dict)
    _handlers: dict[str, Any] = field(default_factory=dict, repr=False)
    _lanes: dict[str, tuple[BackendSpec, ...]] = field(default_factory=dict, repr=False)

    # -- backends -----------------------------------------------------------
    def backend_spec(self, name: str) -> BackendSpec:
        """The registration of backend ``name``; a clear error if it is unknown."""
        dup = self.duplicates.get(("backend", name))
        if dup:
            raise PluginError(duplicate_message("backend", name, dup))
        reg = self.backends.get(name)
        if reg is None:
            installed = ", ".join(sorted(self.backends)) or "none"
            raise UnknownBackendError(
                f"unknown transfer backend {name!r}; installed backends: {installed}. "
                "If it comes from a separate package, that plugin may not be installed"
                + (f" (plugin load errors: {'; '.join(map(str, self.errors))})" if self.errors else "")
            )
        assert isinstance(reg.spec, BackendSpec)
        return reg.spec

    def backend_available(self, name: str) -> bool:
        return all(_module_installed(m) for m in self.backend_spec(name).requires)

    def load_backend(self, name: str) -> Any:
        """Import and return backend ``name``'s factory (the engine is imported only now)."""
        spec = self.backend_spec(name)
        missing = [m for m in spec.requires if not _module_installed(m)]
        if missing:
            how = f"`pip install kvbridge[{spec.extra}]`" if spec.extra else f"the module(s) {', '.join(missing)}"
            raise BackendUnavailableError(
                f"backend {name!r} needs {how} (missing: {', '.join(missing)})"
            )
        return import_object(spec.factory, f"backend {name!r}")

    def available_backends(self) -> list[str]:
        """Usable backends (registered once, engine installed), best first (see :data:`BACKEND_PREFERENCE`)."""
        names = [n for n in self.backends if ("backend", n) not in self.duplicates and self.backend_available(n)]
        rank = {name: i for i, name in enumerate(BACKEND_PREFERENCE)}
        return sorted(names, key=lambda n: (rank.get(n, len(rank)), n))

    def default_backend(self) -> str | None:
        """The one default: the best available backend that moves bytes between hosts, or None."""
        for name in self.available_backends():
            if self.backend_spec(name).capabilities.cross_host:
                return name
        return None

    def same_host_lanes(self) -> list[str]:
        """The available lanes of :data:`SAME_HOST_LANES`: put before a backend they take over from."""
        return [n for n in SAME_HOST_LANES if n in self.backends and self.backend_available(n)]

    def default_lanes(self, same_host: bool = True) -> list[str]:
        """The lanes a manager gets when it names none: :meth:`same_host_lanes` (when ``same_host``),
        then :meth:`default_backend`. Raises :class:`PluginError` when no backend reaching other
        hosts is available."""
        engine = self.default_backend()
        if engine is None:
            installed = ", ".join(sorted(self.backends)) or "none"
            raise PluginError(
                f"no transfer backend is available (installed: {installed}); install an engine, "
                "e.g. `pip install kvbridge[nixl]`, or a backend plugin"
            )
        return [*(self.same_host_lanes() if same_host else []), engine]

    def lanes(self, text: str) -> list[BackendSpec]:
        """The registrations of ``text``'s backends (one name, or names separated by commas), each
        checked to be installed and usable: :class:`BackendUnavailableError` names the pip extra.
        Resolved once per text and kept: ``--transfer-backend``, ``TransferConfig`` and every manager
        built from it share the answer."""
        specs = self._lanes.get(text)
        if specs is None:
            specs = tuple(self.backend_spec(n) for n in self.lane_names(text))
            for spec in specs:
                if not self.backend_available(spec.name):
                    self.load_backend(spec.name)  # raises, naming what to install
            self._lanes[text] = specs
        return list(specs)

    def lane_names(self, text: str) -> list[str]:
        """``"cuda_ipc,nixl"`` as registered backend names, in order; an unknown, repeated or empty
        name raises naming it (and what is installed)."""
        names = [n.strip() for n in text.split(",")]
        if not all(names):
            raise PluginError(f"backend list {text!r} has an empty name; separate names with single commas")
        if len(set(names)) != len(names):
            raise PluginError(f"backend list {text!r} names a backend more than once")
        for n in names:
            self.backend_spec(n)
        return names

    # -- state handlers -----------------------------------------------------
    def load_state_handler(self, name: str) -> Any:
        """The handler object of state handler ``name`` (imported on first use, then cached)."""
        dup = self.duplicates.get(("state_handler", name))
        if dup:
            raise PluginError(duplicate_message("state_handler", name, dup))
        if name not in self._handlers:
            reg = self.state_handlers.get(name)
            if reg is None:
                raise PluginError(f"unknown state handler {name!r}; installed: {', '.join(sorted(self.state_handlers)) or 'none'}")
            factory = import_object(reg.spec.factory, f"state handler {name!r}")
            self._handlers[name] = factory() if callable(factory) else factory
        return self._handlers[name]

    def state_resolver(self) -> StateResolver[StateHandlerSpec]:
        specs = [r.spec for r in self.state_handlers.values()]
        return StateResolver.from_specs(s for s in specs if isinstance(s, StateHandlerSpec))

    # -- listing ------------------------------------------------------------
    def rows(self) -> list[dict[str, Any]]:
        """One JSON-ready object per registration (``kvbridge plugins --json``)."""
        out: list[dict[str, Any]] = []
        for reg in [*self.backends.values(), *self.state_handlers.values()]:
            spec = reg.spec
            row: dict[str, Any] = {
                "name": spec.name,
                "kind": reg.kind,
                "distribution": reg.provider.distribution,
                "version": reg.provider.version,
                "plugin": reg.provider.plugin,
                "module": reg.provider.module,
                "description": spec.description,
            }
            if isinstance(spec, BackendSpec):
                row["capabilities"] = msgspec.to_builtins(spec.capabilities)
                row["available"] = all(_module_installed(m) for m in spec.requires)
                row["requires"] = list(spec.requires)
                row["extra"] = spec.extra
                row["options"] = [
                    {
                        "name": o.name,
                        "default": o.default,
                        "allowed": o.allowed(),
                        "choices": list(o.choices) if o.choices is not None else None,
                        "help": o.help,
                    }
                    for o in spec.options
                ]
            else:
                row["capabilities"] = msgspec.to_builtins(spec.capabilities)
                row["pool_types"] = [
                    t if isinstance(t, str) else f"{t.__module__}:{t.__qualname__}" for t in spec.pool_types
                ]
            out.append(row)
        return sorted(out, key=lambda r: (r["kind"], r["name"]))


def _module_installed(modules: str) -> bool:
    """Whether ``modules`` (a module name, or alternatives ``"a|b"``) can be imported."""
    for module in modules.split("|"):
        try:
            if importlib.util.find_spec(module) is not None:
                return True
        except (ImportError, ValueError):
            continue
    return False


def import_object(target: str, what: str) -> Any:
    module_name, _, attr = target.partition(":")
    module = importlib.import_module(module_name)
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise PluginError(f"{what}: {module_name!r} has no attribute {attr!r}") from None
    return obj


def duplicate_message(kind: str, name: str, providers: list[Provider]) -> str:
    """The error for a name two plugins register: every provider, and what to do."""
    listed = "; ".join(str(p) for p in providers)
    return f"{kind.replace('_', ' ')} name {name!r} is registered by more than one plugin: {listed}. Uninstall or disable all but one."
