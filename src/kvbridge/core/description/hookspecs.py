"""The hooks a kvbridge plugin can implement (pluggy project ``"kvbridge"``).

Read top to bottom as the lifecycle. A plugin is a module (or object) named
by an entry point in the ``kvbridge`` group; it implements hooks with
:data:`hookimpl`::

    from kvbridge import hookimpl, BackendSpec

    @hookimpl
    def kvbridge_register_backends():
        return [BackendSpec(name="mine", factory="my_pkg.backend:MyBackend")]
"""

from __future__ import annotations

import pluggy

from .records import BackendSpec, StateHandlerSpec

PROJECT = "kvbridge"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def kvbridge_register_backends() -> list[BackendSpec]:
    """Return the transports this plugin provides.

    Fires once, when the plugin registry is built (first use, or
    ``kvbridge plugins``). Collecting: every plugin's records are gathered;
    a name provided twice is an error naming both providers. Must not import
    the engine; name it in ``BackendSpec.factory`` instead.
    """
    raise NotImplementedError


@hookspec
def kvbridge_register_state_handlers() -> list[StateHandlerSpec]:
    """Return the state handlers this plugin provides.

    Fires once, when the plugin registry is built. Collecting, like
    :func:`kvbridge_register_backends`. A pool object is resolved to a
    handler by the most specific registered class in its class hierarchy.
    """
    raise NotImplementedError
