"""UCX transport on UCXX: one-sided RMA puts (``ucp_put_nbx``) into registered decode memory.

Registration only: :mod:`.backend` imports UCXX when ``ucx`` is selected,
and shares :data:`CAPABILITIES` with this registration.
"""

from __future__ import annotations

from kvbridge.core import BackendCapabilities, BackendSpec, OptionSpec, hookimpl

__all__ = ["CAPABILITIES", "OPTIONS", "kvbridge_register_backends"]

OPTIONS = (
    OptionSpec(name="error_handling", choices=("on", "off"), default="on",
               help="on: a dead peer fails the write; off: a put to a dead peer aborts this process"),
    OptionSpec(name="UCX_*", help="any UCX setting for this backend's context (UCX_TLS=tcp, ...), over the environment"),
)

# Host memory only: the cu12 wheels carry UCX's CUDA transports, untested here. Puts
# queue inside UCP until the writer progresses its worker; at most 4096 per write keeps
# that queue bounded (and the deadline checked between batches).
CAPABILITIES = BackendCapabilities(memory_kinds=("dram",), max_descriptors_per_batch=4096)


@hookimpl
def kvbridge_register_backends() -> list[BackendSpec]:
    return [BackendSpec(name="ucx", factory="kvbridge.plugins.ucx.backend:UcxBackend",
                        capabilities=CAPABILITIES, options=OPTIONS, requires=("ucxx",), extra="ucx",
                        description="UCX via UCXX; one-sided RMA puts (CMA on one host, else TCP), peer failure detection")]
