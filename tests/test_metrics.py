"""Transfer metrics: the Python snapshot and its Prometheus export, after real transfers.

The end-to-end test runs a prefill and a decode manager in this process over
Mooncake (TCP on loopback), moves requests with KV pages, a per-request
state slot and a metadata row, fails one on purpose, and compares the
snapshot with byte counts computed here from the request sizes.
"""

import json
import threading
import time

import numpy as np
import pytest

from kvbridge.core.control import metrics
from kvbridge.core.control.bootstrap import BootstrapServer
from kvbridge.core.description.layout import KV_PAGE_SPACE, METADATA_SPACE, IndexSpace, KVArgs, Region
from kvbridge.core.planning.pairing import pair_layouts
from kvbridge.core.planning.plan import PlanError
from kvbridge.core.sessions.session import DecodeManager, Poll, PrefillManager, Receiver, Sender, SessionConfig

BACKEND = "memory"  # metrics are core's: any backend records the same
LAYERS = 2
PAGE_NBYTES = 256
SLOT_NBYTES = 1024
ROW_NBYTES = 64
SLOT_SPACE = "mamba_slot"


class Pools:
    """K and V per layer (state type kv), one Mamba-like state slot pool, metadata rows."""

    def __init__(self, pages: int, slots: int, rows: int, fill: bool) -> None:
        rng = np.random.default_rng(7)
        make = (lambda *s: rng.integers(0, 255, s, np.uint8)) if fill else (lambda *s: np.zeros(s, np.uint8))
        self.kv = [make(pages, PAGE_NBYTES) for _ in range(2 * LAYERS)]
        self.slots = make(slots, SLOT_NBYTES)
        self.meta = make(rows, ROW_NBYTES)
        regions = [
            Region(name=f"{role}{layer}", addr=a.ctypes.data, nbytes=a.nbytes, stride=PAGE_NBYTES, role=role,
                   index_space=KV_PAGE_SPACE, layer=layer)
            for (layer, role), a in zip([(l, r) for r in ("k", "v") for l in range(LAYERS)], self.kv)
        ]
        regions.append(Region(name="ssm", addr=self.slots.ctypes.data, nbytes=self.slots.nbytes, stride=SLOT_NBYTES,
                              role="state", index_space=SLOT_SPACE, state_type="mamba", layer=0))
        regions.append(Region(name="meta", addr=self.meta.ctypes.data, nbytes=self.meta.nbytes, stride=ROW_NBYTES,
                              role="metadata", index_space=METADATA_SPACE, state_type="metadata"))
        self.kvargs = KVArgs(
            regions=tuple(regions),
            index_spaces=(IndexSpace(KV_PAGE_SPACE, pages, 16), IndexSpace(SLOT_SPACE, slots, kind="slot"),
                          IndexSpace(METADATA_SPACE, rows, kind="row")),
            dtype="bfloat16",
            page_size=16,
        )


def wait(rooms, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(r.poll() in (Poll.SUCCESS, Poll.FAILED) for r in rooms):
            return
        time.sleep(0.002)
    raise TimeoutError([r.poll() for r in rooms])


# Each request: source pages, destination pages, chunk sizes, slot (src, dst), metadata row (src, dst).
REQUESTS = [
    (list(range(0, 10)), list(range(100, 110)), [4, 6], (0, 3), (0, 1)),
    ([20, 3, 57, 58, 59], [7, 9, 11, 12, 13], [5], (1, 4), (1, 2)),
    (list(range(30, 42)), list(range(40, 52)), [2, 7, 3], (2, 5), (2, 3)),
]


@pytest.fixture(scope="module")
def run():
    """Serve REQUESTS plus one request that fails; return what the metrics said and what moved."""
    metrics.reset()
    cfg = SessionConfig(heartbeat_interval=0.2, heartbeat_timeout=5.0)
    src, dst = Pools(64, 4, 8, fill=True), Pools(128, 8, 8, fill=False)
    server = BootstrapServer("127.0.0.1")
    prefill = PrefillManager(src.kvargs, BACKEND, bootstrap=server.address, config=cfg)
    decode = DecodeManager(dst.kvargs, BACKEND, config=cfg)
    try:
        receivers, senders = [], []
        for room, (sp, dp, chunks, slot, row) in enumerate(REQUESTS, start=1):
            recv = Receiver(decode, room, bootstrap=server.address)
            recv.init(dp, state_indices={SLOT_SPACE: [slot[1]]}, metadata_row=row[1])
            receivers.append(recv)
            senders.append(Sender(prefill, room, metadata_row=row[0]))
        wait_until = time.monotonic() + 30
        while any(s.poll() < Poll.WAITING_FOR_INPUT for s in senders) and time.monotonic() < wait_until:
            time.sleep(0.002)
        for sender, (sp, dp, chunks, slot, row) in zip(senders, REQUESTS):
            bounds = np.cumsum([0, *chunks])
            for c in range(len(chunks)):
                last = c == len(chunks) - 1
                sender.send(sp[bounds[c]:bounds[c + 1]], state_indices={SLOT_SPACE: [slot[0]]} if last else None, last=last)
        wait(receivers + senders)
        assert all(r.poll() == Poll.SUCCESS for r in receivers + senders), [r.failure() for r in receivers + senders]
        ok = metrics.snapshot()

        # A request that fails on purpose: prefill sends a page index past its pool.
        bad_recv = Receiver(decode, 99, bootstrap=server.address)
        bad_recv.init([0, 1], metadata_row=4)
        bad_send = Sender(prefill, 99, metadata_row=4)
        wait_until = time.monotonic() + 30
        while bad_send.poll() < Poll.WAITING_FOR_INPUT and time.monotonic() < wait_until:
            time.sleep(0.002)
        bad_send.send([1, 10_000], last=True)
        wait([bad_recv, bad_send])
        assert bad_send.poll() == bad_recv.poll() == Poll.FAILED
        after = metrics.snapshot()
    finally:
        decode.close()
        prefill.close()
        server.close()
    return {"ok": ok, "after": after, "src": src, "dst": dst}


def expected_bytes():
    """Bytes each state type moved, from the request sizes alone."""
    pages = sum(len(sp) for sp, *_ in REQUESTS)
    return {
        "kv": pages * PAGE_NBYTES * 2 * LAYERS,
        "mamba": len(REQUESTS) * SLOT_NBYTES,
        "metadata": len(REQUESTS) * ROW_NBYTES,
    }


def test_the_transfers_landed(run):
    src, dst = run["src"], run["dst"]
    for sp, dp, _, slot, row in REQUESTS:
        for a, b in zip(src.kv, dst.kv):
            assert np.array_equal(b[dp], a[sp])
        assert np.array_equal(dst.slots[slot[1]], src.slots[slot[0]])
        assert np.array_equal(dst.meta[row[1]], src.meta[row[0]])


def test_bytes_per_state_type_equal_the_bytes_the_requests_moved(run):
    assert run["ok"]["backends"][BACKEND]["bytes"] == expected_bytes()


def test_descriptors_are_counted_per_state_type(run):
    desc = run["ok"]["backends"][BACKEND]["descriptors"]
    assert set(desc) == {"kv", "mamba", "metadata"}
    # Slots and rows are one descriptor each per request; pages coalesce into runs.
    assert desc["mamba"] == desc["metadata"] == len(REQUESTS)
    assert 0 < desc["kv"] <= sum(len(sp) for sp, *_ in REQUESTS) * 2 * LAYERS


def test_latency_histogram_counts_one_observation_per_transfer(run):
    hist = run["ok"]["backends"][BACKEND]["transfer_seconds"]
    transfers = sum(len(chunks) for _, _, chunks, _, _ in REQUESTS)  # one decode rank: one job per chunk
    assert hist["count"] == transfers == hist["buckets"]["+Inf"]
    assert hist["sum"] > 0
    counts = list(hist["buckets"].values())
    assert counts == sorted(counts)  # cumulative


def test_bootstrap_latency_and_successes_are_counted_per_role(run):
    b = run["ok"]["backends"][BACKEND]
    assert b["rooms_succeeded"] == {"prefill": len(REQUESTS), "decode": len(REQUESTS)}
    assert b["bootstrap_seconds"]["prefill"]["count"] == len(REQUESTS)
    assert b["bootstrap_seconds"]["decode"]["count"] == len(REQUESTS)
    assert b["failures"] == {}


def test_a_failed_request_is_counted_by_reason_on_both_sides(run):
    b = run["after"]["backends"][BACKEND]
    assert b["failures"] == {"prefill": {"bad_request": 1}, "decode": {"remote": 1}}
    assert b["bytes"] == expected_bytes()  # the failed request moved nothing
    assert b["rooms_succeeded"] == {"prefill": len(REQUESTS), "decode": len(REQUESTS)}


def test_snapshot_is_json(run):
    assert json.loads(json.dumps(run["after"])) == run["after"]


def test_prometheus_shows_the_same_values(run):
    prometheus_client = pytest.importorskip("prometheus_client")
    reg = prometheus_client.REGISTRY
    b = metrics.snapshot()["backends"][BACKEND]
    assert metrics.snapshot()["prometheus"] is True
    for state_type, n in expected_bytes().items():
        assert reg.get_sample_value("kvbridge_transfer_bytes_total", {"backend": BACKEND, "state_type": state_type}) == n
        assert reg.get_sample_value("kvbridge_transfer_descriptors_total",
                                    {"backend": BACKEND, "state_type": state_type}) == b["descriptors"][state_type]
    transfers = sum(len(chunks) for _, _, chunks, _, _ in REQUESTS)
    assert reg.get_sample_value("kvbridge_transfer_seconds_count", {"backend": BACKEND}) == transfers
    assert reg.get_sample_value("kvbridge_transfer_seconds_sum", {"backend": BACKEND}) == pytest.approx(
        b["transfer_seconds"]["sum"])
    assert reg.get_sample_value("kvbridge_failures_total",
                                {"backend": BACKEND, "role": "prefill", "reason": "bad_request"}) == 1
    assert reg.get_sample_value("kvbridge_failures_total",
                                {"backend": BACKEND, "role": "decode", "reason": "remote"}) == 1
    assert reg.get_sample_value("kvbridge_rooms_succeeded_total", {"backend": BACKEND, "role": "decode"}) == len(REQUESTS)
    assert reg.get_sample_value("kvbridge_bootstrap_seconds_count", {"backend": BACKEND, "role": "decode"}) == len(REQUESTS) + 1
    text = prometheus_client.generate_latest(reg).decode()
    assert 'kvbridge_transfer_bytes_total{backend="memory",state_type="kv"}' in text


# -- the collector on its own ----------------------------------------------------------------
def test_histogram_buckets_are_cumulative_with_le_semantics():
    m = metrics.Metrics()
    for seconds in (0.001, 0.0011, 0.5, 100.0):
        m.transfer("x", {"kv": (10, 1)}, seconds)
    hist = m.snapshot()["backends"]["x"]["transfer_seconds"]
    assert hist["count"] == 4 and hist["sum"] == pytest.approx(100.5021)
    assert hist["buckets"]["0.001"] == 1  # an observation equal to a bound falls in that bucket
    assert hist["buckets"]["0.0025"] == 2
    assert hist["buckets"]["0.5"] == 3
    assert hist["buckets"]["60.0"] == 3 and hist["buckets"]["+Inf"] == 4


def test_recording_from_many_threads_loses_nothing():
    m = metrics.Metrics()

    def work():
        for _ in range(2000):
            m.transfer("x", {"kv": (3, 1), "mamba": (5, 2)}, 0.01)
            m.failed("x", "prefill", "timeout")

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    b = m.snapshot()["backends"]["x"]
    assert b["bytes"] == {"kv": 3 * 16000, "mamba": 5 * 16000}
    assert b["descriptors"] == {"kv": 16000, "mamba": 32000}
    assert b["transfer_seconds"]["count"] == 16000
    assert b["failures"] == {"prefill": {"timeout": 16000}}


def test_reset_forgets_everything():
    m = metrics.Metrics()
    m.transfer("x", {"kv": (1, 1)}, 0.1)
    m.bootstrap("x", "decode", 0.1)
    m.succeeded("x", "decode")
    m.reset()
    assert m.snapshot()["backends"] == {}


# -- Route.plan's per-state-type totals ----------------------------------------------------------
def test_route_plan_adds_bytes_and_descriptors_per_state_type():
    src, dst = Pools(64, 4, 8, fill=False), Pools(128, 8, 8, fill=False)
    route = pair_layouts(src.kvargs, dst.kvargs)
    totals = {"kv": (1, 1)}  # accumulated onto what is there
    plan = route.plan({KV_PAGE_SPACE: [0, 1, 2, 9], SLOT_SPACE: [1]}, {KV_PAGE_SPACE: [5, 6, 7, 8], SLOT_SPACE: [2]}, totals)
    assert totals["kv"] == (1 + 4 * PAGE_NBYTES * 2 * LAYERS, 1 + 2 * 2 * LAYERS)  # runs 0-2 and 9 per region
    assert totals["mamba"] == (SLOT_NBYTES, 1)
    assert sum(b for b, _ in totals.values()) - 1 == int(plan.nbytes.sum())
    assert sum(n for _, n in totals.values()) - 1 == len(plan)


def test_route_plan_adds_nothing_when_the_plan_is_rejected():
    src, dst = Pools(64, 4, 8, fill=False), Pools(128, 8, 8, fill=False)
    route = pair_layouts(src.kvargs, dst.kvargs)
    totals: dict = {}
    with pytest.raises(PlanError):
        route.plan({KV_PAGE_SPACE: [0, 1], SLOT_SPACE: [1]}, {KV_PAGE_SPACE: [5, 6], SLOT_SPACE: [99]}, totals)
    assert totals == {}
