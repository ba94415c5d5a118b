"""The same-host GPU fast path: CUDA IPC plus a copy kernel driven by the plan.

Between processes of one host, moving scattered pages VRAM -> VRAM through an
engine costs a descriptor each (NIXL/UCX: about 8 GB/s for 64 KiB pages on an
H200 whose device copy runs at 2 TB/s). Here, instead, the decode side sends
CUDA IPC handles of the allocations behind its GPU regions in the handshake;
the prefill side maps them once (``cuIpcOpenMemHandle``) and copies each
write with a Triton kernel that reads the plan unexpanded
(:meth:`~kvbridge.core.plan.TransferPlan.factors`: rows x columns, a
descriptor being formed on the GPU) and translates the peer's addresses by a
binary search over its mapped allocations. Host work per write is
proportional to rows + columns, not descriptors; heterogeneous-TP head slices
and NHD/HND pages are just columns. ``copy`` returns after its stream has
synchronised, so completion still means every byte landed.

Nothing here imports torch, Triton or CUDA until a GPU region is seen, so
core imports cleanly on machines without them. The kernel's work split,
masks and search are mirrored in numpy (:func:`shape`, :func:`kernel_translate`,
:func:`execute_on_host`) and tested on CPU.

The host must have finished writing the source (synchronised its own stream)
before ``Sender.send``, as for every backend: the copy runs on its own stream
and waits on no other (layer-wise sends pass ``ready=`` events instead).
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import msgspec
import numpy as np
import numpy.typing as npt

from .layout import Region

__all__ = [
    "GpuPeer", "Part", "Shape", "arrays_part", "available", "boot_id", "copy", "execute_on_host", "kernel_translate",
    "local_metadata", "open_peer", "shape", "slices",
]

log = logging.getLogger(__name__)

IntArray = npt.NDArray[np.int64]
#: Bytes one kernel program copies. On an H200 the kernel alone (table on the GPU, CUDA events) moved
#: 1 GiB of scattered 16-64 KiB pages at 0.95-0.98 of the device-to-device copy with 4 KiB programs of
#: 2 warps, and within a few per cent of that with 16 KiB programs of 8 warps; small programs also
#: give 4 KiB pages one program each (``benchmarks/gpu_kernel_bench.py --tune``).
TILE_BYTES = 4096


# -- the work split (numpy; tested on CPU) ------------------------------------------------------------
#: One part of a plan as an outer sum (:meth:`kvbridge.core.plan.TransferPlan.factors`): descriptor
#: ``(r, c)`` moves ``nbytes`` bytes from ``src_rows[r] + src_cols[c]`` to ``dst_rows[r] + dst_cols[c]``;
#: ``nbytes`` is per column, or per row where there is one column (a part given as arrays).
Part = tuple[IntArray, IntArray, IntArray, IntArray, IntArray]


def arrays_part(src: IntArray, dst: IntArray, nbytes: IntArray) -> Part:
    """Descriptors given as three arrays, as a part (one column at offset 0, sizes per row)."""
    zero = np.zeros(1, np.int64)
    return src, dst, zero, zero, nbytes


def row_sizes(part: Part) -> bool:
    """Whether ``part``'s sizes are per row (one column) rather than per column."""
    src_rows, _, src_cols, _, nbytes = part
    return len(src_cols) == 1 and len(nbytes) == len(src_rows)


class Shape(NamedTuple):
    """How one launch splits a part's descriptors: element ``width`` in bytes, ``chunk`` elements per
    piece, ``pieces`` per descriptor (of the longest), ``rows`` pieces per program (rows x chunk x width
    = :data:`TILE_BYTES`); ``align16``: every address and size is a multiple of 16 bytes; ``even``: every size is
    a multiple of a piece, so pieces need no per-element mask (loads and stores then vectorise);
    ``uniform``: the one size of every descriptor (its table then has no sizes), or 0."""

    width: int
    chunk: int
    pieces: int
    rows: int
    align16: bool
    even: bool
    uniform: int = 0


def _or(a: IntArray) -> int:
    """The bitwise or of ``a``'s elements (a part's rows are often one: no numpy call then)."""
    return int(a[0]) if len(a) == 1 else int(np.bitwise_or.reduce(a))


def shape(part: Part, hint: tuple[int, int] = (0, 0)) -> Shape:
    """The launch shape of a part: the widest element every address and size is a multiple of.

    A sum of multiples of 2**k is one, so rows and columns are reduced apart: no descriptor is formed.
    ``hint`` (:meth:`~kvbridge.core.plan.TransferPlan.hints`): a power of two dividing every column
    offset and size, and the one column size, where known (0: not), which are then not reduced.
    """
    src_rows, dst_rows, src_cols, dst_cols, nbytes = part
    align, size = hint
    if size:
        size_bits = most = least = size
    else:
        most, least = int(nbytes.max()), int(nbytes.min())
        # Sizes are multiples of ``align``: what follows reads only their lowest set bit, which is then at
        # least ``align``, and of a piece's bytes (at most TILE_BYTES) whether it is at least that: one pass
        # over the sizes fewer (a scattered 1 GiB of 16 KiB pages has 65,535 of them).
        size_bits = align if align >= TILE_BYTES else _or(nbytes)
    # columns are multiples of ``align`` where known: the widest element is then at most as wide
    bits = size_bits | _or(src_rows) | _or(dst_rows) | (align if align else _or(src_cols) | _or(dst_cols))
    width = min(8, bits & -bits) if bits else 8
    longest = max(1, most // width)
    tile = TILE_BYTES // width
    chunk = min(tile, 1 << (longest - 1).bit_length())
    # the largest power of two dividing every size, against a piece's bytes
    even = (size_bits & -size_bits) >= chunk * width
    uniform = most if least == most else 0
    return Shape(width, chunk, -(-longest // chunk), tile // chunk, bits % 16 == 0, even, uniform)


#: A part goes to the GPU in slices of about this many bytes, one launch each; a failed room's fence is
#: checked between slices.
SLICE_BYTES = 1 << 30
#: A part of at least ``PIPELINE_BYTES`` goes first as a slice of ``FIRST_SLICE`` of it, so that the
#: rest's table is packed, staged and launched while that slice copies instead of before it. Measured on
#: an H200 (1 GiB scattered, 20 interleaved reps, medians): 16 KiB pages (65,535 columns with sizes, a
#: 170 us pack) 1.03 -> 0.96 ms; 64 KiB pages (a 26 us pack) unchanged at 0.86-0.88 ms, the second
#: launch's fixed host cost hidden but its table copy and the gap between kernels not; first slices of
#: 0.25 and 0.55 measured the same within noise. Later (copy() in one process, 40 reps interleaved with
#: D2D, the later table copied on a side stream): a first slice of 0.25 instead of 0.4 gave 0.876 vs 0.860
#: of D2D for 64 KiB pages but 0.728 vs 0.759 for 16 KiB ones.
PIPELINE_BYTES = 256 << 20
FIRST_SLICE = 0.4


def slices(part: Part) -> list[Part]:
    """``part`` cut into the launches :func:`copy` makes (each has its own :func:`shape`).

    A part is rows x columns; it is cut along whichever is longer (a plan of one region's scattered
    pages is one row of many columns), each slice again rows x columns: a first slice of
    :data:`FIRST_SLICE` of a part of at least :data:`PIPELINE_BYTES`, then slices of :data:`SLICE_BYTES`.
    """
    src_rows, dst_rows, src_cols, dst_cols, nbytes = part
    per_row = row_sizes(part)
    by_rows = len(src_rows) >= len(src_cols)
    count = len(src_rows) if by_rows else len(src_cols)
    if not count:
        return []
    # bytes per unit cut (a row, or a column), estimated from the first
    unit = int(nbytes[0]) if per_row else int(nbytes.sum()) if by_rows else int(nbytes[0]) * len(src_rows)
    step = max(1, SLICE_BYTES // max(1, unit))
    first = step
    if count > 1 and unit * count >= PIPELINE_BYTES:
        first = min(step, max(1, int(count * FIRST_SLICE)))
    bounds = [0, *range(first, count, step), count]
    cuts = list(zip(bounds, bounds[1:]))
    if by_rows:
        return [(src_rows[lo:hi], dst_rows[lo:hi], src_cols, dst_cols, nbytes[lo:hi] if per_row else nbytes)
                for lo, hi in cuts]
    return [(src_rows, dst_rows, src_cols[lo:hi], dst_cols[lo:hi], nbytes[lo:hi]) for lo, hi in cuts]


def _work(parts: Sequence[Part], hints: Sequence[tuple[int, int]] | None) -> list[tuple[Part, tuple[int, int]]]:
    """Every launch of ``parts`` (none for an empty part): each slice, with its part's hint."""
    return [(piece, hint) for part, hint in zip(parts, hints or [(0, 0)] * len(parts)) if len(part[0]) and len(part[2])
            for piece in slices(part)]


def search_steps(allocations: int) -> int:
    """Steps of the kernel's branchless binary search over ``allocations`` sorted starts (none for one)."""
    return (allocations - 1).bit_length()


def kernel_translate(dst: IntArray, starts: IntArray, deltas: IntArray) -> IntArray:
    """The kernel's address translation (last start <= address, by halving steps) in numpy."""
    pos = np.zeros(dst.shape, np.int64)
    steps = search_steps(len(starts))
    for i in range(steps):
        cand = pos + (1 << (steps - 1 - i))
        ok = cand < len(starts)
        take = ok & (starts[np.minimum(cand, len(starts) - 1)] <= dst)
        pos = np.where(take, cand, pos)
    return dst + deltas[pos]


def execute_on_host(parts: Sequence[Part], peer: GpuPeer, hints: Sequence[tuple[int, int]] | None = None) -> None:
    """The kernel's work split, sizes, masks and translation run with ``ctypes.memmove`` on host memory:
    the CPU reference of :func:`copy`, program by program."""
    for part, hint in _work(parts, hints):
        src_rows, dst_rows, src_cols, dst_cols, nbytes = part
        sh = shape(part, hint)
        cols = len(src_cols)
        piece = np.arange(len(src_rows) * cols * sh.pieces, dtype=np.int64)  # as the programs number them
        d, first = piece // sh.pieces, (piece % sh.pieces) * sh.chunk * sh.width
        r, c = d // cols, d % cols
        n = nbytes[r] if row_sizes(part) else nbytes[c]
        piece_bytes = sh.chunk * sh.width
        if sh.even:  # the kernel's per-piece mask: a piece is copied whole or not at all
            size = np.where(first < n, piece_bytes, 0)
        else:
            size = np.minimum(n - first, piece_bytes)
        src = src_rows[r] + src_cols[c]
        dst = kernel_translate(dst_rows[r] + dst_cols[c], peer.starts, peer.delta)
        for s_, t, o, k in zip(src.tolist(), dst.tolist(), first.tolist(), size.tolist()):
            if k > 0:
                ctypes.memmove(t + o, s_ + o, k)


# -- CUDA driver calls (ctypes: the C ABI is stable) ------------------------------------------------
class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]


_lib: Any = None
_lock = threading.Lock()
_opened: dict[tuple[bytes, int], int] = {}  # (handle, device opened for) -> mapped base (once per device and process)


def available() -> bool:
    """Whether this process can use the fast path (a CUDA driver and torch with a GPU)."""
    try:
        _driver()
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


def _driver() -> Any:
    global _lib
    if _lib is None:
        lib = ctypes.CDLL("libcuda.so.1")
        lib.cuMemGetAddressRange_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t), ctypes.c_uint64]
        lib.cuIpcGetMemHandle.argtypes = [ctypes.POINTER(_IpcHandle), ctypes.c_uint64]
        lib.cuIpcOpenMemHandle_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), _IpcHandle, ctypes.c_uint]
        lib.cuMemcpyHtoDAsync_v2.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        _check(lib.cuInit(0), "cuInit")
        _lib = lib
    return _lib


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{what} failed with CUDA driver error {rc}")


def _on_device(device: int) -> None:
    import torch

    torch.cuda.set_device(device)  # makes the device's primary context current in this thread


def boot_id() -> str:
    """This host's boot id: two processes see the same one only on the same host (and boot)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


class _Alloc(msgspec.Struct, array_like=True):
    device: int
    base: int
    size: int
    handle: bytes


class _Meta(msgspec.Struct, array_like=True, tag="kvbridge-cuda-ipc/1"):
    boot_id: str
    pid: int
    allocs: list[_Alloc]


def local_metadata(regions: Sequence[Region]) -> bytes:
    """IPC handles of the allocations behind this rank's GPU regions (b"" when there are none or no CUDA)."""
    vram = [r for r in regions if r.mem == "vram"]
    if not vram or not available():
        return b""
    lib = _driver()
    allocs: dict[int, _Alloc] = {}
    for r in vram:
        _on_device(r.device)
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        _check(lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), r.addr), f"cuMemGetAddressRange of {r.name!r}")
        if base.value in allocs:
            continue
        handle = _IpcHandle()
        try:
            _check(lib.cuIpcGetMemHandle(ctypes.byref(handle), base.value), f"cuIpcGetMemHandle of {r.name!r}")
        except RuntimeError as exc:  # e.g. memory from cuMemCreate (expandable segments): no legacy IPC
            log.info("GPU fast path off: %s", exc)
            return b""
        # string_at, not handle.reserved: a c_char field stops at the first NUL byte.
        allocs[base.value] = _Alloc(r.device, base.value, size.value, ctypes.string_at(ctypes.addressof(handle), 64))
    return msgspec.msgpack.encode(_Meta(boot_id(), os.getpid(), list(allocs.values())))


class GpuPeer:
    """A peer's GPU allocations mapped into this process (sorted by the peer's address)."""

    def __init__(self, starts: IntArray, ends: IntArray, delta: IntArray) -> None:
        self.starts, self.ends, self.delta = starts, ends, delta
        self._tables: dict[int, tuple[Any, Any, tuple[int, int, int, int]]] = {}

    def inside(self, dst: IntArray, nbytes: IntArray) -> npt.NDArray[np.bool_]:
        """Which descriptors land wholly inside one mapped allocation."""
        pos = np.searchsorted(self.starts, dst, side="right") - 1
        return (pos >= 0) & (dst + nbytes <= self.ends[np.maximum(pos, 0)])

    def covers(self, regions: Sequence[Region]) -> bool:
        """Whether every one of ``regions`` (the peer's) lies inside a mapped allocation."""
        if not regions:
            return True
        addr = np.array([r.addr for r in regions], np.int64)
        return bool(self.inside(addr, np.array([r.nbytes for r in regions], np.int64)).all())

    def on_device(self, device: int) -> tuple[int, int, int, int]:
        """The kernel's translation table on ``device``: the addresses of its starts and its deltas, the
        steps of its search and the number of allocations."""
        got = self._tables.get(device)
        if got is None:
            import torch

            starts = torch.from_numpy(self.starts).to(f"cuda:{device}")
            deltas = torch.from_numpy(self.delta).to(f"cuda:{device}")
            got = self._tables[device] = (starts, deltas, (starts.data_ptr(), deltas.data_ptr(),
                                                           search_steps(len(self.starts)), len(self.starts)))
        return got[2]  # type: ignore[no-any-return]


def open_peer(metadata: bytes, device: int) -> GpuPeer | None:
    """Map a peer's GPU allocations for copies launched on this process's ``device``, or None (another
    host, no CUDA here, or nothing to map).

    Each handle is opened in ``device``'s context, which CUDA then lets reach the allocation's GPU
    (``CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS``): the peer's own device numbers are its process's, not
    this one's. CUDA opens a handle once per device in a process: ranks of one process on two GPUs
    (say prefill TP 2 -> 1) each get their own mapping of decode's memory, reached from their GPU."""
    if not metadata or not available():
        return None
    meta = msgspec.msgpack.decode(metadata, type=_Meta)
    if meta.boot_id != boot_id():
        return None
    lib = _driver()
    starts, ends, delta = [], [], []
    for a in meta.allocs:
        if meta.pid == os.getpid():
            local = a.base  # our own memory: IPC refuses to open it, and needs not
        else:
            with _lock:
                local = _opened.get((a.handle, device), 0)
                if not local:
                    _on_device(device)
                    ptr = ctypes.c_uint64()
                    handle = _IpcHandle.from_buffer_copy(a.handle)
                    # 1 = CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS: also maps another GPU's memory of this host.
                    _check(lib.cuIpcOpenMemHandle_v2(ctypes.byref(ptr), handle, 1), "cuIpcOpenMemHandle")
                    local = _opened[a.handle, device] = ptr.value
        starts.append(a.base)
        ends.append(a.base + a.size)
        delta.append(local - a.base)
    order = np.argsort(np.array(starts, np.int64))
    return GpuPeer(*(np.array(x, np.int64)[order] for x in (starts, ends, delta)))


# -- the kernel ---------------------------------------------------------------------------------------
_kernel: Any = None
NUM_WARPS = 2  # per program of TILE_BYTES
#: Launch a kernel already compiled for the same constants through its compiled launcher, skipping
#: Triton's per-call argument binding and cache lookup (tens of microseconds of Python per launch).
DIRECT_LAUNCH = True
_compiled: dict[tuple[Any, ...], Any] = {}  # constants + which integer arguments need 64 bits -> kernel
_dtypes: dict[int, Any] = {}  # element bytes -> Triton type (filled by _compile)
_INTS = ("rows_tab", "nrows", "cols_tab", "ncols", "size", "starts", "deltas", "allocs")


def _compile() -> Any:
    import triton  # type: ignore[import-not-found, unused-ignore]
    import triton.language as tl  # type: ignore[import-not-found, unused-ignore]

    _dtypes.update({8: tl.int64, 4: tl.int32, 2: tl.int16, 1: tl.int8})
    # Every argument is an integer (tables are passed by address) that Triton must not specialise on
    # (divisibility by 16, equality to 1): one compiled kernel per set of constants, whatever the values.
    @triton.jit(do_not_specialize=list(_INTS))
    def copy_pieces(rows_tab, nrows, cols_tab, ncols, size, starts, deltas, allocs, PIECES: tl.constexpr,
                    ROWS: tl.constexpr, CHUNK: tl.constexpr, WIDTH: tl.constexpr, DTYPE: tl.constexpr,
                    STEPS: tl.constexpr, ALIGN16: tl.constexpr, EVEN: tl.constexpr, SIZES: tl.constexpr):
        # rows_tab: nrows sources, nrows destinations (peer addresses)[, nrows sizes if SIZES == 1];
        # cols_tab: ncols source offsets, destination offsets[, sizes if SIZES == 2]; SIZES == 0: every
        # descriptor moves ``size`` bytes. Descriptor d is (d // ncols, d % ncols); piece p
        # is elements [(p % PIECES) * CHUNK, +CHUNK) of descriptor p // PIECES; one program copies ROWS
        # pieces. Destinations are translated into this process through the peer's mapped allocations
        # (sorted starts, deltas) by a branchless binary search of STEPS steps.
        rows_t = rows_tab.to(tl.int64).to(tl.pointer_type(tl.int64))
        cols_t = cols_tab.to(tl.int64).to(tl.pointer_type(tl.int64))
        starts_t = starts.to(tl.int64).to(tl.pointer_type(tl.int64))
        deltas_t = deltas.to(tl.int64).to(tl.pointer_type(tl.int64))
        p = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        live = p < nrows.to(tl.int64) * ncols * PIECES
        d = p // PIECES
        first = (p % PIECES) * CHUNK
        r = d // ncols
        c = d % ncols
        s = tl.load(rows_t + r, mask=live, other=0) + tl.load(cols_t + c, mask=live, other=0)
        t = tl.load(rows_t + nrows + r, mask=live, other=0) + tl.load(cols_t + ncols + c, mask=live, other=0)
        if SIZES == 1:
            n = tl.load(rows_t + 2 * nrows + r, mask=live, other=0) // WIDTH
        elif SIZES == 2:
            n = tl.load(cols_t + 2 * ncols + c, mask=live, other=0) // WIDTH
        else:
            n = tl.zeros_like(r) + size.to(tl.int64) // WIDTH
        pos = tl.zeros_like(t)
        for i in tl.static_range(STEPS):
            cand = pos + (1 << (STEPS - 1 - i))
            ok = live & (cand < allocs)
            start = tl.load(starts_t + cand, mask=ok, other=0)
            pos = tl.where(ok & (start <= t), cand, pos)
        t += tl.load(deltas_t + pos, mask=live, other=0)
        if ALIGN16:
            s = tl.multiple_of(s, 16)
            t = tl.multiple_of(t, 16)
        sp = s.to(tl.pointer_type(DTYPE))
        tp = t.to(tl.pointer_type(DTYPE))
        idx = first[:, None] + tl.arange(0, CHUNK)[None, :]
        if EVEN:  # whole pieces: a mask constant along each piece, so loads and stores vectorise
            mask = (live & (first < n))[:, None]
        else:
            mask = live[:, None] & (idx < n[:, None])
        tl.store(tp[:, None] + idx, tl.load(sp[:, None] + idx, mask=mask), mask=mask)

    return copy_pieces


class _Buffers(NamedTuple):
    """One thread's launch resources on one device: its stream (and its handle); a side stream (handle) and
    an event (handle) for the tables of later slices; a pinned host buffer for descriptor tables (as numpy,
    and its address) and a device buffer for them (and its address)."""

    stream: Any
    handle: int
    side: Any
    side_handle: int
    event: int
    host: Any
    words: Any  # ``host`` as numpy
    host_addr: int
    dev: Any
    dev_addr: int
    device: int


class _Staging(threading.local):
    """Per thread and device: :class:`_Buffers`, grown as needed."""

    def __init__(self) -> None:
        self.by_device: dict[int, _Buffers] = {}

    def get(self, device: int, words: int) -> _Buffers:
        """``device``'s buffers of at least ``words`` words, its context current in this thread."""
        # torch.cuda.set_device on the current device: 0.56 us on an H200 host, as the driver's
        # cuCtxGetCurrent (0.59 us) that would tell whether it is needed.
        _on_device(device)
        got = self.by_device.get(device)
        if got is not None and len(got.words) >= words:
            return got
        import torch

        if got is None:
            stream, side = torch.cuda.Stream(device), torch.cuda.Stream(device)
            event = ctypes.c_void_p()
            _check(_driver().cuEventCreate(ctypes.byref(event), 2), "cuEventCreate")  # 2: CU_EVENT_DISABLE_TIMING
        else:
            stream, side, event = got.stream, got.side, ctypes.c_void_p(got.event)
        words = max(words, 1 << 16)
        host = torch.empty(words, dtype=torch.int64, pin_memory=True)
        dev = torch.empty(words, dtype=torch.int64, device=f"cuda:{device}")
        got = self.by_device[device] = _Buffers(stream, stream.cuda_stream, side, side.cuda_stream, event.value or 0,
                                                 host, host.numpy(), host.data_ptr(), dev, dev.data_ptr(), device)
        return got


_staging = _Staging()


def copy(device: int, parts: Sequence[Part], peer: GpuPeer, check: Callable[[], None] | None = None,
         hints: Sequence[tuple[int, int]] | None = None) -> None:
    """Copy every descriptor of ``parts`` into ``peer``'s mapped memory on ``device``; return once landed.

    Destinations are the peer's own addresses; the kernel translates them.
    The descriptors must lie in local GPU memory of ``device`` and in the
    peer's mapped allocations (core checked both). Each part goes in
    :func:`slices`, one launch each on this thread's stream, and one synchronisation at the end. ``check`` runs
    between slices (the caller checks before the first) and may raise to stop there (a failed room's
    fence); the slices already launched are still waited for, so nothing is
    left running when this returns or raises. ``hints``: per part, what
    :meth:`~kvbridge.core.plan.TransferPlan.hints` says of its columns.

    Before the first launch: one table copy and one launch. A later slice's table is copied on a side
    stream while the slices before it run, and its launch waits for that copy alone.
    """
    global _kernel
    work = _work(parts, hints)
    if not work:
        return
    if _kernel is None:
        _kernel = _compile()
    # each table starts on a 16-byte boundary (an even word)
    buf = _staging.get(device, sum(3 * (len(p[0]) + len(p[2])) + 1 for p, _ in work))
    table = peer.on_device(device)
    at = 0
    try:
        for i, (piece, hint) in enumerate(work):
            if i and check is not None:
                check()
            at = _launch(piece, shape(piece, hint), at, buf, table, i > 0)
    finally:
        buf.stream.synchronize()  # whatever was launched has landed before this returns or raises
        if len(work) > 1:
            buf.side.synchronize()  # a table copy whose launch never came (it raised) ends too


def _launch(part: Part, sh: Shape, at: int, buf: _Buffers, table: tuple[int, int, int, int], later: bool) -> int:
    """Launch one slice on ``buf``'s stream, its table staged from word ``at`` (``later``: through the side
    stream, the launch waiting for that copy); the next free (even) word."""
    sizes, r, end = _pack(part, sh, buf.words, at)
    lib = _driver()
    on = buf.side_handle if later else buf.handle  # later: the copy engine moves it while the kernels before run
    _check(lib.cuMemcpyHtoDAsync_v2(buf.dev_addr + 8 * at, buf.host_addr + 8 * at, 8 * (end - at), on),
           "cuMemcpyHtoDAsync of a descriptor table")
    if later:
        _check(lib.cuEventRecord(ctypes.c_void_p(buf.event), ctypes.c_void_p(on)), "cuEventRecord")
        _check(lib.cuStreamWaitEvent(ctypes.c_void_p(buf.handle), ctypes.c_void_p(buf.event), 0), "cuStreamWaitEvent")
    _run(sh, sizes, len(part[0]), len(part[2]), buf.dev_addr + 8 * r, buf.dev_addr + 8 * at, *table, buf.handle, buf.device)
    return end + (end & 1)


def _pack(part: Part, sh: Shape, h: Any, at: int) -> tuple[int, int, int]:
    """Write ``part``'s table into ``h`` from word ``at`` (one numpy call): columns (sources,
    destinations[, sizes]), then rows (sources, destinations[, sizes]). Returns where sizes are kept (0:
    ``sh.uniform`` for all, 1: per row, 2: per column), the first row word and the end."""
    src_rows, dst_rows, src_cols, dst_cols, nbytes = part
    sizes = 0 if sh.uniform else 1 if row_sizes(part) else 2
    cols = (src_cols, dst_cols, nbytes) if sizes == 2 else (src_cols, dst_cols)
    rows = (src_rows, dst_rows, nbytes) if sizes == 1 else (src_rows, dst_rows)
    r = at + len(cols) * len(src_cols)
    end = r + len(rows) * len(src_rows)
    np.concatenate(cols + rows, out=h[at:end])
    return sizes, r, end


_I32 = (1 << 31) - 1


def _run(sh: Shape, sizes: int, m: int, ncols: int, rows: int, cols: int, starts: int, deltas: int, steps: int,
         allocs: int, stream: int, device: int) -> None:
    """Launch the kernel over ``m`` rows x ``ncols`` columns whose tables are on the GPU at ``rows``/``cols``,
    on ``stream`` (a handle of ``device``)."""
    grid = -(-m * ncols * sh.pieces // sh.rows)
    size = sh.uniform
    # Triton types an integer argument i32 or i64 by its value (all are >= 0 here): part of what the compiled
    # kernel is. A compiled kernel is loaded into one device's context.
    key = (device, sh.pieces, sh.rows, sh.chunk, sh.width, steps, sh.align16, sh.even, sizes, NUM_WARPS,
           rows > _I32, m > _I32, cols > _I32, ncols > _I32, size > _I32, starts > _I32, deltas > _I32, allocs > _I32)
    direct = _compiled.get(key) if DIRECT_LAUNCH else None
    if direct is not None:
        kernel, constants = direct
        kernel.run(grid, 1, 1, stream, kernel.function, kernel.packed_metadata, None, None, None,
                   rows, m, cols, ncols, size, starts, deltas, allocs, *constants)
        return
    import torch

    dtype = _dtypes[sh.width]
    with torch.cuda.stream(torch.cuda.ExternalStream(stream)):  # Triton launches on torch's current stream
        kernel = _kernel[(grid,)](rows, m, cols, ncols, size, starts, deltas, allocs, PIECES=sh.pieces, ROWS=sh.rows,
                                  CHUNK=sh.chunk, WIDTH=sh.width, DTYPE=dtype, STEPS=steps, ALIGN16=sh.align16,
                                  EVEN=sh.even, SIZES=sizes, num_warps=NUM_WARPS)
    # The compiled launcher takes every argument (Triton >= 3.2: constants too, which it skips) or only
    # the non-constant ones (older): its signature says which. Anything else: keep launching through Triton.
    constants = (sh.pieces, sh.rows, sh.chunk, sh.width, dtype, steps, sh.align16, sh.even, sizes)
    count = len(getattr(getattr(kernel, "src", None), "signature", ()))
    if count in (len(_INTS), len(_INTS) + len(constants)) and hasattr(kernel, "packed_metadata") and hasattr(kernel, "function"):
        _compiled[key] = (kernel, constants if count > len(_INTS) else ())
