"""A destination engine in its own process, for tests of one backend adapter.

``start_destination(backend, layout)`` spawns a process that creates the named
backend (through the registry, as core does), registers sentinel-filled
buffers described by ``layout`` and serves ``fill`` / ``dump`` / ``quit``
requests over a pipe, so a test in this process can write into it with a
source engine and check every byte. Every wait is bounded.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvbridge.core.description.layout import Region
from kvbridge.core.transfer.transport import open_transport

__all__ = ["Layout", "SENTINEL", "Destination", "region", "start_destination", "standard_layout", "pattern",
           "pattern_buffers", "page_plan", "expected"]

#: (name, item bytes, item count, index space) of every region on one side.
Layout = list[tuple[str, int, int, str]]
SENTINEL = 0xA5  # what destination bytes hold until something writes them
WAIT = 20.0  # bound on every wait for the other process
IDLE_EXIT = 3600.0  # a destination process given no request this long exits (its parent may be gone)


def region(name: str, buf: np.ndarray, item: int, space: str, layer: int) -> Region:
    """A region over ``buf`` with ``item``-byte items (``kv`` for pages, ``metadata`` otherwise)."""
    return Region(name=name, addr=buf.ctypes.data, nbytes=buf.nbytes, stride=item,
                  role="kv" if space == "kv_page" else "metadata", index_space=space, layer=layer)


def _serve(conn: Any, backend: str, layout: Layout, transfer_timeout: float) -> None:
    """Child process: register sentinel-filled buffers, then serve fill/dump/quit requests."""
    engine = open_transport(backend, host="127.0.0.1", name="decode", transfer_timeout=transfer_timeout, options={},
                            fast_path=False)
    bufs = [np.full(item * count, SENTINEL, np.uint8) for _, item, count, _ in layout]
    regions = [region(n, b, item, space, i) for i, (b, (n, item, _, space)) in enumerate(zip(bufs, layout))]
    engine.register(regions)
    conn.send((engine.metadata()[backend], regions))  # the named backend's own metadata
    # Serve until told to quit, or exit on its own once the parent is gone or after IDLE_EXIT without a
    # request. Not after a minute's silence: a test module's tests can be an hour apart on a busy
    # pytest-xdist worker (the tests that run alone go in between), and a later one then found the pipe broken.
    parent, idle_since = mp.parent_process(), time.monotonic()
    while time.monotonic() - idle_since < IDLE_EXIT:
        if not conn.poll(5):
            if parent is not None and not parent.is_alive():
                break
            continue
        idle_since = time.monotonic()
        cmd = conn.recv()
        if cmd == "fill":
            for b in bufs:
                b.fill(SENTINEL)
            conn.send("ok")
        elif cmd == "dump":
            conn.send([b.tobytes() for b in bufs])
        else:
            break
    engine.close()


@dataclass
class Destination:
    process: Any
    conn: Any
    metadata: bytes
    regions: list[Region]

    def ask(self, cmd: str) -> Any:
        self.conn.send(cmd)
        if not self.conn.poll(WAIT):
            raise TimeoutError(f"destination did not answer {cmd!r} within {WAIT} s")
        return self.conn.recv()

    def buffers(self) -> list[np.ndarray]:
        return [np.frombuffer(b, np.uint8) for b in self.ask("dump")]

    def stop(self) -> int | None:
        """Ask the process to close its engine and exit (resuming it if frozen); return its exit code."""
        if self.process.is_alive():
            os.kill(self.process.pid, signal.SIGCONT)
            try:
                self.conn.send("quit")
            except OSError:
                pass
            self.process.join(10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        return self.process.exitcode


def start_destination(backend: str, layout: Layout, transfer_timeout: float = 5.0) -> Destination:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_serve, args=(child, backend, layout, transfer_timeout), daemon=True)
    proc.start()
    child.close()
    if not parent.poll(WAIT):
        proc.kill()
        raise TimeoutError(f"destination process sent no metadata within {WAIT} s (exit code {proc.exitcode})")
    metadata, regions = parent.recv()
    return Destination(proc, parent, metadata, regions)


# -- a standard layout and a source pattern -------------------------------------------------------
PAGE_ITEMS = (4096, 1024, 256)  # item bytes of the three page regions (multiples of 4)
ROW_BYTES, ROWS = 16, 10_000  # a region of small rows, for plans of thousands of descriptors


def standard_layout(pages: int, rows: int = ROWS) -> Layout:
    """Three page regions of different item sizes plus a region of ``rows`` small rows."""
    regions = [(f"page{e}", item, pages, "kv_page") for e, item in enumerate(PAGE_ITEMS)]
    return regions + [("rows", ROW_BYTES, rows, "row")]


def pattern(e: int, nbytes: int) -> np.ndarray:
    """Source bytes of region ``e``: word ``w`` holds ``(e+1) << 28 | w``, so every 4 bytes say where they came from."""
    return (np.arange(nbytes // 4, dtype=np.uint32) | np.uint32((e + 1) << 28)).view(np.uint8)


def pattern_buffers(layout: Layout) -> tuple[list[np.ndarray], list[Region]]:
    """Pattern-filled source buffers for ``layout`` and their regions (register them with the source engine)."""
    bufs = [pattern(e, item * count) for e, (_, item, count, _) in enumerate(layout)]
    regions = [region(name, buf, item, space, e) for e, (buf, (name, item, _, space)) in enumerate(zip(bufs, layout))]
    return bufs, regions


def page_plan(src: list[Region], dst: list[Region], src_idx: Any, dst_idx: Any, which: slice = slice(0, 3)) -> Any:
    """A validated plan moving items ``src_idx`` -> ``dst_idx`` of the regions ``which`` on both sides."""
    from kvbridge.core.planning.plan import plan_pages

    s, d = src[which], dst[which]
    plan = plan_pages([r.addr for r in s], [r.addr for r in d], [r.stride for r in s], src_idx, dst_idx)
    plan.validate(src, dst)
    return plan


def expected(src_bufs: list[np.ndarray], dst_layout: Layout, which: range, src_idx: Any, dst_idx: Any) -> list[np.ndarray]:
    """Destination buffers after the write, by plain numpy indexing: sentinel except the written items."""
    out = []
    for e in which:
        _, item, count, _ = dst_layout[e]
        exp = np.full(item * count, SENTINEL, np.uint8)
        exp.reshape(-1, item)[np.asarray(dst_idx)] = src_bufs[e].reshape(-1, item)[np.asarray(src_idx)]
        out.append(exp)
    return out
