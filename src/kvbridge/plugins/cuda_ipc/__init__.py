"""The same-host GPU copy: CUDA IPC plus one Triton kernel per write, a lane like any other.

Registration only: :mod:`.backend` (and through it CUDA, torch and Triton) is
imported when ``cuda_ipc`` is selected. It moves GPU memory into GPU memory of
a peer on the same host (``cross_host=False``), so it goes first in a list of
lanes (``--transfer-backend cuda_ipc,nixl``; by default wherever it is
installed) and the backend after it moves the rest.
"""

from __future__ import annotations

from kvbridge.core import BackendCapabilities, BackendSpec, hookimpl

__all__ = ["CAPABILITIES", "kvbridge_register_backends"]

#: One write is the whole plan (a kernel reads it unexpanded, a launch per slice of about 1 GiB);
#: the fence is checked between slices (``kvbridge.core.transfer.backend.checkpoint``). Core's host staging
#: gathers host memory only, and this lane moves none.
CAPABILITIES = BackendCapabilities(memory_kinds=("vram",), cross_host=False, host_staging=False, whole_plans=True)


@hookimpl
def kvbridge_register_backends() -> list[BackendSpec]:
    return [BackendSpec(name="cuda_ipc", factory="kvbridge.plugins.cuda_ipc.backend:CudaIpcBackend",
                        capabilities=CAPABILITIES, requires=("torch", "triton"),
                        description="GPU -> GPU on one host: CUDA IPC handles and a Triton copy kernel per write")]
