"""Drives kvbridge's SGLang adapter classes in the order SGLang's queues call them, for the tests.

Prefill (``PrefillBootstrapQueue`` then the inflight queue): a ``KVSender`` per
request and rank when the request arrives; ``poll()`` until ``WaitingForInput``;
``init(num_pages, aux_index)``; one ``send()`` per chunk, SGLang's state list with
the last; ``poll()`` until ``Success``. Decode (``DecodePreallocQueue`` then the
transfer queue): a ``KVReceiver`` per rank, ``init(prefill_dp_rank=0)``,
``send_metadata(pages, aux_index, state_indices)`` once allocated; ``poll()`` until
``Success``. State lists are built per ``kv_args.state_types`` as SGLang's
``_send_kv_chunk`` does (SWA: the window's pages; DSA: the KV pages).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import sglang_rig as rig
import torch
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.utils import DisaggregationMode

from kvbridge.integrations.sglang.conn import (
    KVBridgeKVManager,
    KVBridgeKVReceiver,
    KVBridgeKVSender,
    sglang_pools,
)

#: A request's pages: prefill's (source) and decode's (destination); the SWA window's pages in the SWA pools.
SRC_PAGES, DST_PAGES = [5, 2, 3, 7], [1, 6, 4, 8]
SRC_SWA, DST_SWA = [2, 3], [4, 1]
SRC_ROW, DST_ROW = 3, 5
SRC_SLOT, DST_SLOT = 2, 3  # the request's Mamba state slot
CHUNKS = (slice(0, 3), slice(3, 4))  # two prefill chunks: 3 pages, then the last page


def manager(rank: rig.Rank, mode: DisaggregationMode, port: int) -> KVBridgeKVManager:
    with sglang_pools(rank.target, rank.draft, rank.metadata):
        return KVBridgeKVManager(rank.kv_args, mode, rig.server_args(rank.tp_size, port), rig.is_mla(rank.kind))


def state_indices(kv_args: Any, swa: list[int], pages: list[int], slot: int) -> list[Any]:
    lists = {"swa": np.array(swa, dtype=np.int32), "dsa": np.array(pages, dtype=np.int32),
             "mamba": [np.array(slot, dtype=np.int64)]}  # SGLang's _mamba_payload: [translated slot index]
    return [lists[getattr(st, "value", st)] for st in kv_args.state_types]


def wait(pollers: list[Any], states: set[int], timeout: float) -> list[int]:
    """Poll (as SGLang's scheduler loop does) until every poller is in ``states``; their last polls."""
    deadline = time.monotonic() + timeout
    while True:
        polls = [int(p.poll()) for p in pollers]
        if all(s in states for s in polls) or time.monotonic() > deadline:
            return polls
        time.sleep(0.005)


def prefill_senders(managers: list[KVBridgeKVManager], port: int, room: int) -> list[KVBridgeKVSender]:
    return [KVBridgeKVSender(m, f"127.0.0.1:{port}", room) for m in managers]


def send_request(senders: list[KVBridgeKVSender], ranks: list[rig.Rank]) -> None:
    """Prefill's side once every sender reached WaitingForInput: init, then the chunks."""
    for s, r in zip(senders, ranks):
        s.init(len(SRC_PAGES), SRC_ROW)
    for i, chunk in enumerate(CHUNKS):
        last = i == len(CHUNKS) - 1
        for s, r in zip(senders, ranks):
            pages = np.array(SRC_PAGES[chunk], dtype=np.int32)
            s.send(pages, state_indices(r.kv_args, SRC_SWA, SRC_PAGES, SRC_SLOT) if last else None,
                   num_kv_tokens=len(pages) * rig.page_size(r.kind))


def send_and_finish(senders: list[KVBridgeKVSender], recvs: list[Any], ranks: list[rig.Rank]) -> list[str]:
    """:func:`send_request`, then poll both sides to an end: [] if every one reports Success, else why not."""
    send_request(senders, ranks)
    s_polls = wait(senders, {KVPoll.Success, KVPoll.Failed}, 30)
    r_polls = wait(recvs, {KVPoll.Success, KVPoll.Failed}, 30)
    if s_polls + r_polls != [KVPoll.Success] * (len(senders) + len(recvs)):
        return [f"polls: prefill {s_polls}, decode {r_polls}; reasons: "
                f"{[s.sender.failure() for s in senders] + [r.receiver.failure() for r in recvs]}"]
    return []


def ready_then_sent(senders: list[KVBridgeKVSender], recvs: list[Any], ranks: list[rig.Rank]) -> dict[str, list[int]]:
    """The polls of one request as a scheduler sees them: senders once decode asked, then both sides at the end."""
    ready = wait(senders, {KVPoll.WaitingForInput, KVPoll.Failed}, 30)
    send_request(senders, ranks)
    return {"ready": ready, "polls": wait(senders + recvs, {KVPoll.Success, KVPoll.Failed}, 30)}


def decode_receivers(managers: list[KVBridgeKVManager], ranks: list[rig.Rank], port: int,
                     room: int, dst_swa: list[int] = DST_SWA) -> list[KVBridgeKVReceiver]:
    recvs = [KVBridgeKVReceiver(m, f"127.0.0.1:{port}", room) for m in managers]
    for r in recvs:
        r.init(0)
    for r, rank in zip(recvs, ranks):
        r.send_metadata(np.array(DST_PAGES, dtype=np.int32), DST_ROW, state_indices(rank.kv_args, dst_swa, DST_PAGES, DST_SLOT))
    return recvs


def transfer(kind: str, prefill_tp: int, decode_tp: int, draft: bool, seed: int, room: int, backend: str,
             dst_swa: list[int] = DST_SWA, abort: str | None = None) -> list[str]:
    """One request through the adapters over kvbridge ``backend`` (as ``KVBRIDGE_SGLANG_BACKEND`` chose it);
    every mismatch against the oracle (empty: byte-exact). ``dst_swa``: the SWA pages decode allocates;
    ``abort``: "prefill" or "decode" aborts the request once prefill is ready, and the result is each side's reason."""
    from kvbridge.integrations.sglang.conn import KVBridgeKVBootstrapServer

    g = rig.global_tensors(kind, draft, seed)
    boot = KVBridgeKVBootstrapServer("127.0.0.1", 0)
    port = int(boot.address.rsplit(":", 1)[1])
    managers: list[KVBridgeKVManager] = []
    try:
        p_ranks = [rig.make_rank(kind, r, prefill_tp, draft=draft, fill=g) for r in range(prefill_tp)]
        d_ranks = [rig.make_rank(kind, r, decode_tp, draft=draft, fill=None) for r in range(decode_tp)]
        p_mgrs = [manager(r, DisaggregationMode.PREFILL, port) for r in p_ranks]
        managers += p_mgrs
        d_mgrs = [manager(r, DisaggregationMode.DECODE, port) for r in d_ranks]
        managers += d_mgrs
        used = sorted({m.transfer.backend_name for m in managers})  # lanes, e.g. "cuda_ipc,nixl": CPU bytes take the last
        if any(name.split(",")[-1] != backend for name in used):
            return [f"managers run over lanes {used}, not ending in {backend!r}"]
        senders = prefill_senders(p_mgrs, port, room)
        recvs = decode_receivers(d_mgrs, d_ranks, port, room, dst_swa)
        polls = wait(senders, {KVPoll.WaitingForInput, KVPoll.Failed}, 30)
        if polls != [KVPoll.WaitingForInput] * len(senders):
            return [f"prefill senders polled {polls}: {[s.sender.failure() for s in senders]}"]
        if abort is not None:
            for x in senders if abort == "prefill" else recvs:
                x.abort()
            polls = wait(senders + recvs, {KVPoll.Failed, KVPoll.Success}, 30)
            if polls != [KVPoll.Failed] * len(polls):
                return [f"after the {abort} abort: polls {polls}"]
            return [exception_text(x) for x in senders + recvs]
        problems = send_and_finish(senders, recvs, p_ranks)
        return problems or [p for rank in d_ranks for p in check_decode(rank, g)]
    finally:
        for m in managers:
            m.close()
        boot.close()


def exception_text(poller: Any) -> str:
    """What ``failure_exception()`` raises, as SGLang's scheduler reads it."""
    from sglang.srt.disaggregation.common.conn import KVTransferError

    try:
        poller.failure_exception()
    except KVTransferError as exc:
        return f"KVTransferError(room={exc.bootstrap_room}): {exc}"
    return "failure_exception() raised nothing"


def check_decode(rank: rig.Rank, g: dict) -> list[str]:
    """Every buffer of a decode rank against the oracle: asked-for items from the global source, the rest zero."""
    problems = []
    ps = rig.page_size(rank.kind)
    for name, (buf, how, index) in rig.rank_buffers(rank).items():
        src = rig.local_part(g[name], how, rank.tp_rank, rank.tp_size)
        expect = src.new_zeros(src.shape)
        pairs = {"swa": zip(SRC_SWA, DST_SWA), "slot": [(SRC_SLOT, DST_SLOT)]}.get(index, zip(SRC_PAGES, DST_PAGES))
        for s, d in pairs:
            if index in ("kv_rows", "slot"):  # one row per index
                expect[d] = src[s]
            else:  # token slots: a page is page_size rows
                expect[d * ps:(d + 1) * ps] = src[s * ps:(s + 1) * ps]
        if not buf.view(torch.uint8).equal(expect.view(torch.uint8)):  # bytes: random bf16 bits include NaNs
            problems.append(f"decode TP rank {rank.tp_rank}/{rank.tp_size}: buffer {name} differs from the oracle")
    for i, rows in enumerate(rig.metadata_rows(rank.metadata)):
        want = rows.new_zeros(rows.shape)
        want[DST_ROW] = g[f"meta{i}"].view(rows.shape)[SRC_ROW]
        if not bool((rows == want).all()):
            problems.append(f"decode TP rank {rank.tp_rank}: metadata buffer {i} differs from the oracle")
    return problems

