"""The memory description: what a rank registers, described once.

A rank describes its transferable memory as a list of :class:`Region` records
inside a :class:`KVArgs`. Everything else (transfer plans, bounds checks,
pairing of regions between prefill and decode) is derived from it. The records
are msgspec Structs so the decode side's description travels in the handshake
unchanged.

Vocabulary:

- **index space**: a named set of equally sized items addressed by an integer
  index: KV pages (``kv_page``), sliding-window pages (``swa_page``), request
  slots (``slot``), metadata rows (``metadata_row``), ...
- **region**: one contiguous buffer whose item ``i`` lives at
  ``addr + i * stride`` (one layer's K buffer, one layer's conv state, the
  metadata buffer, ...).
- **shard**: how one item is split across tensor-parallel ranks.
"""

from __future__ import annotations

import re
from typing import Literal

import msgspec
import numpy as np

__all__ = ["KV_PAGE_SPACE", "METADATA_SPACE", "ROLES", "ROLE_PATTERN", "MEMORY_KINDS", "check_role", "IndexSpace", "Shard", "Region", "KVArgs", "StagingOffer"]

#: What a region holds, for the buffers core's pools and the built-in state
#: handlers describe. The vocabulary is open: a state handler names its other
#: buffers (several per layer, say ``wkv_a`` and ``wkv_b``) with its own roles,
#: declared in ``HandlerCapabilities.roles``; ``describe()`` rejects a role its
#: handler did not declare, so a typo fails where it is made. Regions pair by
#: (state type, role, layer, draft): a role only has to be the same word on both sides.
ROLES: frozenset[str] = frozenset(
    {"k", "v", "kv", "conv", "temporal", "indexer", "scale", "state", "metadata"}
)
#: What every role is: a lowercase word (letters, digits, ``_``), starting with a letter.
ROLE_PATTERN = re.compile(r"[a-z][a-z0-9_]*")

#: The index space consumed chunk by chunk (full KV pages).
KV_PAGE_SPACE = "kv_page"
#: The index space of the per-request metadata row, written last (the commit point).
METADATA_SPACE = "metadata_row"

MemoryKind = Literal["dram", "vram"]
MEMORY_KINDS: frozenset[str] = frozenset({"dram", "vram"})


def check_role(role: object, where: str) -> None:
    """Raise ``ValueError`` (starting with ``where``) unless ``role`` is a lowercase word."""
    if not isinstance(role, str) or not ROLE_PATTERN.fullmatch(role):
        raise ValueError(
            f"{where}: role {role!r} is not a lowercase word (letters, digits, '_', starting with a letter); "
            f"core's roles are {', '.join(sorted(ROLES))}, and a state handler declares its own in "
            "HandlerCapabilities.roles"
        )


class IndexSpace(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A named set of ``count`` items addressed by index ``0 .. count-1``.

    ``tokens`` is how many tokens one index covers (the page size for KV
    pages, 1 for request slots and metadata rows). ``kind`` decides the
    index-length mismatch policy: ``page`` lists may be trimmed to the
    shorter side (with a warning); ``slot``, ``row`` and ``token`` lists
    must match.

    ``optional``: a state list of this space may be left out of a request
    (decode allocated it, prefill sends nothing for it). Only when both
    sides declare the space optional; otherwise a list decode sent and
    prefill omitted fails the room on both sides.
    """

    name: str
    count: int
    tokens: int = 1
    kind: Literal["page", "slot", "row", "token"] = "page"
    optional: bool = False

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("index space has an empty name")
        if self.count <= 0:
            raise ValueError(f"index space {self.name!r}: count must be > 0, got {self.count}")
        if self.tokens <= 0:
            raise ValueError(f"index space {self.name!r}: tokens must be > 0, got {self.tokens}")
        if self.kind not in ("page", "slot", "row", "token"):
            raise ValueError(f"index space {self.name!r}: kind must be 'page', 'slot', 'row' or 'token', got {self.kind!r}")


class Shard(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How one item is split across tensor-parallel ranks.

    A split item is viewed as ``outer`` rows, each holding this rank's share of
    the TP-sharded dimension (KV heads, channels) in ``unit_nbytes`` units.
    ``totals`` are the *global* sizes of the groups of that dimension that are
    sharded independently: ``(kv_heads,)`` for KV, ``(key_dim, key_dim,
    value_dim)`` for a gated-delta-net conv state whose q|k|v sub-blocks are
    each split on their own. Rank ``r`` of ``T`` holds units
    ``[r*total//T, r*total//T + max(1, total//T))`` of every group (when
    ``T > total`` each unit is replicated on ``T // total`` ranks).

    Token-major pages (NHD, ``[tokens, heads, head_dim]``) have
    ``outer = tokens per page``, ``unit_nbytes = head_dim * dtype``; head-major
    pages (HND, ``[heads, tokens, head_dim]``) have ``outer = 1``,
    ``unit_nbytes = tokens * head_dim * dtype``, so a head slice is contiguous.

    ``kind="replicated"`` means every rank holds the whole item (MLA latent
    cache, indexer caches, metadata); the other fields are then unused.
    """

    kind: Literal["replicated", "split"] = "replicated"
    outer: int = 1
    totals: tuple[int, ...] = ()
    unit_nbytes: int = 0

    def __post_init__(self) -> None:
        if self.kind == "split":
            if self.outer <= 0 or self.unit_nbytes <= 0 or not self.totals or min(self.totals) <= 0:
                raise ValueError(
                    f"split shard needs outer > 0, unit_nbytes > 0 and positive group totals, got "
                    f"outer={self.outer} totals={list(self.totals)} unit_nbytes={self.unit_nbytes}"
                )

    def check_tp(self, tp_size: int) -> str | None:
        """Why this shard cannot be split ``tp_size`` ways, or None."""
        if self.kind != "split":
            return None
        for total in self.totals:
            if total % tp_size and tp_size % total:
                return f"a group of {total} cannot be split across TP {tp_size} (neither divides the other)"
        return None

    def local(self, tp_rank: int, tp_size: int) -> list[tuple[int, int]]:
        """``(global_start, count)`` of each group held by ``tp_rank``."""
        return [((tp_rank * total) // tp_size, max(1, total // tp_size)) for total in self.totals]

    def owns(self, tp_rank: int, tp_size: int) -> list[bool]:
        """Per group: is ``tp_rank`` the one rank (of its replicas) that sends its units?"""
        return [tp_rank % max(1, tp_size // total) == 0 for total in self.totals]

    def item_nbytes(self, tp_rank: int, tp_size: int) -> int:
        """Bytes of one item on ``tp_rank`` (split shards only)."""
        return self.outer * sum(n for _, n in self.local(tp_rank, tp_size)) * self.unit_nbytes


#: Addresses and sizes are planned as int64.
INT64_MAX = 2**63 - 1


class Region(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One registered buffer: item ``i`` of ``index_space`` is at ``addr + i * stride``.

    ``addr`` is a raw address: a Region holds no reference to the memory, so
    the host keeps it allocated until every manager that registered it is
    closed (memory freed under a registration is written or read as garbage,
    or fails the engine's write). :func:`~kvbridge.core.description.describe.describe`,
    given pool objects, holds them for you.

    Regions pair between prefill and decode by :attr:`key` (state type, role,
    layer, draft), never by position.
    """

    name: str
    addr: int
    nbytes: int
    stride: int
    role: str
    index_space: str
    layer: int = -1
    state_type: str = "kv"
    draft: bool = False
    mem: MemoryKind = "dram"
    device: int = 0
    shard: Shard = Shard()

    def __post_init__(self) -> None:
        where = f"region {self.name!r}"
        if not self.name:
            raise ValueError("a region has an empty name")
        check_role(self.role, where)
        if self.mem not in MEMORY_KINDS:
            raise ValueError(f"{where}: unknown memory kind {self.mem!r}; use 'dram' or 'vram'")
        if self.addr <= 0:
            raise ValueError(f"{where}: address must be > 0, got {self.addr:#x}")
        if self.nbytes <= 0:
            raise ValueError(f"{where}: size must be > 0, got {self.nbytes}")
        if self.stride <= 0:
            raise ValueError(f"{where}: stride must be > 0, got {self.stride}")
        if self.addr + self.nbytes > INT64_MAX:
            raise ValueError(f"{where}: [{self.addr:#x}, +{self.nbytes:#x}) ends past 2**63-1, outside any address space")
        if self.stride > self.nbytes:
            raise ValueError(
                f"{where}: stride {self.stride} is larger than the region ({self.nbytes} bytes)"
            )

    @property
    def end(self) -> int:
        return self.addr + self.nbytes

    @property
    def key(self) -> tuple[str, str, int, bool]:
        """What pairs this region with its peer on the other side."""
        return (self.state_type, self.role, self.layer, self.draft)


# weakref: describe() keeps the pool objects a KVArgs was made from alive for as long as it lives.
# omit_defaults: a KVArgs without aliases encodes exactly as before they existed, so a peer running
# the previous version still decodes it (its decoder forbids unknown fields; omitted ones take the
# same defaults). One with aliases fails that peer's Hello as a malformed message, naming the field.
class KVArgs(msgspec.Struct, frozen=True, forbid_unknown_fields=True, weakref=True, omit_defaults=True):
    """Everything one rank registers, plus the model facts both sides must share.

    Validated on construction (and on decoding from the wire): region names
    and keys are unique, regions do not overlap in memory, every region's
    index space is declared and fits inside it.

    ``aliases``: regions that lie inside memory a region of ``regions``
    already covers (another view of the same bytes: vLLM lays a Mamba
    layer's state pages over an attention layer's KV pages). They are paired
    and planned like regions, but never registered with a backend, never in
    a ``RegionTable`` and exempt from the overlap check: each must lie wholly
    inside one region of the same memory kind and device, whose registration
    covers its bytes. Their items may be padded (stride larger than a split
    shard's item). Everything that registers memory reads ``regions`` only.
    A layer-wise send groups an alias's bytes with the layer of the region
    that holds them (its own layer id names no layer group).
    """

    regions: tuple[Region, ...]
    index_spaces: tuple[IndexSpace, ...]
    dtype: str
    page_size: int
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    aliases: tuple[Region, ...] = ()

    def __post_init__(self) -> None:
        if self.page_size <= 0:
            raise ValueError(f"page_size must be > 0, got {self.page_size}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} is outside tp_size {self.tp_size}")
        if not 0 <= self.pp_rank < self.pp_size:
            raise ValueError(f"pp_rank {self.pp_rank} is outside pp_size {self.pp_size}")
        spaces: dict[str, IndexSpace] = {}
        for space in self.index_spaces:
            if space.name in spaces:
                raise ValueError(f"index space {space.name!r} is declared twice")
            spaces[space.name] = space
        names: set[str] = set()
        keys: dict[tuple[str, str, int, bool], str] = {}
        aliases = {r.name for r in self.aliases}
        for r in (*self.regions, *self.aliases):
            if r.name in names:
                raise ValueError(f"region name {r.name!r} is used twice")
            names.add(r.name)
            if r.key in keys:
                raise ValueError(
                    f"regions {keys[r.key]!r} and {r.name!r} have the same "
                    f"(state_type, role, layer, draft) = {r.key}; each must be unique"
                )
            keys[r.key] = r.name
            declared = spaces.get(r.index_space)
            if declared is None:
                raise ValueError(
                    f"region {r.name!r}: index space {r.index_space!r} is not declared "
                    f"(declared: {', '.join(sorted(spaces)) or 'none'})"
                )
            if r.shard.kind == "split":
                why = r.shard.check_tp(self.tp_size)
                if why:
                    raise ValueError(f"region {r.name!r}: {why}")
                want = r.shard.item_nbytes(self.tp_rank, self.tp_size)
                if want != r.stride and not (r.name in aliases and want < r.stride):
                    raise ValueError(
                        f"region {r.name!r}: its shard describes {want}-byte items on TP rank "
                        f"{self.tp_rank} of {self.tp_size} (outer {r.shard.outer} x "
                        f"{want // (r.shard.outer * r.shard.unit_nbytes)} units x {r.shard.unit_nbytes} B) "
                        f"but the stride is {r.stride}"
                    )
            # An item's bytes: the stride, but a padded (alias) item's padding after its last item need not exist.
            item = r.shard.item_nbytes(self.tp_rank, self.tp_size) if r.shard.kind == "split" else r.stride
            if (declared.count - 1) * r.stride + item > r.nbytes:
                raise ValueError(
                    f"region {r.name!r}: index space {declared.name!r} has {declared.count} items "
                    f"of {item} B, {r.stride} B apart = {(declared.count - 1) * r.stride + item} B, but the "
                    f"region holds only {r.nbytes} B"
                )
        _check_no_overlap(self.regions)
        _check_aliases_inside(self.aliases, self.regions)

    @property
    def all_regions(self) -> tuple[Region, ...]:
        """``regions`` then ``aliases``: every region the planner pairs (registration reads ``regions``)."""
        return (*self.regions, *self.aliases)

    def region(self, name: str) -> Region:
        for r in self.all_regions:
            if r.name == name:
                return r
        raise KeyError(f"no region named {name!r}")

    def index_space(self, name: str) -> IndexSpace:
        for s in self.index_spaces:
            if s.name == name:
                return s
        raise KeyError(f"no index space named {name!r}")


def _check_no_overlap(regions: tuple[Region, ...]) -> None:
    """Regions of the same memory (kind, device) must not share a byte."""
    by_memory: dict[tuple[str, int], list[Region]] = {}
    for r in regions:
        by_memory.setdefault((r.mem, r.device), []).append(r)
    for group in by_memory.values():
        if len(group) < 2:
            continue
        starts = np.array([r.addr for r in group], dtype=np.int64)
        ends = np.array([r.end for r in group], dtype=np.int64)
        order = np.argsort(starts, kind="stable")
        clash = np.flatnonzero(ends[order][:-1] > starts[order][1:])
        if clash.size:
            a, b = group[order[clash[0]]], group[order[clash[0] + 1]]
            raise ValueError(
                f"region {b.name!r} [{b.addr:#x}, {b.end:#x}) overlaps region "
                f"{a.name!r} [{a.addr:#x}, {a.end:#x})"
            )


def _check_aliases_inside(aliases: tuple[Region, ...], regions: tuple[Region, ...]) -> None:
    """Each alias lies wholly inside one region of its memory (kind, device): that region registers its bytes."""
    for a in aliases:
        same = [r for r in regions if (r.mem, r.device) == (a.mem, a.device)]
        if any(r.addr <= a.addr and a.end <= r.end for r in same):
            continue
        near = min(same, key=lambda r: min(abs(a.addr - r.addr), abs(a.addr - r.end)), default=None)
        where = (f"nearest: {near.name!r} [{near.addr:#x}, {near.end:#x})" if near is not None
                 else f"no region is in {a.mem} memory of device {a.device}")
        raise ValueError(
            f"alias region {a.name!r} [{a.addr:#x}, {a.end:#x}) ({a.mem}, device {a.device}) lies inside no "
            f"region of the same memory ({where}); an alias must be another view of bytes a region already "
            "registers: describe it as an ordinary region (in regions) if its memory is its own"
        )


class StagingOffer(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Decode's staging buffer and the slots of it one prefill rank may write windows into (sent in its
    ``Hello``; kvbridge.core.transfer.landing)."""

    region: Region
    slots: tuple[int, ...]
    slice_bytes: int
