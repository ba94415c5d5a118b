"""ctypes bindings for the UCP one-sided (RMA) calls that UCXX's Python API lacks.

UCXX exposes only tag, stream and active messages to Python, but its
context, worker and endpoint objects carry the raw UCP handles (``.handle``:
``ucp_context_h``, ``ucp_worker_h``, ``ucp_ep_h``). This module binds the few
UCP calls needed to use those handles for RMA, against the *same* ``libucp``
that UCXX loaded (never a second copy: handles are only valid inside the
library instance that made them).

Thread safety: UCXX creates its workers with ``UCS_THREAD_MODE_MULTI``
(checked by :func:`worker_thread_mode`), so these calls may run on kvbridge's
transfer threads while UCXX's progress thread progresses the same worker.

Struct layouts follow ``ucp/api/ucp.h`` of UCX 1.21 (the libucx-cu12 wheel);
every struct starts with a field mask, so only the fields named there are read.

**Why RMA through ctypes, not UCXX's tag or AM messages.** UCXX's Python API
offers tag, stream and active messages only (docs/engines.md, UCXX).
Two-sided messages would need decode to post one receive per page into its
destination slice, which core's contract does not provide (``write`` is
one-sided and decode takes no part until ``Done``). UCXX's context, worker and
endpoint objects do expose their raw UCP handles, and UCXX creates workers in
``UCS_THREAD_MODE_MULTI``, so this module binds the handful of UCP RMA calls
with ctypes against the very ``libucp`` UCXX loaded: decode ``ucp_mem_map``\\ s
and ``ucp_rkey_pack``\\ s each region and ships the keys in its metadata;
prefill ``ucp_ep_rkey_unpack``\\ s them, ``ucp_put_nbx``\\ es every descriptor
and waits for ``ucp_ep_flush_nbx``, which completes once the puts are done at
the destination. The core contract stays as it is.

Measured here (2 cores shared with the receiver and another test run, two
processes on 127.0.0.1, 256 MiB scattered so nothing coalesces, UCX 1.21 from
libucx-cu12; GB/s, median of 5 with min-max):

=====================================  ================  ================  ================
path                                   4096 x 64 KiB     256 x 1 MiB       dead peer
=====================================  ================  ================  ================
RMA put, error handling on (default)   5.4 (5.2-5.8)     9.9 (9.8-10.3)    error in < 1 ms
same without CMA: TCP put emulation    0.3 (0.3-0.9)     0.3 (0.3-0.4)     error in < 1 ms
RMA put, error handling off            5.7 (5.1-6.1)     11.0 (8.8-11.8)   **process abort**
tag send/recv, error handling on       0.5 (0.4-0.7)     0.6 (0.5-1.2)     error
tag send/recv, error handling off      1.7 (1.5-1.9)     7.4 (6.8-8.5)     silent loss
=====================================  ================  ================  ================

Through kvbridge (``python -m kvbridge.bench.transfer --backend ucx``, 256 MiB):
5.3 GB/s for 64 KiB pages, 8.7 for 1 MiB runs, 8.6 for one block; the raw UCP
loop of :mod:`kvbridge.bench.raw_ucx` did 5.7, 9.0 and 7.7 in the same run.
Small descriptors cost about 4 us each (20,000 x 16 B in 80 ms): 1 us to post
through ctypes, 3 us inside UCP's progress (one ``process_vm_writev`` each).
"""

from __future__ import annotations

import ctypes
import os
from ctypes import POINTER, byref, c_char_p, c_int, c_size_t, c_uint, c_uint32, c_uint64, c_void_p
from typing import Any

__all__ = [
    "UCXX_SETTINGS", "UcpError", "lib", "ucxx", "status_string", "ptr_status", "check", "worker_thread_mode",
    "mem_map", "rkey_pack", "rkey_unpack", "MemMapParams", "RequestParam",
]

UCS_OK = 0
UCS_INPROGRESS = 1
UCS_ERR_LAST = -100
ERR_PTR_MIN = (1 << 64) + UCS_ERR_LAST  # UCS_PTR_IS_ERR: (uintptr_t)ptr >= (uintptr_t)UCS_ERR_LAST

UCS_THREAD_MODE_MULTI = 2
UCS_MEMORY_TYPE_HOST = 0

UCP_MEM_MAP_PARAM_FIELD_ADDRESS = 1 << 0
UCP_MEM_MAP_PARAM_FIELD_LENGTH = 1 << 1
UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE = 1 << 4

UCP_WORKER_ATTR_FIELD_THREAD_MODE = 1 << 0


class UcpError(RuntimeError):
    """A UCP call returned an error status."""

    def __init__(self, call: str, status: int) -> None:
        super().__init__(f"{call} failed: {status_string(status)} (status {status})")
        self.status = status


class MemMapParams(ctypes.Structure):
    _fields_ = [
        ("field_mask", c_uint64),
        ("address", c_void_p),
        ("length", c_size_t),
        ("flags", c_uint),
        ("prot", c_uint),
        ("memory_type", c_int),
        ("exported_memh_buffer", c_void_p),
    ]


class RequestParam(ctypes.Structure):
    _fields_ = [
        ("op_attr_mask", c_uint32),
        ("flags", c_uint32),
        ("request", c_void_p),
        ("cb", c_void_p),  # union of callback pointers
        ("datatype", c_uint64),
        ("user_data", c_void_p),
        ("reply_buffer", c_void_p),
        ("memory_type", c_int),
        ("recv_info", c_void_p),  # union of pointers
        ("memh", c_void_p),
    ]


class _WorkerAttr(ctypes.Structure):
    _fields_ = [
        ("field_mask", c_uint64),
        ("thread_mode", c_int),
        ("address_flags", c_uint32),
        ("address", c_void_p),
        ("address_length", c_size_t),
        ("max_am_header", c_size_t),
        ("name", ctypes.c_char * 32),
        ("max_debug_string", c_size_t),
    ]


def _loaded_path(stem: str) -> str | None:
    """Path of the ``lib<stem>.so`` already mapped into this process (Linux)."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(None, 1)[-1]
                if os.path.basename(path).startswith(f"lib{stem}.so"):
                    return path
    except OSError:
        return None
    return None


def _open(stem: str) -> ctypes.CDLL:
    # ucxx loads libucp/libucs from the libucx wheel with RTLD_LOCAL; reopening the
    # same path with RTLD_NOLOAD returns that very instance and never loads another.
    path = _loaded_path(stem)
    if path is None:
        raise ImportError(
            f"lib{stem}.so is not loaded in this process; import ucxx._lib.libucxx before kvbridge.plugins.ucx._ucp"
        )
    return ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LOCAL)


def _import_ucxx() -> tuple[Any, dict[str, str]]:
    """Import UCXX, leaving the process environment as it was; the module and the UCX settings its import made.

    UCXX's import writes settings meant for its own contexts into ``os.environ`` (ucxx 0.52:
    ``UCX_MEMTYPE_CACHE=n``, ``UCX_RNDV_THRESH=8192``, ``UCX_RNDV_FRAG_MEM_TYPE=cuda``, ``UCX_MAX_RNDV_RAILS=1``).
    Every other UCX in the process reads them as well, and so does every process started from it: NIXL's
    bundled UCX, which sets ``RNDV_THRESH=inf`` only where the environment names none, ran with UCXX's 8192.
    They are taken out again here and handed (as :data:`UCXX_SETTINGS`) to the backend's own UCXX
    context. Where something imported UCXX before kvbridge, what it set stays in the environment.
    """
    before = {key: value for key, value in os.environ.items() if key.startswith("UCX_")}
    import ucxx._lib.libucxx as ucx  # type: ignore[import-untyped]  # (loads libucp from the libucx wheel)

    # Empty where UCXX was imported before: importing it again runs nothing.
    made = {key: value for key, value in os.environ.items() if key.startswith("UCX_") and before.get(key) != value}
    for key in made:
        if key in before:
            os.environ[key] = before[key]
        else:
            del os.environ[key]
    return ucx, {key[len("UCX_"):]: value for key, value in made.items()}


def _bind() -> tuple[ctypes.CDLL, ctypes.CDLL]:
    ucp, ucs = _open("ucp"), _open("ucs")
    sig = {
        "ucp_mem_map": (c_int, [c_void_p, POINTER(MemMapParams), POINTER(c_void_p)]),
        "ucp_mem_unmap": (c_int, [c_void_p, c_void_p]),
        "ucp_rkey_pack": (c_int, [c_void_p, c_void_p, POINTER(c_void_p), POINTER(c_size_t)]),
        "ucp_rkey_buffer_release": (None, [c_void_p]),
        "ucp_ep_rkey_unpack": (c_int, [c_void_p, c_char_p, POINTER(c_void_p)]),
        "ucp_rkey_destroy": (None, [c_void_p]),
        "ucp_put_nbx": (c_void_p, [c_void_p, c_void_p, c_size_t, c_uint64, c_void_p, POINTER(RequestParam)]),
        "ucp_ep_flush_nbx": (c_void_p, [c_void_p, POINTER(RequestParam)]),
        "ucp_request_check_status": (c_int, [c_void_p]),
        "ucp_request_free": (None, [c_void_p]),
        "ucp_worker_progress": (c_uint, [c_void_p]),
        "ucp_worker_query": (c_int, [c_void_p, POINTER(_WorkerAttr)]),
    }
    for name, (restype, argtypes) in sig.items():
        fn = getattr(ucp, name)
        fn.restype, fn.argtypes = restype, argtypes
    ucs.ucs_status_string.restype, ucs.ucs_status_string.argtypes = c_char_p, [c_int]
    return ucp, ucs


#: ``ucxx._lib.libucxx``, and the UCX settings its import made (keys without ``UCX_``): :func:`_import_ucxx`.
ucxx, UCXX_SETTINGS = _import_ucxx()
lib, _ucs = _bind()


def status_string(status: int) -> str:
    raw = _ucs.ucs_status_string(status)
    return raw.decode(errors="replace") if raw else f"unknown status {status}"


def ptr_status(ptr: int | None) -> int:
    """``UCS_PTR_STATUS``: UCS_OK for NULL, the error for an error pointer, UCS_INPROGRESS for a request."""
    if not ptr:
        return UCS_OK
    if ptr >= ERR_PTR_MIN:
        return ptr - (1 << 64)
    return UCS_INPROGRESS


def check(call: str, status: int) -> None:
    if status != UCS_OK:
        raise UcpError(call, status)


def worker_thread_mode(worker: int) -> int:
    attr = _WorkerAttr(field_mask=UCP_WORKER_ATTR_FIELD_THREAD_MODE)
    check("ucp_worker_query", lib.ucp_worker_query(worker, byref(attr)))
    return int(attr.thread_mode)


def mem_map(context: int, addr: int, nbytes: int) -> int:
    """Register ``nbytes`` of host memory at ``addr``; returns the ``ucp_mem_h``."""
    params = MemMapParams(
        field_mask=UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH | UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE,
        address=addr,
        length=nbytes,
        memory_type=UCS_MEMORY_TYPE_HOST,
    )
    memh = c_void_p()
    check("ucp_mem_map", lib.ucp_mem_map(context, byref(params), byref(memh)))
    assert memh.value is not None
    return memh.value


def rkey_pack(context: int, memh: int) -> bytes:
    buf, size = c_void_p(), c_size_t()
    check("ucp_rkey_pack", lib.ucp_rkey_pack(context, memh, byref(buf), byref(size)))
    try:
        return ctypes.string_at(buf.value, size.value)  # type: ignore[arg-type]
    finally:
        lib.ucp_rkey_buffer_release(buf)


def rkey_unpack(ep: int, packed: bytes) -> int:
    rkey = c_void_p()
    check("ucp_ep_rkey_unpack", lib.ucp_ep_rkey_unpack(ep, packed, byref(rkey)))
    assert rkey.value is not None
    return rkey.value
