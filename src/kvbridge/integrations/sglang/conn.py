"""SGLang's transfer classes (``BaseKVManager``, ``BaseKVSender``, ``BaseKVReceiver``,
``BaseKVBootstrapServer``) over kvbridge's managers, senders and receivers.

SGLang builds them in this order (``disaggregation/prefill.py``, ``decode.py``):

- prefill: ``KVManager(kv_args, PREFILL, server_args, is_mla)`` per rank; per
  request ``KVSender(mgr, bootstrap_addr, room)``; its ``poll()`` until
  ``WaitingForInput``; ``init(num_pages, aux_index)``; ``send(page_indices,
  state_indices=None | [...], num_kv_tokens)`` per chunk (state with the last,
  which is the one that reaches ``num_pages``); ``poll()`` until ``Success``.
- decode: ``KVManager(kv_args, DECODE, ...)``; per request ``KVReceiver(mgr,
  bootstrap_addr, room)``, ``init(prefill_dp_rank)``, ``send_metadata(page_indices,
  aux_index, state_indices)``; ``poll()`` until ``Success``.

The manager describes the rank's pools with kvbridge's handlers (the pools
come from :func:`sglang_pools`, which the plugin wraps around SGLang's own
``_init_kv_manager``) and refuses to start if the description disagrees with
the ``KVArgs`` SGLang filled (:mod:`.crosscheck`). Poll values are kvbridge's
:class:`~kvbridge.core.sessions.session.Poll`, numerically SGLang's ``KVPoll``.

Not supported (a clear error, never a silent fallback): decode prefix reuse
(``decode_prefix_len > 0``), prefill DP ranks other than 0, SGLang's host-receive destinations
(``KVTransferDestination.HOST``; a HiSparse decode's host pool is described by :mod:`.hisparse`),
state types other than SWA, DSA, Mamba and DeepSeek-V4's ``c128_state``, replicated KV heads (TP > KV heads).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvbridge.core import BootstrapServer, DecodeManager, Poll, PrefillManager, Receiver, Sender, describe
from sglang.srt.disaggregation.base.conn import (
    BaseKVBootstrapServer,
    BaseKVManager,
    BaseKVReceiver,
    BaseKVSender,
    KVTransferDestination,
    KVTransferMetric,
)
from sglang.srt.disaggregation.common.conn import KVTransferError

from .crosscheck import compare
from .hisparse import check_draft
from .handlers import C4_PAGE_SPACE, C128_SPACE, C128_STATE, DSA_PAGE_SPACE, SLOT_SPACE, SWA_PAGE_SPACE
from .settings import for_dp_rank, transfer_config

__all__ = ["KVBridgeKVBootstrapServer", "KVBridgeKVManager", "KVBridgeKVReceiver", "KVBridgeKVSender", "sglang_pools"]

log = logging.getLogger(__name__)

#: The kvbridge index space each SGLang state component's index list addresses. The DSA indexer has
#: its own list (as SGLang sends it: with the last chunk) because a HiSparse decode's KV pages are
#: host pages while its indexer stays in the device pool's logical pages.
#: DeepSeek-V4's ``c128_state`` list names the request's pending C128 ring page (empty at a 128-token boundary).
_SPACES = {"swa": SWA_PAGE_SPACE, "dsa": DSA_PAGE_SPACE, "mamba": SLOT_SPACE, C128_STATE: C128_SPACE}


@dataclass(frozen=True)
class _Pools:
    target: Any
    draft: Any
    metadata: Any


_POOLS: contextvars.ContextVar[_Pools | None] = contextvars.ContextVar("kvbridge_sglang_pools", default=None)


@contextlib.contextmanager
def sglang_pools(target: Any, draft: Any, metadata: Any) -> Iterator[None]:
    """The pools a :class:`KVBridgeKVManager` made inside this block describes (SGLang's KVArgs hold only pointers)."""
    token = _POOLS.set(_Pools(target, draft, metadata))
    try:
        yield
    finally:
        _POOLS.reset(token)


class KVBridgeKVManager(BaseKVManager):
    """One per SGLang scheduler rank: a kvbridge :class:`PrefillManager` or :class:`DecodeManager`."""

    def __init__(self, args: Any, disaggregation_mode: Any, server_args: Any, is_mla_backend: bool | None = False,
                 **_unused: Any) -> None:
        pools = _POOLS.get()
        if pools is None:
            raise RuntimeError("KVBridgeKVManager needs SGLang's pool objects: create it inside sglang_pools(...) "
                               "(the kvbridge SGLang plugin does so around SGLang's _init_kv_manager)")
        self.kv_args = args
        self.disaggregation_mode = disaggregation_mode
        self.server_args = server_args
        self.is_mla_backend = bool(is_mla_backend)
        self.config = transfer_config()
        for flag, bad in (("enable_dp_attention", True), ("pp_size", lambda v: int(v or 1) > 1)):
            value = getattr(server_args, flag, None)
            if value is not None and (bad(value) if callable(bad) else value == bad):
                raise ValueError(f"{flag}={value!r}: not supported by kvbridge's SGLang integration yet (attention TP "
                                 "must be the TP size, one pipeline stage); use SGLang's own transfer backend for it")
        # One name per DP rank: every DP rank's scheduler reads the same settings.
        self.config = for_dp_rank(self.config, getattr(args, "system_dp_rank", None),
                                  int(getattr(server_args, "dp_size", 1) or 1))
        self.tp_size = int(getattr(server_args, "tp_size", 1) or 1)
        self.tp_rank = int(args.engine_rank) % self.tp_size
        if not self.is_mla_backend and getattr(args, "total_kv_head_num", None) is not None:
            heads = int(args.kv_head_num) * self.tp_size
            if heads != int(args.total_kv_head_num):
                raise ValueError(f"the model has {args.total_kv_head_num} KV heads and this rank holds {args.kv_head_num} of "
                                 f"TP {self.tp_size}: replicated KV heads are not supported by kvbridge's SGLang integration; "
                                 "use a TP size at most the number of KV heads")
        #: DeepSeek-V4's C4 KV has a page list of its own: a HiSparse decode receives it in host pages.
        self.c4_pages = False
        self.state_spaces: list[str] = []
        for st in args.state_types:
            value = getattr(st, "value", st)
            if value not in _SPACES:
                raise ValueError(f"SGLang state type {value!r} is not supported by kvbridge's SGLang integration "
                                 f"(supported: {', '.join(sorted(_SPACES))}); use SGLang's own transfer backend for this model")
            self.state_spaces.append(_SPACES[value])
        check_draft(pools.target, pools.draft)
        target = [pools.target] + ([pools.metadata] if pools.metadata is not None else [])
        drafts = [pools.draft] if pools.draft is not None else []
        self.description = describe(target, draft_pools=drafts, dtype=str(args.kv_cache_dtype_str),
                                    page_size=int(args.page_size), tp_rank=self.tp_rank, tp_size=self.tp_size)
        self.c4_pages = any(space.name == C4_PAGE_SPACE for space in self.description.index_spaces)
        problems = compare(args, self.description)
        if problems:
            raise ValueError("kvbridge's description of SGLang's pools disagrees with SGLang's KVArgs:\n  "
                             + "\n  ".join(problems))
        mode = getattr(disaggregation_mode, "value", disaggregation_mode)
        session = self.config.session_config()
        if mode == "prefill":
            self.bootstrap = self.config.bootstrap or _bootstrap_address(server_args)
            self.transfer: PrefillManager | DecodeManager = PrefillManager(
                self.description, self.config.backend, bootstrap=self.bootstrap, config=session)
        elif mode == "decode":
            self.transfer = DecodeManager(self.description, self.config.backend, config=session)
        else:
            raise ValueError(f"disaggregation mode must be prefill or decode, got {mode!r}")
        # SGLang's decode queue looks a prefill address up here for its DP size; kvbridge finds the ranks itself.
        self.prefill_info_table = _OneDPRank()
        log.info("kvbridge carries SGLang's %s transfers over %s (TP rank %d of %d, %d regions)", mode,
                 self.transfer.backend_name, self.tp_rank, self.tp_size, len(self.description.regions))

    def register_to_bootstrap(self) -> None:
        """Nothing to do: a kvbridge prefill manager registers its rank when it starts."""

    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        return True  # kvbridge's receivers look the prefill ranks up themselves

    def state_lists(self, state_indices: Sequence[Any] | None) -> dict[str, np.ndarray]:
        """SGLang's per-component state index lists as kvbridge's per-space lists."""
        out: dict[str, np.ndarray] = {}
        for space, idx in zip(self.state_spaces, state_indices or ()):
            if idx is not None:
                out[space] = np.asarray(idx, dtype=np.int64).reshape(-1)
        return out

    def close(self) -> None:
        self.transfer.close()


class _Info:
    dp_size = 1
    follow_bootstrap_room = False


class _OneDPRank(dict):  # type: ignore[type-arg]
    """Every prefill address has one DP rank (DP attention on prefill is not supported)."""

    def get(self, key: Any, default: Any = None) -> Any:
        return _Info()


def _bootstrap_address(server_args: Any) -> str:
    host = getattr(server_args, "host", None) or "127.0.0.1"
    if host in ("0.0.0.0", "::"):
        host = "127.0.0.1"
    return f"{host}:{int(server_args.disaggregation_bootstrap_port)}"


def _error(room: int, reason: str | None) -> KVTransferError:
    return KVTransferError(room, reason or "failed (no reason recorded)")


class KVBridgeKVSender(BaseKVSender):
    """One request on a prefill rank."""

    def __init__(self, mgr: KVBridgeKVManager, bootstrap_addr: str, bootstrap_room: int,
                 req_has_disagg_prefill_dp_rank: bool = False, **_unused: Any) -> None:
        self.kv_mgr = mgr
        self.bootstrap_room = int(bootstrap_room)
        self.sender = Sender(mgr.transfer, self.bootstrap_room)  # type: ignore[arg-type]
        self.num_kv_indices: int | None = None
        self.sent = 0
        self.pages_sent: list[np.ndarray] = []  # for DeepSeek-V4's C4 list, sent with the last chunk
        self.concluded = False  # the send that reached init()'s page count went out
        self.started = time.monotonic()

    def init(self, num_kv_indices: int, aux_index: int | None = None) -> None:
        self.num_kv_indices = int(num_kv_indices)
        self.sender.metadata_row = int(aux_index or 0)

    def send(self, kv_indices: Any, state_indices: Sequence[Any] | None = None, num_kv_tokens: int | None = None,
             **_unused: Any) -> None:
        if self.num_kv_indices is None:
            raise RuntimeError(f"room {self.bootstrap_room}: send() before init(num_kv_indices, aux_index)")
        pages = np.asarray(kv_indices, dtype=np.int64).reshape(-1)
        if self.concluded:
            if pages.size:
                raise RuntimeError(f"room {self.bootstrap_room}: send() of {pages.size} pages after all "
                                   f"{self.num_kv_indices} pages init() announced were sent")
            return  # SGLang's zero-page final send (should_send_kv_chunk) after the last page went out
        self.sent += int(pages.size)
        last = self.sent >= self.num_kv_indices  # SGLang's rule: the send that reaches init()'s page count is the last
        self.concluded = last
        if self.kv_mgr.c4_pages:
            self.pages_sent.append(pages)
        state = None
        if last:
            state = self.kv_mgr.state_lists(state_indices)
            if self.kv_mgr.c4_pages:  # the C4 KV of every page sent, by the same pages (its own space: see _SPACES)
                state[C4_PAGE_SPACE] = np.concatenate(self.pages_sent)
        self.sender.send(pages, state, last=last)

    def should_send_kv_chunk(self, num_pages: int, last_chunk: bool) -> bool:
        """A last chunk without pages still goes out: it carries the state and the metadata row."""
        return num_pages > 0 or last_chunk

    def poll(self) -> int:
        return int(self.sender.poll())

    def failure_exception(self) -> None:
        raise _error(self.bootstrap_room, self.sender.failure())

    def abort(self) -> None:
        self.sender.abort("aborted by SGLang's prefill scheduler")

    def get_transfer_metric(self) -> KVTransferMetric:
        ended = self.sender.ended
        return KVTransferMetric(transfer_latency_s=(ended - self.started) if ended is not None else None)


class KVBridgeKVReceiver(BaseKVReceiver):
    """One request on a decode rank."""

    def __init__(self, mgr: KVBridgeKVManager, bootstrap_addr: str, bootstrap_room: int | None = None,
                 **_unused: Any) -> None:
        self.kv_mgr = mgr
        self.bootstrap_room = int(bootstrap_room or 0)
        self.bootstrap_addr = bootstrap_addr
        self.receiver = Receiver(mgr.transfer, self.bootstrap_room, bootstrap=bootstrap_addr)  # type: ignore[arg-type]
        self.conclude_state: int | None = None
        self.abort_notified = False
        self.bootstrap_infos: list[Any] = []
        self.require_staging = False

    def init(self, prefill_dp_rank: int = 0) -> None:
        if prefill_dp_rank:
            self.receiver.abort(f"prefill DP rank {prefill_dp_rank} asked for; kvbridge's SGLang integration serves "
                                "prefill DP size 1 only")

    def send_metadata(self, kv_indices: Any, aux_index: int | None = None, state_indices: Sequence[Any] | None = None,
                      decode_prefix_len: int | None = None,
                      destination: KVTransferDestination = KVTransferDestination.DEVICE,
                      device_kv_indices: Any = None) -> None:
        """``kv_indices``: the KV destination pages; on a DeepSeek-V4 HiSparse decode the C4 host pages, with the
        other KV entries' (device) pages in ``device_kv_indices``, as SGLang's decode passes them."""
        if decode_prefix_len:
            raise ValueError(f"room {self.bootstrap_room}: decode_prefix_len={decode_prefix_len}: decode prefix reuse is "
                             "not supported by kvbridge's SGLang integration (disable --disaggregation-decode-enable-radix-cache)")
        if destination != KVTransferDestination.DEVICE:
            raise ValueError(f"room {self.bootstrap_room}: destination {destination} is not supported (device only)")
        pages = np.asarray(kv_indices, dtype=np.int64).reshape(-1)
        lists = self.kv_mgr.state_lists(state_indices)
        if device_kv_indices is not None:
            if not self.kv_mgr.c4_pages:
                raise ValueError(f"room {self.bootstrap_room}: device_kv_indices given, but this decode has no host-backed "
                                 "KV (kvbridge's SGLang integration takes them for a DeepSeek-V4 HiSparse decode only)")
            lists[C4_PAGE_SPACE] = pages
            pages = np.asarray(device_kv_indices, dtype=np.int64).reshape(-1)
        elif self.kv_mgr.c4_pages:
            lists[C4_PAGE_SPACE] = pages
        self.receiver.init(pages, lists, metadata_row=int(aux_index or 0))

    def poll(self) -> int:
        state = int(self.receiver.poll())
        if state in (Poll.SUCCESS, Poll.FAILED):
            self.conclude_state = state
        return state

    def failure_exception(self) -> None:
        raise _error(self.bootstrap_room, self.receiver.failure())

    def abort(self) -> None:
        self.abort_notified = True
        self.receiver.abort("aborted by SGLang's decode scheduler")

    def is_abort_release_safe(self) -> bool:
        return self.receiver.poll() == Poll.FAILED and self.receiver.fenced


class KVBridgeKVBootstrapServer(BaseKVBootstrapServer):
    """kvbridge's bootstrap server on SGLang's ``--disaggregation-bootstrap-port``."""

    def __init__(self, host: str, port: int) -> None:
        cfg = transfer_config()
        # Without a secret core refuses a non-loopback address (docs/security.md), with a message saying so.
        self.server = BootstrapServer(host or "127.0.0.1", int(port), secret_file=cfg.secret_file)
        self.address = self.server.address

    def close(self) -> None:
        self.server.close()

