"""The ``sglang.srt.plugins`` entry point: makes SGLang build kvbridge's transfer classes.

SGLang's ``load_plugins()`` (run by ``sglang.launch_server``, the engine and
every scheduler process) calls :func:`register`. When kvbridge is switched on
(``KVBRIDGE_SGLANG_BACKEND`` or ``KVBRIDGE_SGLANG_CONFIG``, see :mod:`.settings`)
it registers, through SGLang's ``HookRegistry``:

- an AROUND hook on ``sglang.srt.disaggregation.utils.get_kv_class``: every
  transfer backend except ``fake`` (SGLang's warm-up and health-check requests)
  yields kvbridge's manager, sender, receiver and bootstrap server. SGLang's
  ``apply_hooks`` rebinds the name in every module that imported it by name
  (``prefill``, ``decode``, ``disagg_service``, ...);
- AROUND hooks on ``PrefillBootstrapQueue._init_kv_manager`` and
  ``DecodePreallocQueue._init_kv_manager`` that hand the queue's pools to the
  manager they build (:func:`~.conn.sglang_pools`); a HiSparse decode's host pool
  with them (:mod:`.hisparse`).

Switched off, it registers nothing and SGLang is untouched. ``SGLANG_PLUGINS``
(a list of plugin names) filters it like any other plugin: its name is ``kvbridge``.
"""

from __future__ import annotations

import logging
from typing import Any

from .settings import BACKEND_ENV, CONFIG_ENV, enabled

__all__ = ["GET_KV_CLASS", "INIT_KV_MANAGER", "kv_class", "register"]

log = logging.getLogger(__name__)

GET_KV_CLASS = "sglang.srt.disaggregation.utils.get_kv_class"
INIT_KV_MANAGER = (
    "sglang.srt.disaggregation.prefill.PrefillBootstrapQueue._init_kv_manager",
    "sglang.srt.disaggregation.decode.DecodePreallocQueue._init_kv_manager",
)
_CLASSES = {"manager": "KVBridgeKVManager", "sender": "KVBridgeKVSender", "receiver": "KVBridgeKVReceiver",
            "bootstrap_server": "KVBridgeKVBootstrapServer"}


def kv_class(original: Any, transfer_backend: Any, class_type: Any) -> Any:
    """``get_kv_class`` with kvbridge's classes for every backend but ``fake`` (AROUND hook)."""
    backend = getattr(transfer_backend, "value", transfer_backend)
    kind = getattr(class_type, "value", class_type)
    if backend == "fake" or kind not in _CLASSES:  # KVARGS: SGLang's own container, shared by every backend
        return original(transfer_backend, class_type)
    from . import conn

    return getattr(conn, _CLASSES[kind])


def _init_kv_manager(original: Any, queue: Any) -> Any:
    """SGLang's ``_init_kv_manager``, with the queue's pools handed to the manager it creates (AROUND hook).

    A HiSparse decode (``scheduler.enable_hisparse`` on the decode queue) registers its
    coordinator's host pool for the KV, as SGLang's own ``_init_kv_manager`` does.
    """
    from .conn import sglang_pools

    target = queue.token_to_kv_pool
    scheduler = getattr(queue, "scheduler", None)
    if getattr(scheduler, "enable_hisparse", False):
        from sglang.srt.disaggregation.decode import DecodePreallocQueue  # loaded: SGLang is calling its method

        from .hisparse import HiSparseDecodePools

        if isinstance(queue, DecodePreallocQueue):  # prefill keeps its device pool
            target = HiSparseDecodePools(host=scheduler.hisparse_coordinator.mem_pool_host, device=target)
    draft = getattr(queue, "draft_token_to_kv_pool", None)
    with sglang_pools(target, draft, queue.metadata_buffers):
        return original(queue)


def register() -> None:
    """Entry point of the ``sglang.srt.plugins`` group (name ``kvbridge``)."""
    if not enabled():
        log.info("kvbridge's SGLang plugin is installed but off: set %s (a kvbridge backend name) or %s to use it",
                 BACKEND_ENV, CONFIG_ENV)
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from .settings import transfer_config

    cfg = transfer_config()  # a bad setting stops SGLang here, naming it, instead of at the first request
    HookRegistry.register(GET_KV_CLASS, kv_class, HookType.AROUND)
    for target in INIT_KV_MANAGER:
        HookRegistry.register(target, _init_kv_manager, HookType.AROUND)
    log.info("kvbridge carries SGLang's PD transfers (kvbridge backend %s)", cfg.backend)
