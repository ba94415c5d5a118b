"""NIXL transport (UCX backend): one-sided WRITEs from prefill into decode memory.

Registration only: :mod:`.backend` imports NIXL (``nixl_cu12`` or ``nixl_cu13``,
the one matching torch's CUDA) when ``nixl`` is selected, and shares
:data:`CAPABILITIES` with this registration.
"""

from __future__ import annotations

from kvbridge.core import BackendCapabilities, BackendSpec, OptionSpec, hookimpl

__all__ = ["CAPABILITIES", "OPTIONS", "kvbridge_register_backends"]

#: The backend module's docstring explains these and the measurements behind the defaults.
OPTIONS = (
    OptionSpec(name="progress_delay_us", type="int", minimum=0, default="1000",
               help="microseconds NIXL's progress thread waits per poll; 0 spins"),
    OptionSpec(name="ucx_error_handling_mode", choices=("peer", "none"), default="peer",
               help="peer reports a dead peer as an error; none allows shared memory but hides peer failures"),
    OptionSpec(name="num_workers", type="int", minimum=1, default="1", help="UCX workers of the NIXL UCX backend"),
    OptionSpec(name="ucx_engine_config", help="extra UCX settings for NIXL as KEY=VAL,KEY=VAL (e.g. TLS=tcp)"),
    OptionSpec(name="xfer_mode", choices=("descs", "prepped"), default="descs",
               help="descs builds descriptor lists per write; prepped indexes page tables prepared at handshake"),
)

# Host and GPU memory (VRAM regions register as NIXL "VRAM" with their device id; a write
# mixing kinds posts one request per kind pair). No descriptor limit was hit up
# to 262144 descriptors in one request (docs/engines.md, NIXL). A request's CMA copy runs
# inside the post, so core cuts writes into 64 MiB requests and checks the deadline
# between them (measured in .backend). Requests are posted 2 at once (``post``): the next one is
# prepared and posted while the last one's completion is still polled, and staged windows
# overlap (docs/performance.md). 2, not 4: core then makes batches of 32 MiB, not 16, within the
# same fence bound, and each request costs the host about 50 us (NIXL's request and post); on an
# H200, VRAM -> VRAM, 1 GiB contiguous went from 311-435 to 581-666 GB/s (docs/performance.md).
CAPABILITIES = BackendCapabilities(memory_kinds=("dram", "vram"), max_bytes_per_batch=64 << 20, batches_in_flight=2,
                                   inline_writes=True)


@hookimpl
def kvbridge_register_backends() -> list[BackendSpec]:
    return [BackendSpec(name="nixl", factory="kvbridge.plugins.nixl.backend:NixlBackend",
                        capabilities=CAPABILITIES, options=OPTIONS, requires=("nixl_cu12|nixl_cu13",), extra="nixl",
                        description="NVIDIA NIXL, UCX backend; one-sided WRITEs (CMA/TCP on hosts, RDMA/NVLink elsewhere)")]
