"""A room end to end with the checksum off and on, over host or GPU memory: prefill here, decode in a child.

Used by ``kvbridge bench checksum``. One region of scattered 64 KiB pages (a random permutation:
nothing coalesces) per side, in host memory (numpy) or on GPU 0 (torch). A room's time runs from
prefill's ``send`` to decode's ``SUCCESS`` (the child reports ``time.monotonic()``, one clock for
both processes on Linux), so it includes both halves of the checksum: prefill hashing its source
before ``Done`` and decode hashing its pages before ``SUCCESS``. Off and on alternate room by room
through two prefill managers (one per setting), so drift hits both alike. Decode zeroes its pool
before each size and checks every byte of the last room of each size against the source pattern,
independently of the checksum.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np

from kvbridge import ui
from kvbridge.bench.common import finish_child
from kvbridge.core.control.bootstrap import BootstrapServer
from kvbridge.core.description.layout import IndexSpace, KVArgs, Region
from kvbridge.core.sessions.session import DecodeManager, Poll, PrefillManager, Receiver, Sender, SessionConfig

PAGE = 64 << 10
WORDS = PAGE // 8
SPACE = "p64k"
SLICE_PAGES = 1024  # pattern fills and checks in slices of 64 MiB: bounded temporaries
CONFIG = SessionConfig(transfer_timeout=300, waiting_timeout=600, heartbeat_timeout=60, heartbeat_interval=1,
                       sender_grace=600)


def indices(pages: int) -> tuple[np.ndarray, np.ndarray]:
    """Source pages 0..pages-1 and their destinations, a random permutation (deterministic per size)."""
    return np.arange(pages), np.random.default_rng(pages).permutation(pages)


def _pattern(xp: Any, pages: Any) -> Any:
    # Word w of source page p holds p * 2**20 + w: every word says where it came from.
    words = xp.arange(WORDS, device=pages.device) if xp is not np else np.arange(WORDS)
    return pages[:, None] * (1 << 20) + words[None, :]


def make_pool(device: str, pages: int, fill: bool) -> tuple[Any, KVArgs]:
    """``pages`` x 64 KiB of int64 in host memory (``cpu``, numpy) or on GPU 0 (``cuda``, torch), described."""
    if device == "cuda":
        import torch

        pool: Any = torch.zeros((pages, WORDS), dtype=torch.int64, device="cuda:0")
        addr, mem = pool.data_ptr(), "vram"
    else:
        pool = np.zeros((pages, WORDS), np.int64)
        addr, mem = pool.ctypes.data, "dram"
    if fill:
        fill_pattern(device, pool, np.arange(pages), np.arange(pages))
    region = Region(name="kv", addr=addr, nbytes=pages * PAGE, stride=PAGE, role="kv", index_space=SPACE, layer=0,
                    mem=mem, device=0)  # type: ignore[arg-type]
    return pool, KVArgs(regions=(region,), index_spaces=(IndexSpace(SPACE, pages),), dtype="int64", page_size=1)


def fill_pattern(device: str, pool: Any, at: np.ndarray, of: np.ndarray) -> None:
    """Pool pages ``at`` get the pattern of source pages ``of`` (in slices)."""
    for i in range(0, len(at), SLICE_PAGES):
        if device == "cuda":
            import torch

            rows = torch.as_tensor(at[i:i + SLICE_PAGES], device=pool.device)
            pool[rows] = _pattern(torch, torch.as_tensor(of[i:i + SLICE_PAGES], device=pool.device))
        else:
            pool[at[i:i + SLICE_PAGES]] = _pattern(np, of[i:i + SLICE_PAGES])


def holds(device: str, pool: Any, src: np.ndarray, dst: np.ndarray) -> bool:
    """Independent oracle: every destination page ``dst[j]`` holds source page ``src[j]``'s pattern."""
    for i in range(0, len(dst), SLICE_PAGES):
        if device == "cuda":
            import torch

            got = pool[torch.as_tensor(dst[i:i + SLICE_PAGES], device=pool.device)]
            if not torch.equal(got, _pattern(torch, torch.as_tensor(src[i:i + SLICE_PAGES], device=pool.device))):
                return False
        elif not np.array_equal(pool[dst[i:i + SLICE_PAGES]], _pattern(np, src[i:i + SLICE_PAGES])):
            return False
    return True


def device_path(device: str) -> str:
    """``cuda``: how this process hashes GPU 0 (``triton`` or ``torch``), waiting for the kernel's probe, so
    timed rooms do not change path halfway; ``cpu``: ``host``."""
    if device != "cuda":
        return "host"
    from kvbridge import checksum_torch

    return checksum_torch.path(0, wait=300)


def _config(backend_options: dict[str, str], checksum: bool) -> SessionConfig:
    return dataclasses.replace(CONFIG, backend_options=backend_options, checksum=checksum)


# -- decode child -------------------------------------------------------------------------------------
def run_decode(device: str, pages: int, backend: str, backend_options: dict[str, str]) -> int:
    """Rooms as the parent names them on stdin (``room address pages check``), one JSON line each."""
    pool, kvargs = make_pool(device, pages, fill=False)
    device_path(device)  # decode hashes its pages too: the same path as prefill's from the first timed room
    mgr = DecodeManager(kvargs, backend, config=_config(backend_options, False))
    current = 0
    try:
        for line in sys.stdin:
            if line.strip() == "done":
                break
            room, address, n, check = line.split()
            if int(n) != current:  # a new size: nothing of the last one may pass for this one's bytes
                pool.zero_() if device == "cuda" else pool.fill(0)
                current = int(n)
            src, dst = indices(current)
            recv = Receiver(mgr, int(room), bootstrap=address)
            recv.init([], state_indices={SPACE: dst})
            state = recv.wait(Poll.SUCCESS, 600)
            t = time.monotonic()
            verified = holds(device, pool, src, dst) if check == "1" else None
            print(json.dumps({"t": t, "ok": state == Poll.SUCCESS, "why": recv.failure(), "verified": verified}),
                  flush=True)
    finally:
        mgr.close()
    return 0


# -- prefill (this process) -----------------------------------------------------------------------------
def run(device: str, backend: str, backend_options: dict[str, str], sizes_mib: list[int], reps: int,
        tracker: ui.Tracker | None = None) -> list[dict[str, Any]]:
    """Per size: the room's median time off and on, the time the checksum adds, and decode's byte check."""
    most = (max(sizes_mib) << 20) // PAGE
    pool, kvargs = make_pool(device, most, fill=True)
    servers = {on: BootstrapServer("127.0.0.1") for on in (False, True)}
    mgrs = {on: PrefillManager(kvargs, backend, bootstrap=servers[on].address, config=_config(backend_options, on))
            for on in (False, True)}
    options = [f"--transfer-option={k}={v}" for k, v in backend_options.items()]
    child = subprocess.Popen([sys.executable, "-m", "kvbridge.bench.checksum_room", "--device", device, "--pages",
                              str(most), "--transfer-backend", backend, *options],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdin is not None and child.stdout is not None
    rows = []
    room = 0
    try:
        for mib in sizes_mib:
            pages = (mib << 20) // PAGE
            src, _ = indices(pages)
            times: dict[bool, list[float]] = {False: [], True: []}
            verified = True
            for rep in range(reps + 1):  # rep 0 warms up (connections, a first hash's compilation and caches)
                for on in (False, True):
                    room += 1
                    last = rep == reps and on
                    child.stdin.write(f"{room} {servers[on].address} {pages} {int(last)}\n")
                    child.stdin.flush()
                    sender = Sender(mgrs[on], room)
                    sender.wait(Poll.WAITING_FOR_INPUT, 600)
                    t0 = time.monotonic()
                    sender.send([], state_indices={SPACE: src}, last=True)
                    reply = json.loads(child.stdout.readline())
                    sender.wait(Poll.SUCCESS, 600)
                    if not reply["ok"] or sender.poll() != Poll.SUCCESS:
                        raise RuntimeError(f"{device} {mib} MiB checksum {'on' if on else 'off'}: decode "
                                           f"{reply['why']}, prefill {sender.failure()}")
                    if rep:
                        times[on].append(reply["t"] - t0)
                    if last:
                        verified = bool(reply["verified"])
            off, on_ = statistics.median(times[False]), statistics.median(times[True])
            rows.append({"device": device, "backend": backend, "bytes": pages * PAGE, "off_ms": off * 1e3,
                         "on_ms": on_ * 1e3, "off_GBps": pages * PAGE / off / 1e9, "on_GBps": pages * PAGE / on_ / 1e9,
                         "added_percent": 100 * (on_ - off) / off, "verified": verified})
            if tracker is not None:
                tracker.advance()
    finally:
        finish_child(child)
        for m in mgrs.values():
            m.close()
        for s in servers.values():
            s.close()
        del pool
    return rows


def main(argv: list[str] | None = None) -> int:
    """The decode child (started by :func:`run`)."""
    from kvbridge.config import TransferConfig, add_transfer_args

    parser = argparse.ArgumentParser(prog="kvbridge.bench.checksum_room")
    add_transfer_args(parser)
    parser.add_argument("--device", choices=("cpu", "cuda"), required=True)
    parser.add_argument("--pages", type=int, required=True)
    args = parser.parse_args(argv)
    cfg = TransferConfig.from_args(args, parser)
    return run_decode(args.device, args.pages, cfg.backend, dict(cfg.backend_options))


if __name__ == "__main__":
    sys.exit(main())
