"""A peer's transfer worker: jobs in order; chunks of many rooms queued back to back go out together."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvbridge.core.control.bootstrap import BootstrapServer
from kvbridge.core.description.layout import IndexSpace, KVArgs, Region
from kvbridge.core.sessions.session import (
    KV_PAGE_SPACE,
    METADATA_SPACE,
    DecodeManager,
    Poll,
    PrefillManager,
    Receiver,
    Sender,
    SessionConfig,
)
from kvbridge.core.sessions.worker import MAX_GROUP, Group, PeerWorker

WAIT = 20.0


def _held(worker: PeerWorker) -> threading.Event:
    """Keep ``worker`` busy until the returned event is set (so later jobs queue up behind it)."""
    release, running = threading.Event(), threading.Event()

    def block() -> None:
        running.set()
        release.wait(WAIT)

    worker.submit(block)
    assert running.wait(WAIT)
    return release


def _until(cond: Any) -> None:
    deadline = time.monotonic() + WAIT
    while not cond():
        assert time.monotonic() < deadline, "worker did not get there in time"
        time.sleep(0.001)


def test_grouped_jobs_queued_back_to_back_run_in_one_call_and_plain_jobs_keep_their_place() -> None:
    worker = PeerWorker("test")
    calls: list[Any] = []

    def run(items: list[int]) -> None:
        calls.append(list(items))

    release = _held(worker)
    for i in range(3):
        worker.submit(Group(run, i))
    worker.submit(lambda: calls.append("plain"))
    worker.submit(Group(run, 3))
    worker.submit(Group(lambda items: calls.append(("other", items)), 4))  # another kind: its own call
    release.set()
    worker.stop()
    worker.join(WAIT)
    assert calls == [[0, 1, 2], "plain", [3], ("other", [4])]


def test_a_group_holds_at_most_max_group_jobs() -> None:
    worker = PeerWorker("test")
    sizes: list[int] = []
    def run(items: list[int]) -> None:
        sizes.append(len(items))

    release = _held(worker)
    for i in range(MAX_GROUP + 5):
        worker.submit(Group(run, i))
    release.set()
    worker.stop()
    worker.join(WAIT)
    assert sizes == [MAX_GROUP, 5]


def test_jobs_submitted_while_a_caller_holds_the_claim_wait_for_its_release_then_run_in_order() -> None:
    worker = PeerWorker("test")
    ran: list[int] = []
    assert worker.claim()
    for i in range(3):
        worker.submit(lambda i=i: ran.append(i))
    time.sleep(0.05)  # the worker's thread started for the first job; it must not run any while claimed
    assert ran == []
    assert not worker.claim(), "a claim while jobs are queued or claimed"
    worker.release()
    _until(lambda: ran == [0, 1, 2])
    worker.stop()
    worker.join(WAIT)


def test_a_claim_is_refused_while_a_job_runs_and_granted_once_the_worker_is_idle() -> None:
    worker = PeerWorker("test")
    release = _held(worker)
    assert not worker.claim()
    release.set()
    deadline = time.monotonic() + WAIT
    while not worker.claim():  # granted once the thread is back waiting for work
        assert time.monotonic() < deadline, "the idle worker never granted the claim"
        time.sleep(0.001)
    worker.release()
    worker.stop()
    worker.join(WAIT)


def test_join_waits_for_a_claimed_write_to_be_released() -> None:
    worker = PeerWorker("test")
    assert worker.claim()
    released = []
    timer = threading.Timer(0.1, lambda: (released.append(True), worker.release()))
    timer.start()
    worker.join(WAIT)
    assert released == [True]


# -- through the managers (memory backend, one process) ----------------------------------------
PAGE, META, PAGES, ROWS = 256, 16, 64, 16


def _args(kv: np.ndarray, meta: np.ndarray) -> KVArgs:
    return KVArgs(regions=(Region(name="kv", addr=kv.ctypes.data, nbytes=kv.nbytes, stride=PAGE, role="kv",
                                  index_space=KV_PAGE_SPACE, layer=0),
                           Region(name="meta", addr=meta.ctypes.data, nbytes=meta.nbytes, stride=META,
                                  role="metadata", index_space=METADATA_SPACE)),
                  index_spaces=(IndexSpace(KV_PAGE_SPACE, PAGES, 16), IndexSpace(METADATA_SPACE, ROWS)),
                  dtype="bfloat16", page_size=16)


@pytest.fixture
def pair(request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    rng = np.random.default_rng(5)
    src_kv = rng.integers(1, 255, (PAGES, PAGE), dtype=np.uint8)
    src_meta = rng.integers(1, 255, (ROWS, META), dtype=np.uint8)
    dst_kv, dst_meta = np.zeros_like(src_kv), np.zeros_like(src_meta)
    cfg = SessionConfig(transfer_timeout=WAIT, waiting_timeout=2 * WAIT, bootstrap_timeout=WAIT,
                        inline_row_bytes=getattr(request, "param", SessionConfig.inline_row_bytes))
    server = BootstrapServer("127.0.0.1")
    pm = PrefillManager(_args(src_kv, src_meta), "memory", bootstrap=server.address, config=cfg)
    dm = DecodeManager(_args(dst_kv, dst_meta), "memory", config=cfg)
    try:
        yield {"pm": pm, "dm": dm, "bootstrap": server.address, "src_kv": src_kv, "src_meta": src_meta,
               "dst_kv": dst_kv, "dst_meta": dst_meta}
    finally:
        dm.close()
        pm.close()
        server.close()


def _rooms(p: dict[str, Any], n: int, first: int) -> list[tuple[Sender, Receiver]]:
    """``n`` rooms, each ready to send: room ``first + i`` moves pages 3i..3i+2 -> 4i..4i+2 and row i -> i."""
    out = []
    for i in range(n):
        s = Sender(p["pm"], first + i, metadata_row=i)
        r = Receiver(p["dm"], first + i, bootstrap=p["bootstrap"])
        r.init(np.arange(4 * i, 4 * i + 3), metadata_row=i)
        assert s.wait(Poll.WAITING_FOR_INPUT, WAIT) == Poll.WAITING_FOR_INPUT, s.failure()
        out.append((s, r))
    return out


def _count_writes(pm: PrefillManager) -> list[int]:
    """Descriptors of every Transport.write call from now on (the real write still happens)."""
    seen: list[int] = []
    real = pm.transport.write

    def write(peer: str, plan: Any, deadline: float, live: Any = None, announce: Any = None) -> None:
        seen.append(len(plan))
        real(peer, plan, deadline, live, announce)

    pm.transport.write = write  # type: ignore[method-assign]
    return seen


@pytest.mark.parametrize("pair, writes_made", [(4096, [6]), (0, [6, 6])], indirect=["pair"],
                         ids=["rows_in_done", "rows_written"])
def test_chunks_of_rooms_queued_behind_a_busy_worker_go_out_in_one_write_byte_exact(
    pair: dict[str, Any], writes_made: list[int]
) -> None:
    pm = pair["pm"]
    rooms = _rooms(pair, 6, first=100)
    (peer,) = pm.peers()
    writes = _count_writes(pm)
    release = _held(peer.worker)
    for i, (s, _) in enumerate(rooms):
        s.send(np.arange(3 * i, 3 * i + 3), last=True)
    release.set()
    for s, r in rooms:
        assert r.wait(Poll.SUCCESS, WAIT) == Poll.SUCCESS, r.failure()
        assert s.wait(Poll.SUCCESS, WAIT) == Poll.SUCCESS, s.failure()
    # Every room's pages in one write (6 runs); each room's row in its Done, or, written by the engine,
    # every row in a second write.
    assert writes == writes_made
    for i in range(len(rooms)):
        np.testing.assert_array_equal(pair["dst_kv"][4 * i:4 * i + 3], pair["src_kv"][3 * i:3 * i + 3])
        np.testing.assert_array_equal(pair["dst_meta"][i], pair["src_meta"][i])
    untouched = np.ones(PAGES, bool)
    for i in range(len(rooms)):
        untouched[4 * i:4 * i + 3] = False
    assert not pair["dst_kv"][untouched].any() and not pair["dst_meta"][len(rooms):].any()


def test_a_failed_grouped_write_fails_every_room_in_it_on_both_sides(pair: dict[str, Any]) -> None:
    pm = pair["pm"]
    rooms = _rooms(pair, 3, first=200)
    (peer,) = pm.peers()
    release = _held(peer.worker)
    for i, (s, _) in enumerate(rooms):
        s.send(np.arange(3 * i, 3 * i + 3), last=True)
    pm.transport.backend.remove_peer(peer.peer_id)  # the engine forgets the peer: the write raises
    release.set()
    for s, r in rooms:
        assert s.wait(Poll.SUCCESS, WAIT) == Poll.FAILED
        assert r.wait(Poll.SUCCESS, WAIT) == Poll.FAILED
        reason = s.failure() or ""
        assert reason.startswith(f"transfer of chunk 0 to {peer.peer_id!r} failed: "), reason
        assert reason.endswith("(written together with 2 other rooms' chunks)"), reason
        assert reason in (r.failure() or ""), r.failure()


def test_a_room_aborted_while_queued_is_left_out_of_the_grouped_write(pair: dict[str, Any]) -> None:
    pm = pair["pm"]
    rooms = _rooms(pair, 3, first=300)
    (peer,) = pm.peers()
    writes = _count_writes(pm)
    release = _held(peer.worker)
    for i, (s, _) in enumerate(rooms):
        s.send(np.arange(3 * i, 3 * i + 3), last=True)
    rooms[1][0].abort("host gave up")
    release.set()
    for k, (s, r) in enumerate(rooms):
        want = Poll.FAILED if k == 1 else Poll.SUCCESS
        assert r.wait(Poll.SUCCESS, WAIT) == want, r.failure()
    assert writes == [2]  # rooms 0 and 2 only: one run of pages each (their metadata rows travel in Done)
    assert not pair["dst_kv"][4:7].any() and not pair["dst_meta"][1].any()  # nothing of room 1 was written


def test_a_room_aborted_during_a_grouped_write_gets_no_further_batch_and_the_others_succeed(pair: dict[str, Any]) -> None:
    # The fence stays per room in a grouped write: once room 1 is aborted, no batch that carries
    # its descriptors starts; the write is redone for rooms 0 and 2, which still succeed byte-exact.
    pm = pair["pm"]
    rooms = _rooms(pair, 3, first=500)
    (peer,) = pm.peers()
    pm.transport.lanes[0].batch_descriptors = 1  # one room's pages per batch (each room's pages are one run)
    real = pm.transport.backend.write
    posted: list[np.ndarray] = []

    def write(peer_id: str, batch: Any, deadline: float) -> None:
        if not posted:
            rooms[1][0].abort("host gave up")  # while the group's first batch (room 0) is in flight
        posted.append(np.array(batch.dst_addr))
        real(peer_id, batch, deadline)

    pm.transport.backend.write = write  # type: ignore[method-assign]
    release = _held(peer.worker)
    for i, (s, _) in enumerate(rooms):
        s.send(np.arange(3 * i, 3 * i + 3), last=True)
    release.set()
    for k, (s, r) in enumerate(rooms):
        want = Poll.FAILED if k == 1 else Poll.SUCCESS
        assert r.wait(Poll.SUCCESS, WAIT) == want, r.failure()
        assert s.wait(Poll.SUCCESS, WAIT) == want, s.failure()
    assert "host gave up" in (rooms[1][1].failure() or "")
    kv = pair["dst_kv"]
    room1 = (kv[4:7].ctypes.data, kv[7:].ctypes.data)
    assert not any(((a >= room1[0]) & (a < room1[1])).any() for a in posted), "a batch of room 1 started after its abort"
    assert not kv[4:7].any() and not pair["dst_meta"][1].any()
    for i in (0, 2):
        np.testing.assert_array_equal(kv[4 * i:4 * i + 3], pair["src_kv"][3 * i:3 * i + 3])
        np.testing.assert_array_equal(pair["dst_meta"][i], pair["src_meta"][i])


def test_wait_any_returns_at_once_for_a_room_that_moved_since_the_host_last_saw_it(pair: dict[str, Any]) -> None:
    # The host polled its sender while decode's request was still on the way; the request
    # arrived before the host called wait_any. With the state it saw, nothing is missed.
    s = Sender(pair["pm"], 400, metadata_row=0)
    assert s.poll() == Poll.BOOTSTRAPPING
    r = Receiver(pair["dm"], 400, bootstrap=pair["bootstrap"])
    r.init(np.arange(3), metadata_row=0)
    assert s.wait(Poll.WAITING_FOR_INPUT, WAIT) == Poll.WAITING_FOR_INPUT
    t0 = time.monotonic()
    pair["pm"].wait_any([s], 5.0, {s: Poll.BOOTSTRAPPING})
    assert time.monotonic() - t0 < 1.0
    # Without it the state now is the baseline: only a further change (or the timeout) ends the wait.
    t0 = time.monotonic()
    pair["pm"].wait_any([s], 0.3)
    assert time.monotonic() - t0 >= 0.3
    s.abort("done")


def _writers(pm: PrefillManager) -> list[str]:
    """The thread of every Transport.write call from now on (the real write still happens)."""
    names: list[str] = []
    real = pm.transport.write

    def write(peer: str, plan: Any, deadline: float, live: Any = None, announce: Any = None) -> None:
        names.append(threading.current_thread().name)
        real(peer, plan, deadline, live, announce)

    pm.transport.write = write  # type: ignore[method-assign]
    return names


def test_a_small_chunk_to_an_idle_peer_is_written_by_the_sending_thread_byte_exact(pair: dict[str, Any]) -> None:
    (s, r), = _rooms(pair, 1, first=300)
    writers = _writers(pair["pm"])
    s.send(np.arange(0, 3), last=True)
    assert s.poll() == Poll.SUCCESS, "send() returned before its inline write landed"
    assert writers == [threading.current_thread().name]
    assert r.wait(Poll.SUCCESS, WAIT) == Poll.SUCCESS, r.failure()
    np.testing.assert_array_equal(pair["dst_kv"][0:3], pair["src_kv"][0:3])
    np.testing.assert_array_equal(pair["dst_meta"][0], pair["src_meta"][0])


def test_a_chunk_sent_while_another_room_is_ready_goes_to_the_worker_and_both_land(pair: dict[str, Any]) -> None:
    rooms = _rooms(pair, 2, first=310)
    writers = _writers(pair["pm"])
    for i, (s, _) in enumerate(rooms):
        s.send(np.arange(3 * i, 3 * i + 3), last=True)
    for s, r in rooms:
        assert r.wait(Poll.SUCCESS, WAIT) == Poll.SUCCESS, r.failure()
    # The first went to the worker (the second was ready too: the host was about to send it); the second
    # found the worker busy or done: either way no write ran on this thread while another room was ready.
    assert writers[0].startswith("kvbridge-xfer-")
    for i in range(2):
        np.testing.assert_array_equal(pair["dst_kv"][4 * i:4 * i + 3], pair["src_kv"][3 * i:3 * i + 3])


def test_a_chunk_larger_than_the_inline_limit_goes_to_the_worker(pair: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    from kvbridge.core.sessions import inline

    monkeypatch.setattr(inline, "INLINE_MAX_BYTES", 2 * PAGE)  # a 3-page chunk is over it
    (s, r), = _rooms(pair, 1, first=320)
    writers = _writers(pair["pm"])
    s.send(np.arange(0, 3), last=True)
    assert r.wait(Poll.SUCCESS, WAIT) == Poll.SUCCESS, r.failure()
    assert len(writers) == 1 and writers[0].startswith("kvbridge-xfer-")
    np.testing.assert_array_equal(pair["dst_kv"][0:3], pair["src_kv"][0:3])


def test_a_metadata_row_plan_is_planned_once_per_pair_of_rows_and_every_room_s_row_lands(pair: dict[str, Any]) -> None:
    pm, dm = pair["pm"], pair["dm"]
    for room, (src_row, dst_row) in enumerate([(0, 1), (2, 3), (0, 1)], start=330):
        s = Sender(pm, room, metadata_row=src_row)
        r = Receiver(dm, room, bootstrap=pair["bootstrap"])
        pair["dst_meta"][dst_row] = 0
        r.init(np.arange(0, 2), metadata_row=dst_row)
        assert s.wait(Poll.WAITING_FOR_INPUT, WAIT) == Poll.WAITING_FOR_INPUT, s.failure()
        s.send(np.arange(2 * room % PAGES, 2 * room % PAGES + 2), last=True)
        assert r.wait(Poll.SUCCESS, WAIT) == Poll.SUCCESS, r.failure()
        np.testing.assert_array_equal(pair["dst_meta"][dst_row], pair["src_meta"][src_row])
    (peer,) = pm.peers()
    assert sorted(peer.row_plans) == [(0, 1), (2, 3)]


def test_a_chunk_sent_from_the_io_thread_goes_to_the_worker(pair: dict[str, Any]) -> None:
    pm = pair["pm"]
    (s, r), = _rooms(pair, 1, first=340)
    writers = _writers(pm)
    sent = threading.Event()
    pm.loop.call(lambda: (s.send(np.arange(0, 3), last=True), sent.set()))
    assert sent.wait(WAIT)
    assert r.wait(Poll.SUCCESS, WAIT) == Poll.SUCCESS, r.failure()
    assert len(writers) == 1 and writers[0].startswith("kvbridge-xfer-"), "the I/O thread must not write"
    np.testing.assert_array_equal(pair["dst_kv"][0:3], pair["src_kv"][0:3])
