"""UCX transport on UCXX: one-sided RMA puts (``ucp_put_nbx``) into registered decode memory.

This module is what the ``kvbridge`` entry point loads: it registers the
backend by name and must stay cheap, so it never imports UCXX. The engine is
imported by :mod:`kvbridge.plugins.ucx.backend` only when the ``ucx`` backend
is selected.

:data:`CAPABILITIES` lives here (not in ``backend``) so that the registration
and :attr:`UcxBackend.capabilities <kvbridge.plugins.ucx.backend.UcxBackend.capabilities>`
are the same object without importing the engine.
"""

from __future__ import annotations

from kvbridge.core import BackendCapabilities, BackendSpec, OptionSpec, hookimpl

__all__ = ["CAPABILITIES", "OPTIONS", "kvbridge_register_backends"]

CAPABILITIES = BackendCapabilities(
    # Host memory only: the cu12 wheels carry UCX's CUDA transports, but VRAM
    # registration has not been tested here.
    memory_kinds=("dram",),
    # UCP queues puts per endpoint without a limit kvbridge must respect.
    max_descriptors_per_batch=None,
    max_descriptors_in_flight=None,
    # Completion reaches decode through core's control plane.
    native_notifications=False,
    one_sided=True,
)

#: Every ``config.options`` key :class:`~kvbridge.plugins.ucx.backend.UcxBackend` reads.
OPTIONS = (
    OptionSpec(name="error_handling", choices=("on", "off"), default="on",
               help="on: a dead peer fails the write; off: a put to a dead peer aborts this process"),
    OptionSpec(name="UCX_*", default="",
               help="any UCX setting for this backend's UCX context (UCX_TLS=tcp, ...), overriding the environment"),
)


@hookimpl
def kvbridge_register_backends() -> list[BackendSpec]:
    """Register the ``ucx`` backend (imported lazily through ``factory``)."""
    return [
        BackendSpec(
            name="ucx",
            factory="kvbridge.plugins.ucx.backend:UcxBackend",
            capabilities=CAPABILITIES,
            requires=("ucxx",),
            extra="ucx",
            options=OPTIONS,
            description="UCX through UCXX; one-sided RMA puts (CMA on one host, TCP otherwise) with peer failure detection",
        )
    ]
