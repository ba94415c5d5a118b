"""Plugin discovery: entry points, load errors, duplicates; builds the :class:`~.registry.Registry`.

Every plugin, built-in or third-party, is an entry point in the ``kvbridge``
group. Built-ins are the entry points of the ``kvbridge`` distribution itself;
``KVBRIDGE_DISABLE_PLUGIN_AUTOLOAD=1`` loads those only. A plugin that fails to
import, or whose hook raises or returns something other than records, is
reported by name and the others still load.

``KVBRIDGE_TRACE_HOOKS=1`` logs every hook call (its arguments, and the
results of those that return) through pluggy's tracing to the
``kvbridge.hooks`` logger at DEBUG; if logging is not configured, that logger
gets its own stderr handler so the trace shows.
"""

from __future__ import annotations

import importlib.metadata as md
import logging
import os
import warnings
from collections.abc import Iterable
from typing import Any

import pluggy

from . import hookspecs
from .records import BackendSpec, StateHandlerSpec
# The registry's types are defined in .registry; plugins.py builds one. They are also importable from
# here: kvbridge.core.plugins, this module's old path, is where code written before the split finds them.
from .registry import (  # noqa: F401
    BACKEND_PREFERENCE,
    SAME_HOST_LANES,
    BackendUnavailableError,
    Kind,
    LoadError,
    PluginError,
    Provider,
    Registered,
    Registry,
    UnknownBackendError,
    duplicate_message,
    import_object,
)

__all__ = ["ENTRY_POINT_GROUP", "DISABLE_AUTOLOAD_ENV", "TRACE_HOOKS_ENV", "build_registry", "get_registry"]

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "kvbridge"
DISABLE_AUTOLOAD_ENV = "KVBRIDGE_DISABLE_PLUGIN_AUTOLOAD"
TRACE_HOOKS_ENV = "KVBRIDGE_TRACE_HOOKS"
hook_log = logging.getLogger("kvbridge.hooks")
BUILTIN_DISTRIBUTION = "kvbridge"

def _entry_points() -> list[md.EntryPoint]:
    return sorted(md.entry_points(group=ENTRY_POINT_GROUP), key=lambda ep: (ep.dist.name if ep.dist else "", ep.name))


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no")


def _autoload_disabled() -> bool:
    return _env_flag(DISABLE_AUTOLOAD_ENV)


def _trace_hooks(pm: pluggy.PluginManager) -> None:
    """Send pluggy's trace (registrations, hook calls and results) to ``kvbridge.hooks``."""
    if not hook_log.hasHandlers():  # nobody configured logging: still show the trace
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
        hook_log.addHandler(handler)
    if hook_log.level == logging.NOTSET:
        hook_log.setLevel(logging.DEBUG)

    def write(text: str) -> None:
        for line in text.rstrip("\n").splitlines():
            hook_log.debug("%s", line)

    pm.trace.root.setwriter(write)
    pm.enable_tracing()


def _check_hook_names(pm: pluggy.PluginManager, plugin_id: str) -> None:
    """Unregister ``plugin_id`` and raise if it implements a hook kvbridge does not define (a misspelling)."""
    try:
        pm.check_pending()
    except pluggy.PluginValidationError:
        plugin = pm.get_plugin(plugin_id)
        defined = {name: getattr(pm.hook, name).spec is not None for name in dir(pm.hook) if name.startswith("kvbridge_")}
        known = sorted(name for name, spec in defined.items() if spec)
        unknown = sorted(name for name in dir(plugin) if name.startswith("kvbridge_") and name not in known)
        pm.unregister(name=plugin_id)
        raise PluginError(
            f"implements {', '.join(map(repr, unknown)) or 'a hook'} that kvbridge does not define "
            f"(known hooks: {', '.join(known)}); check the spelling"
        ) from None


def build_registry(entry_points: Iterable[md.EntryPoint] | None = None, *, autoload: bool | None = None) -> Registry:
    """Load plugins from entry points and collect their registrations."""
    if autoload is None:
        autoload = not _autoload_disabled()
    eps = _entry_points() if entry_points is None else list(entry_points)
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    if _env_flag(TRACE_HOOKS_ENV):
        _trace_hooks(pm)
    registry = Registry()
    providers: dict[str, Provider] = {}
    for ep in eps:
        dist = ep.dist.name if ep.dist else "<unknown distribution>"
        version = ep.dist.version if ep.dist else "?"
        if not autoload and dist != BUILTIN_DISTRIBUTION:
            log.debug("autoload disabled: skipping plugin %r from %s", ep.name, dist)
            continue
        try:
            obj = ep.load()
            plugin_id = f"{dist}:{ep.name}"
            pm.register(obj, name=plugin_id)
            _check_hook_names(pm, plugin_id)
        except Exception as exc:  # a broken plugin must not take the others down
            log.warning("kvbridge plugin %r from %s failed to load: %s", ep.name, dist, exc)
            registry.errors.append(LoadError(ep.name, dist, f"{type(exc).__name__}: {exc}"))
            continue
        providers[plugin_id] = Provider(ep.name, dist, version, ep.value)

    collected: dict[tuple[Kind, str], list[Registered]] = {}
    hooks: tuple[tuple[Kind, Any, type], ...] = (
        ("backend", pm.hook.kvbridge_register_backends, BackendSpec),
        ("state_handler", pm.hook.kvbridge_register_state_handlers, StateHandlerSpec),
    )
    plugins = pm.get_plugins()
    plugin_trace = pm.trace.root.get("plugin")  # writes only while tracing is on
    for kind, hook, record_type in hooks:
        for impl in hook.get_hookimpls():
            provider = providers[impl.plugin_name]
            # One plugin at a time, so a failing plugin is reported alone; through
            # a hook caller (not impl.function) so that tracing sees every call.
            call = pm.subset_hook_caller(hook.name, [p for p in plugins if p is not impl.plugin])
            plugin_trace(hook.name, "in", impl.plugin_name)
            try:
                with warnings.catch_warnings(record=True) as caught:  # a deprecated form loads; say so by plugin
                    warnings.simplefilter("always", DeprecationWarning)
                    records: list[Any] = [rec for result in call() for rec in (result or ())]
                for w in caught:
                    if issubclass(w.category, DeprecationWarning):
                        registry.deprecations.append(LoadError(provider.plugin, provider.distribution, str(w.message)))
                    warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
                for rec in records:
                    if not isinstance(rec, record_type):
                        raise TypeError(f"{hook.name} returned {type(rec).__name__}, expected {record_type.__name__}")
            except Exception as exc:
                log.warning("kvbridge plugin %s: %s failed: %s", provider, hook.name, exc)
                registry.errors.append(
                    LoadError(provider.plugin, provider.distribution, f"{hook.name}: {type(exc).__name__}: {exc}")
                )
                continue
            for rec in records:
                collected.setdefault((kind, rec.name), []).append(Registered(kind, rec, provider))

    for (kind, name), regs in collected.items():
        if len(regs) > 1:
            provs = [r.provider for r in regs]
            registry.duplicates[(kind, name)] = provs
            registry.errors.append(LoadError(name, ", ".join(p.distribution for p in provs), duplicate_message(kind, name, provs)))
            continue
        target = registry.backends if kind == "backend" else registry.state_handlers
        target[name] = regs[0]
    return registry


_cached: Registry | None = None


def get_registry(*, reload: bool = False) -> Registry:
    """The process-wide registry, built on first use."""
    global _cached
    if _cached is None or reload:
        _cached = build_registry()
    return _cached
