"""kvbridge-zmq: registers the ``zmq`` backend with kvbridge.

kvbridge finds this module through the ``kvbridge`` entry point in
``pyproject.toml`` and calls its hook when it builds its plugin registry.
It must stay cheap to import: the backend class is named by a string and
imported only when a manager selects ``zmq``.
"""

from __future__ import annotations

from kvbridge import BackendCapabilities, BackendSpec, hookimpl

__all__ = ["CAPABILITIES", "kvbridge_register_backends"]

#: Declared here, not in ``backend``, so the registration and ``ZmqBackend.capabilities``
#: are one object and listing plugins imports nothing more.
CAPABILITIES = BackendCapabilities(
    memory_kinds=("dram",),  # bytes are copied with memmove: host memory only
    max_bytes_per_batch=4 << 20,  # one zmq message per write; kvbridge cuts and splits plans to it
    native_notifications=False,  # completion reaches decode through kvbridge's control plane
    one_sided=False,  # the decode process places the bytes: its receiver thread must run
)


@hookimpl
def kvbridge_register_backends() -> list[BackendSpec]:
    """Register ``zmq``; ``requires`` names the modules that must be importable to use it."""
    return [
        BackendSpec(
            name="zmq",
            factory="kvbridge_zmq.backend:ZmqBackend",
            capabilities=CAPABILITIES,
            requires=("zmq", "numpy"),
            description="portable: bytes over pyzmq, bounds-checked and placed by the receiver",
        )
    ]
