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

from kvbridge.core import BackendCapabilities, BackendSpec, hookimpl

__all__ = ["CAPABILITIES", "kvbridge_register_backends"]

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
            description="NVIDIA NIXL agent, UCX backend; one-sided WRITEs (CMA/TCP on hosts, RDMA/NVLink where present)",
        )
    ]
