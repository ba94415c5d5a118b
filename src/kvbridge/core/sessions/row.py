"""The metadata row inside ``Done``: a small row in host memory travels with the message instead of an engine write.

Every request ends with its metadata row (first token, logprobs, ...), the
commit point. Written by the engine, it costs a whole write (its fixed cost,
tens of microseconds to a fraction of a millisecond) for a few dozen bytes,
exposed after the last layer. When the row is small
(``SessionConfig.inline_row_bytes``, all metadata regions together) and in
host memory on both sides, prefill instead reads it (:func:`read_row`) once
that rank's last chunk has landed and puts the bytes in ``Done``; decode
checks them against its own metadata regions and the row it asked for
(:func:`check_row`) and copies them into place before it counts that
``Done``. The order is unchanged: that rank's pages landed, then the row,
then SUCCESS. A row in GPU memory, or larger, keeps the engine write.
Which rank carries the row is unchanged too: the one whose route plans it
(the last pipeline stage; of the prefill TP ranks, ``decode_rank % prefill_tp``).
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator, Sequence

from ..control import protocol as P
from ..description.layout import METADATA_SPACE, Region
from ..planning.pairing import Route, Totals
from ..planning.transferplan import TransferPlan

__all__ = ["RowError", "RowPlans", "check_row", "inline_row", "place_row", "read_row"]


class RowError(P.ProtocolError):
    """A metadata row carried in ``Done`` does not fit decode's metadata regions; the text says why."""


def _host_rows(regions: Sequence[Region]) -> list[Region] | None:
    """The metadata regions, if every one is in host memory and holds whole rows (replicated), else None."""
    rows = [r for r in regions if r.index_space == METADATA_SPACE]
    if not rows or any(r.mem != "dram" or r.shard.kind != "replicated" for r in rows):
        return None
    return rows


def inline_row(route: Route, limit: int) -> bool:
    """Whether the metadata row travels in ``Done`` on ``route``: it sends a row, of at most ``limit`` bytes in all,
    and both sides hold it in host memory (prefill reads it with the CPU, decode copies it with the CPU)."""
    if limit <= 0:
        return False
    space = route.spaces.get(METADATA_SPACE)
    if space is None or not space.sends:
        return False
    src, dst = _host_rows(route.src.regions), _host_rows(route.dst.regions)
    return src is not None and dst is not None and sum(g.index_nbytes for g in space.groups) <= limit


def read_row(plan: TransferPlan, row: int) -> P.MetadataRow:
    """Prefill: the source bytes of ``plan`` (one metadata row, host memory), each with its destination address."""
    pieces = tuple((d, ctypes.string_at(s, n)) for s, d, n in plan.descriptors())
    return P.MetadataRow(row=row, pieces=pieces)


def check_row(msg: P.MetadataRow, regions: Sequence[Region], asked: int) -> list[tuple[int, bytes]]:
    """Decode: ``msg``'s pieces, each checked to be exactly row ``asked`` of one of its own host metadata regions,
    none twice; :class:`RowError` names the first that is not (nothing is written then)."""
    if msg.row != asked:
        raise RowError(f"Done carries metadata row {msg.row} but this room asked for row {asked}")
    rows = [r for r in regions if r.index_space == METADATA_SPACE]
    where = {r.addr + asked * r.stride: r for r in rows}
    seen: set[int] = set()
    for addr, data in msg.pieces:
        r = where.get(addr)
        if r is None:
            raise RowError(f"Done carries {len(data)} metadata bytes for address {addr:#x}, which is not where row "
                           f"{asked} of one of this rank's {len(rows)} metadata regions starts")
        if r.mem != "dram":
            raise RowError(f"Done carries row {asked} of metadata region {r.name!r}, which is in GPU memory here: "
                           "only host-memory rows travel in Done")
        if len(data) != r.stride:
            raise RowError(f"Done carries {len(data)} bytes for row {asked} of metadata region {r.name!r}, whose rows "
                           f"are {r.stride} bytes")
        if addr in seen:
            raise RowError(f"Done carries row {asked} of metadata region {r.name!r} twice")
        seen.add(addr)
    return list(msg.pieces)


def place_row(pieces: Sequence[tuple[int, bytes]]) -> None:
    """Decode: copy checked pieces (:func:`check_row`) into place."""
    for addr, data in pieces:
        ctypes.memmove(addr, data, len(data))


class RowPlans:
    """One decode peer's metadata row plans, by (prefill row, decode row): planned once, reused by every
    request naming the same pair (a row's plan is a handful of descriptors, but planning it costs tens of
    microseconds per request); all are dropped when :data:`LIMIT` pairs are kept."""

    LIMIT = 4096

    def __init__(self) -> None:
        self._plans: dict[tuple[int, int], tuple[TransferPlan, Totals]] = {}

    def __iter__(self) -> Iterator[tuple[int, int]]:
        """The (prefill row, decode row) pairs planned."""
        return iter(self._plans)

    def plan(self, route: Route, src_row: int, dst_row: int, totals: Totals) -> TransferPlan:
        """The plan of row ``src_row`` into the peer's ``dst_row``; adds its bytes per state type to ``totals``."""
        cached = self._plans.get((src_row, dst_row))
        if cached is None:
            counted: Totals = {}
            cached = (route.plan({METADATA_SPACE: [src_row]}, {METADATA_SPACE: [dst_row]}, counted), counted)
            if len(self._plans) >= self.LIMIT:
                self._plans.clear()
            self._plans[(src_row, dst_row)] = cached
        plan, counted = cached
        for state_type, (nbytes, descriptors) in counted.items():
            b, n = totals.get(state_type, (0, 0))
            totals[state_type] = (b + nbytes, n + descriptors)
        return plan
