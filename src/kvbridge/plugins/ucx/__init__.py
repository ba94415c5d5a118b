"""UCX transport on UCXX: one-sided RMA puts (``ucp_put_nbx``) into registered decode memory.

Registration only: :mod:`.backend` imports UCXX when ``ucx`` is selected,
and shares :data:`CAPABILITIES` with this registration.

**Error handling** (``error_handling``, ``on`` by default):

- ``on``: endpoints use ``UCP_ERR_HANDLING_MODE_PEER``. A dead peer fails the
  write with :class:`TransferError` at once. UCP puts in this mode only over
  transports whose memory domain can invalidate remote access; CMA
  (``process_vm_writev``) does not claim that by default, so this adapter sets
  ``UCX_CMA_MEMORY_INVALIDATE=y`` (unless you set it) and puts go zero-copy
  over CMA between processes of one host. Without it UCP emulates puts with
  8 KiB active messages over TCP at under 1 GB/s. The invalidation is not
  really done by CMA: after a failure, puts that were already posted may still
  land, which core's contract allows.
- ``off``: same speed for puts (CMA either way), but a put to a peer that has
  died makes UCX **abort the whole prefill process** (SIGABRT in
  ``process_vm_writev``: "No such process"); docs/engines.md saw two-sided
  traffic to a dead peer complete without error in this mode. Use it only
  where peers never die on their own.

Other options: any ``UCX_*`` key
(``UCX_TLS=tcp``, ...) configures this backend's UCX context, overriding the
environment. With a loopback ``host`` and no ``UCX_NET_DEVICES`` set, the
context uses ``lo`` only.
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
