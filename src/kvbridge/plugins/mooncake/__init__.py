"""Mooncake TransferEngine transport (TCP on CPU hosts, RDMA where NICs exist).

This module is what the ``kvbridge`` entry point loads: it registers the
backend by name and must stay cheap, so it never imports Mooncake. The engine
is imported by :mod:`kvbridge.plugins.mooncake.backend` only when the
``mooncake`` backend is selected.

:data:`CAPABILITIES` lives here (not in ``backend``) so that the registration
and :attr:`MooncakeBackend.capabilities <kvbridge.plugins.mooncake.backend.MooncakeBackend.capabilities>`
are the same object without importing the engine.
"""

from __future__ import annotations

from kvbridge.core import BackendCapabilities, BackendSpec, OptionSpec, hookimpl

__all__ = ["CAPABILITIES", "DEFAULT_MAX_IN_FLIGHT", "OPTIONS", "kvbridge_register_backends"]

#: Mooncake's per-peer TCP queue (``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER``)
#: defaults to 1024 descriptors. Exceeding the queue plus its admission list can
#: wedge the peer for good (shared/ENGINES.md section 2), so one synchronous
#: batch never carries more than this.
DEFAULT_MAX_IN_FLIGHT = 1024

CAPABILITIES = BackendCapabilities(
    # The non-CUDA wheel moves host memory only; GPU memory needs the CUDA wheel
    # and has not been tested here.
    memory_kinds=("dram",),
    max_descriptors_per_batch=DEFAULT_MAX_IN_FLIGHT,
    max_descriptors_in_flight=DEFAULT_MAX_IN_FLIGHT,
    # The engine can notify the receiver, but this adapter leaves completion to
    # core's control plane.
    native_notifications=False,
    one_sided=True,
)

#: Every ``config.options`` key :class:`~kvbridge.plugins.mooncake.backend.MooncakeBackend` reads.
OPTIONS = (
    # Only the protocols this adapter documents; other Mooncake transports
    # (efa, nvlink, ...) depend on the engine build and have not been tried.
    OptionSpec(name="protocol", default="tcp", choices=("tcp", "rdma"),
               help="TransferEngine protocol: tcp, or rdma where RDMA NICs exist"),
    OptionSpec(name="device_name", default="",
               help="RDMA device list such as mlx5_0 (protocol=rdma); empty lets the engine choose"),
)


@hookimpl
def kvbridge_register_backends() -> list[BackendSpec]:
    """Register the ``mooncake`` backend (imported lazily through ``factory``)."""
    return [
        BackendSpec(
            name="mooncake",
            factory="kvbridge.plugins.mooncake.backend:MooncakeBackend",
            capabilities=CAPABILITIES,
            requires=("mooncake",),
            extra="mooncake",
            options=OPTIONS,
            description="Mooncake TransferEngine, P2P handshake; TCP (default) or RDMA one-sided writes",
        )
    ]
