"""NIXL transport (UCX backend): one-sided WRITEs from prefill into decode memory.

This module is what the ``kvbridge`` entry point loads: it registers the
backend by name and must stay cheap, so it never imports NIXL. The engine
(``nixl_cu12``) is imported by :mod:`kvbridge.plugins.nixl.backend` only when
the ``nixl`` backend is selected.

:data:`CAPABILITIES` lives here (not in ``backend``) so that the registration
and :attr:`NixlBackend.capabilities <kvbridge.plugins.nixl.backend.NixlBackend.capabilities>`
are the same object without importing the engine.
"""

from __future__ import annotations

from kvbridge.core import BackendCapabilities, BackendSpec, OptionSpec, hookimpl

__all__ = ["CAPABILITIES", "OPTIONS", "kvbridge_register_backends"]

CAPABILITIES = BackendCapabilities(
    # NIXL moves GPU memory too (VRAM_SEG), but only host memory has been
    # tested here (CPU-only machine), so only that is declared.
    memory_kinds=("dram",),
    # No descriptor limit was hit up to 262144 descriptors in one request
    # (shared/ENGINES.md section 3), and a write posts one request per peer.
    max_descriptors_per_batch=None,
    max_descriptors_in_flight=None,
    # NIXL can attach a notification to a WRITE, but this adapter leaves
    # completion to core's control plane.
    native_notifications=False,
    one_sided=True,
)

#: Every ``config.options`` key :class:`~kvbridge.plugins.nixl.backend.NixlBackend`
#: reads (its module docstring explains them and the measurements behind the defaults).
OPTIONS = (
    OptionSpec(name="progress_delay_us", type="int", minimum=0, default="1000",
               help="microseconds NIXL's progress thread waits per poll; 0 spins"),
    OptionSpec(name="ucx_error_handling_mode", choices=("peer", "none"), default="peer",
               help="peer reports a dead peer as an error; none allows shared memory but hides peer failures"),
    OptionSpec(name="num_workers", type="int", minimum=1, default="1", help="UCX workers of the NIXL UCX backend"),
    OptionSpec(name="ucx_engine_config", default="",
               help="extra UCX settings for NIXL as KEY=VAL,KEY=VAL (e.g. TLS=tcp)"),
    OptionSpec(name="xfer_mode", choices=("descs", "prepped"), default="descs",
               help="descs builds descriptor lists per write; prepped indexes page tables prepared at handshake"),
    OptionSpec(name="max_post_bytes", type="int", minimum=0, default=str(64 << 20),
               help="largest bytes per posted request (longer descriptors are split); 0 posts each write whole"),
)


@hookimpl
def kvbridge_register_backends() -> list[BackendSpec]:
    """Register the ``nixl`` backend (imported lazily through ``factory``)."""
    return [
        BackendSpec(
            name="nixl",
            factory="kvbridge.plugins.nixl.backend:NixlBackend",
            capabilities=CAPABILITIES,
            requires=("nixl_cu12",),
            extra="nixl",
            options=OPTIONS,
            description="NVIDIA NIXL agent, UCX backend; one-sided WRITEs (CMA/TCP on hosts, RDMA/NVLink where present)",
        )
    ]
