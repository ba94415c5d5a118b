"""Mooncake TransferEngine transport (TCP on CPU hosts, RDMA where NICs exist).

Registration only: :mod:`.backend` imports Mooncake when ``mooncake`` is
selected, and shares :data:`CAPABILITIES` with this registration.
"""

from __future__ import annotations

from kvbridge.core import BackendCapabilities, BackendSpec, OptionSpec, hookimpl

__all__ = ["CAPABILITIES", "OPTIONS", "kvbridge_register_backends"]

#: Only the protocols tried here; other Mooncake transports (efa, nvlink, ...) depend on the engine build.
OPTIONS = (
    OptionSpec(name="protocol", default="tcp", choices=("tcp", "rdma"),
               help="TransferEngine protocol: tcp, or rdma where RDMA NICs exist"),
    OptionSpec(name="device_name", help="RDMA device list such as mlx5_0 (protocol=rdma); empty lets the engine choose"),
)

# Each peer queues MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER descriptors (default 1024); more in
# flight can wedge the peer for good (docs/engines.md, Mooncake), so core keeps at most one
# queue's worth posted to a peer (max_descriptors_in_flight, over every batch in flight: several
# async batches count together, 2 x 1024 worked and 3 x 1024 failed). Within it, up to 4 batches
# are posted at once (batch_transfer_async_write): staged windows and large runs are a few
# descriptors each. The non-CUDA wheel moves host memory only.
CAPABILITIES = BackendCapabilities(memory_kinds=("dram",), max_descriptors_per_batch=1024,
                                   max_descriptors_in_flight=1024, batches_in_flight=4)


@hookimpl
def kvbridge_register_backends() -> list[BackendSpec]:
    return [BackendSpec(name="mooncake", factory="kvbridge.plugins.mooncake.backend:MooncakeBackend",
                        capabilities=CAPABILITIES, options=OPTIONS, requires=("mooncake",), extra="mooncake",
                        description="Mooncake TransferEngine, P2P handshake; TCP (default) or RDMA one-sided writes")]
