"""The copy kernel: one Triton launch per slice of a plan, into a peer's mapped GPU memory.

:func:`copy` packs each slice's descriptor table (rows + columns, never one
row per descriptor) into pinned host memory, copies it to the GPU and
launches :func:`_compile`'s kernel, which forms descriptors, translates
destinations through the peer's mapped allocations and copies
:data:`~kvbridge.plugins.cuda_ipc.split.TILE_BYTES` per program. It returns
once its stream has synchronised: completion means every byte landed.
torch and Triton are imported on the first copy.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from .ipc import GpuPeer, check_rc, driver, on_device
from .split import Part, Shape, launches, shape, sizes_mode

__all__ = ["copy", "warm"]


# -- the kernel ---------------------------------------------------------------------------------------
_kernel: Any = None
NUM_WARPS = 2  # per program of TILE_BYTES
#: Launch a kernel already compiled for the same constants through its compiled launcher, skipping
#: Triton's per-call argument binding and cache lookup (tens of microseconds of Python per launch).
DIRECT_LAUNCH = True
_compiled: dict[tuple[Any, ...], Any] = {}  # constants + which integer arguments need 64 bits -> kernel
#: Guards _compiled and _pending. One compile per kernel: a copy that needs a kernel the warm-up is compiling
#: waits for that one (never for the warm-up's others); kernels of different keys compile side by side.
_compiling = threading.Lock()
_pending: dict[tuple[Any, ...], threading.Event] = {}


def _single_flight(key: tuple[Any, ...], build: Callable[[], None]) -> None:
    """Run ``build`` (which fills ``_compiled[key]``) unless it ran or another thread is running it (then wait)."""
    with _compiling:
        if key in _compiled:
            return
        event = _pending.get(key)
        mine = event is None
        if mine:
            event = _pending[key] = threading.Event()
    assert event is not None
    if not mine:
        event.wait(120)
        return
    try:
        build()
    finally:
        with _compiling:
            del _pending[key]
        event.set()
_dtypes: dict[int, Any] = {}  # element bytes -> Triton type (filled by _compile)
_INTS = ("rows_tab", "nrows", "cols_tab", "ncols", "size", "starts", "deltas", "allocs", "pieces")


def _compile() -> Any:
    import triton  # type: ignore[import-not-found, unused-ignore]
    import triton.language as tl  # type: ignore[import-not-found, unused-ignore]

    _dtypes.update({8: tl.int64, 4: tl.int32, 2: tl.int16, 1: tl.int8})
    # Every argument is an integer (tables are passed by address) that Triton must not specialise on
    # (divisibility by 16, equality to 1): one compiled kernel per set of constants, whatever the values.
    @triton.jit(do_not_specialize=list(_INTS))
    def copy_pieces(rows_tab, nrows, cols_tab, ncols, size, starts, deltas, allocs, pieces,
                    ROWS: tl.constexpr, CHUNK: tl.constexpr, WIDTH: tl.constexpr, DTYPE: tl.constexpr,
                    STEPS: tl.constexpr, ALIGN16: tl.constexpr, EVEN: tl.constexpr, SIZES: tl.constexpr):
        # rows_tab: nrows sources, nrows destinations (peer addresses)[, nrows sizes if SIZES == 1];
        # cols_tab: ncols source offsets, destination offsets[, sizes if SIZES == 2]; SIZES == 0: every
        # descriptor moves ``size`` bytes. Descriptor d is (d // ncols, d % ncols); piece p
        # is elements [(p % pieces) * CHUNK, +CHUNK) of descriptor p // pieces; one program copies ROWS
        # pieces. ``pieces`` is an argument, not a constant: plans whose longest run differs share one
        # compiled kernel (each new constant would compile one, a fraction of a second, mid-request). Destinations are translated into this process through the peer's mapped allocations
        # (sorted starts, deltas) by a branchless binary search of STEPS steps.
        rows_t = rows_tab.to(tl.int64).to(tl.pointer_type(tl.int64))
        cols_t = cols_tab.to(tl.int64).to(tl.pointer_type(tl.int64))
        starts_t = starts.to(tl.int64).to(tl.pointer_type(tl.int64))
        deltas_t = deltas.to(tl.int64).to(tl.pointer_type(tl.int64))
        p = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        live = p < nrows.to(tl.int64) * ncols * pieces
        d = p // pieces
        first = (p % pieces) * CHUNK
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
    """One copy's launch resources on one device: its stream (and its handle); a side stream (handle) and
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


class _Staging:
    """Per device, the :class:`_Buffers` copies launch with, each used by one copy at a time: :meth:`get` takes
    one (made, or grown, as needed), :meth:`give` returns it once its streams are synchronised. Kept across
    threads: a peer's worker thread ends when idle and the next one finds them made, and the warm-up makes
    the first before any copy (on an H200 host a first copy making its own took 2.1 ms, later ones 0.4)."""

    def __init__(self) -> None:
        self.free: dict[int, list[_Buffers]] = {}
        self._lock = threading.Lock()

    def get(self, device: int, words: int) -> _Buffers:
        """Buffers of ``device`` of at least ``words`` words, for this copy alone, the device's context current
        in this thread."""
        # torch.cuda.set_device on the current device: 0.56 us on an H200 host, as the driver's
        # cuCtxGetCurrent (0.59 us) that would tell whether it is needed.
        on_device(device)
        with self._lock:
            free = self.free.get(device)
            got = free.pop() if free else None
        if got is not None and len(got.words) >= words:
            return got
        import torch

        if got is None:
            stream, side = torch.cuda.Stream(device), torch.cuda.Stream(device)
            event = ctypes.c_void_p()
            check_rc(driver().cuEventCreate(ctypes.byref(event), 2), "cuEventCreate")  # 2: CU_EVENT_DISABLE_TIMING
        else:
            stream, side, event = got.stream, got.side, ctypes.c_void_p(got.event)
        words = max(words, 1 << 16)
        host = torch.empty(words, dtype=torch.int64, pin_memory=True)
        dev = torch.empty(words, dtype=torch.int64, device=f"cuda:{device}")
        return _Buffers(stream, stream.cuda_stream, side, side.cuda_stream, event.value or 0,
                        host, host.numpy(), host.data_ptr(), dev, dev.data_ptr(), device)

    def give(self, buf: _Buffers) -> None:
        """Return buffers :meth:`get` gave, their streams synchronised."""
        with self._lock:
            self.free.setdefault(buf.device, []).append(buf)


_staging = _Staging()


def copy(device: int, parts: Sequence[Part], peer: GpuPeer, check: Callable[[], None] | None = None,
         hints: Sequence[tuple[int, int]] | None = None, units: Sequence[int] | None = None) -> None:
    """Copy every descriptor of ``parts`` into ``peer``'s mapped memory on ``device``; return once landed.

    Destinations are the peer's own addresses; the kernel translates them.
    The descriptors must lie in local GPU memory of ``device`` and in the
    peer's mapped allocations (core checked both). Each part goes in
    :func:`slices`, one launch each on its buffers' stream, and one synchronisation at the end. ``check`` runs
    between slices (the caller checks before the first) and may raise to stop there (a failed room's
    fence); the slices already launched are still waited for, so nothing is
    left running when this returns or raises. ``hints``: per part, what
    :meth:`~kvbridge.core.planning.plan.TransferPlan.hints` says of its columns; ``units``: per part, the
    bytes its columns count in (``TransferPlan.units``; None: bytes), scaled as the table is packed.

    Before the first launch: one table copy and one launch. A later slice's table is copied on a side
    stream while the slices before it run, and its launch waits for that copy alone.
    """
    work = launches(parts, hints, units)
    if not work:
        return
    _load()
    # each table starts on a 16-byte boundary (an even word)
    buf = _staging.get(device, sum(3 * (len(p[0]) + len(p[2])) + 1 for p, _, _ in work))
    table = peer.on_device(device)
    at = 0
    try:
        for i, (piece, hint, unit) in enumerate(work):
            if i and check is not None:
                check()
            at = _launch(piece, shape(piece, hint, unit), at, buf, table, i > 0, unit)
    finally:
        buf.stream.synchronize()  # whatever was launched has landed before this returns or raises
        if len(work) > 1:
            buf.side.synchronize()  # a table copy whose launch never came (it raised) ends too
        _staging.give(buf)


def _launch(part: Part, sh: Shape, at: int, buf: _Buffers, table: tuple[int, int, int, int], later: bool,
            unit: int = 1) -> int:
    """Launch one slice on ``buf``'s stream, its table staged from word ``at`` (``later``: through the side
    stream, the launch waiting for that copy); the next free (even) word."""
    sizes, r, end = _pack(part, sh, buf.words, at, unit)
    lib = driver()
    on = buf.side_handle if later else buf.handle  # later: the copy engine moves it while the kernels before run
    check_rc(lib.cuMemcpyHtoDAsync_v2(buf.dev_addr + 8 * at, buf.host_addr + 8 * at, 8 * (end - at), on),
           "cuMemcpyHtoDAsync of a descriptor table")
    if later:
        check_rc(lib.cuEventRecord(ctypes.c_void_p(buf.event), ctypes.c_void_p(on)), "cuEventRecord")
        check_rc(lib.cuStreamWaitEvent(ctypes.c_void_p(buf.handle), ctypes.c_void_p(buf.event), 0), "cuStreamWaitEvent")
    _run(sh, sizes, len(part[0]), len(part[2]), buf.dev_addr + 8 * r, buf.dev_addr + 8 * at, *table, buf.handle, buf.device)
    return end + (end & 1)


def _pack(part: Part, sh: Shape, h: Any, at: int, unit: int = 1) -> tuple[int, int, int]:
    """Write ``part``'s table into ``h`` from word ``at`` (one numpy call; columns in units of ``unit``
    bytes are multiplied into place, one call each): columns (sources, destinations[, sizes]), then rows
    (sources, destinations[, sizes]), in bytes. Returns where sizes are kept (0: ``sh.uniform`` for all,
    1: per row, 2: per column), the first row word and the end."""
    src_rows, dst_rows, src_cols, dst_cols, nbytes = part
    sizes = sizes_mode(part, sh)
    cols = (src_cols, dst_cols, nbytes) if sizes == 2 else (src_cols, dst_cols)
    rows = (src_rows, dst_rows, nbytes) if sizes == 1 else (src_rows, dst_rows)
    n = len(src_cols)
    r = at + len(cols) * n
    end = r + len(rows) * len(src_rows)
    if unit == 1:
        np.concatenate(cols + rows, out=h[at:end])
    else:
        np.multiply(src_cols, unit, out=h[at:at + n])
        np.multiply(dst_cols, unit, out=h[at + n:at + 2 * n])
        np.concatenate(cols[2:] + rows, out=h[at + 2 * n:end])
    return sizes, r, end


_I32 = (1 << 31) - 1


def _run(sh: Shape, sizes: int, m: int, ncols: int, rows: int, cols: int, starts: int, deltas: int, steps: int,
         allocs: int, stream: int, device: int) -> None:
    """Launch the kernel over ``m`` rows x ``ncols`` columns whose tables are on the GPU at ``rows``/``cols``,
    on ``stream`` (a handle of ``device``)."""
    grid = -(-m * ncols * sh.pieces // sh.rows)
    size = sh.uniform
    ints = (rows, m, cols, ncols, size, starts, deltas, allocs, sh.pieces)
    key = _key(sh, sizes, steps, device, ints)
    if DIRECT_LAUNCH and key not in _compiled and key in _pending:
        _single_flight(key, lambda: None)  # the warm-up is compiling this one: wait for it
    direct = _compiled.get(key) if DIRECT_LAUNCH else None
    if direct is not None:
        kernel, constants = direct
        kernel.run(grid, 1, 1, stream, kernel.function, kernel.packed_metadata, None, None, None, *ints, *constants)
        return
    import torch

    with torch.cuda.stream(torch.cuda.ExternalStream(stream)):  # Triton launches on torch's current stream
        kernel = _kernel[(grid,)](*ints, **_constexprs(sh, sizes, steps))
    with _compiling:
        _keep(key, kernel, sh, sizes, steps)


def _key(sh: Shape, sizes: int, steps: int, device: int, ints: Sequence[int]) -> tuple[Any, ...]:
    """What one compiled kernel serves: its constants, and which integer arguments need 64 bits (Triton types
    an integer argument i32 or i64 by its value; all are >= 0 here). A compiled kernel is loaded into one
    device's context."""
    return (device, sh.rows, sh.chunk, sh.width, steps, sh.align16, sh.even, sizes, NUM_WARPS, *(i > _I32 for i in ints))


def _constexprs(sh: Shape, sizes: int, steps: int) -> dict[str, Any]:
    return {"ROWS": sh.rows, "CHUNK": sh.chunk, "WIDTH": sh.width, "DTYPE": _dtypes[sh.width], "STEPS": steps,
            "ALIGN16": sh.align16, "EVEN": sh.even, "SIZES": sizes, "num_warps": NUM_WARPS}


def _keep(key: tuple[Any, ...], kernel: Any, sh: Shape, sizes: int, steps: int) -> None:
    """Keep a compiled kernel for direct launches. Its launcher takes every argument (Triton >= 3.2: constants
    too, which it skips) or only the non-constant ones (older): its signature says which. Anything else: keep
    launching through Triton."""
    constants = tuple(v for k, v in _constexprs(sh, sizes, steps).items() if k != "num_warps")
    count = len(getattr(getattr(kernel, "src", None), "signature", ()))
    if count in (len(_INTS), len(_INTS) + len(constants)) and hasattr(kernel, "packed_metadata") and hasattr(kernel, "function"):
        _compiled[key] = (kernel, constants if count > len(_INTS) else ())


def warm(device: int, shapes: Sequence[tuple[Shape, int]], steps: int) -> int:
    """Compile (without launching) the kernels that copies of ``shapes`` (each with its sizes mode) through a
    peer table of ``steps`` search steps will use, and load them on ``device``: done at the handshake, so
    that a request does not pay for compiling. Returns how many were compiled. Integer arguments take the
    widths a copy gives them: addresses 64 bits, counts and sizes 32. Also makes the buffers of a first copy."""
    _load()
    _staging.give(_staging.get(device, 1 << 16))  # a first copy's buffers made here, not in the copy
    done = 0
    for sh, sizes in shapes:
        ints = (1 << 40, 1, 1 << 40, 1, sh.uniform, 1 << 40, 1 << 40, 1 << steps, sh.pieces)
        key = _key(sh, sizes, steps, device, ints)

        def build(sh: Shape = sh, sizes: int = sizes, ints: tuple[int, ...] = ints, key: tuple[Any, ...] = key) -> None:
            kernel = _kernel.warmup(*ints, grid=(1,), **_constexprs(sh, sizes, steps))
            kernel.run  # noqa: B018 (Triton loads the module into this device's context on first access)
            with _compiling:
                _keep(key, kernel, sh, sizes, steps)

        before = len(_compiled)
        _single_flight(key, build)
        done += len(_compiled) - before
    return done


def _load() -> None:
    """Import Triton and define the kernel, once."""
    global _kernel
    with _compiling:
        if _kernel is None:
            _kernel = _compile()
