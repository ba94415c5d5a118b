"""The control plane's messages: msgspec structs in one tagged union, versioned.

Every message carries the protocol version ``v``. Decoding is strict (unknown
fields, unknown types and wrong field types are rejected) and nothing is
pickled. :func:`decode` raises :class:`ProtocolError` with a reason that the
receiver sends back in a :class:`Reject`; a bad message never takes a server
down.

Index lists travel as little-endian int32 bytes (compact, and decoded with
``numpy.frombuffer`` without a Python loop).
"""

from __future__ import annotations

from typing import Annotated, Union

import msgspec
import numpy as np
import numpy.typing as npt

from ..description.layout import KVArgs, StagingOffer

__all__ = [
    "PROTOCOL_VERSION",
    "ProtocolError",
    "RankInfo",
    "Register",
    "RegisterAck",
    "Lookup",
    "LookupReply",
    "Hello",
    "HelloAck",
    "TransferRequest",
    "ChunkDone",
    "Checksum",
    "MetadataRow",
    "Done",
    "Failed",
    "Abort",
    "Fenced",
    "Heartbeat",
    "Reject",
    "Staged",
    "StagedRegion",
    "StagingOffer",
    "Unstaged",
    "Message",
    "encode",
    "decode",
    "pack_indices",
    "unpack_indices",
]

PROTOCOL_VERSION = 5  # 2: per-lane backend metadata in Hello; 3: incarnations; 4: staging (Hello.staging, Staged, Unstaged);
# 5: Staged names its pieces as unit offsets in decode's regions (StagedRegion), not as addresses and sizes
MAX_LANES = 16  # backends a Hello may list
MAX_STAGED_RUNS = 4096  # runs of pieces a Staged may list (kvbridge.core.planning.stage_index.MAX_RUNS)


class ProtocolError(ValueError):
    """A control message could not be accepted; the text says why."""


class _Msg(msgspec.Struct, tag_field="type", kw_only=True, frozen=True, forbid_unknown_fields=True):
    v: int = PROTOCOL_VERSION


class RankInfo(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A prefill rank as registered with the bootstrap endpoint."""

    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    control_addr: str
    #: The rank's lanes as a host names them ("nixl", "cuda_ipc,nixl").
    backend: str
    #: The registering manager's incarnation (hex; ``kvbridge.core.control.auth``): a restarted rank is a new one.
    incarnation: str = ""


# -- bootstrap: prefill ranks register, decode ranks look them up -------------------


class Register(_Msg, tag="register", frozen=True):
    rank: RankInfo


class RegisterAck(_Msg, tag="register_ack", frozen=True):
    pass


class Lookup(_Msg, tag="lookup", frozen=True):
    pass


class LookupReply(_Msg, tag="lookup_reply", frozen=True):
    ranks: tuple[RankInfo, ...]


# -- handshake: once per (decode rank, prefill rank) pair --------------------------


class Hello(_Msg, tag="hello", frozen=True):
    """Decode -> prefill: who I am, my memory, and how each of my backends reaches it."""

    peer_id: str
    #: Each of decode's lanes (backends, in order) and its connection metadata, opaque to core.
    lanes: Annotated[dict[str, bytes], msgspec.Meta(max_length=MAX_LANES)]
    kvargs: KVArgs
    #: Decode's host (``kvbridge.core.transfer.backend.host_id``): lanes that reach one host only are used
    #: only between ranks that send the same.
    host: str = ""
    #: Slots of decode's registered staging buffer lent to this prefill rank (``core/transfer/landing.py``);
    #: None: write every descriptor into place.
    staging: StagingOffer | None = None
    #: Decode's ``SessionConfig.instance_name`` ("": none): with its host and TP/PP rank, what a restarted
    #: process of this decode rank shares with the one it replaced (prefill retires that one at once).
    instance: Annotated[str, msgspec.Meta(max_length=256)] = ""


class HelloAck(_Msg, tag="hello_ack", frozen=True):
    """Prefill -> decode: accepted; the prefill rank's own description."""

    kvargs: KVArgs


# -- per request ---------------------------------------------------------------------


class TransferRequest(_Msg, tag="transfer_request", frozen=True):
    """Decode -> prefill: where a room's data goes.

    ``indices`` maps an index-space name to destination indices (int32 bytes);
    the ``kv_page`` list is consumed chunk by chunk, the others with the last
    chunk. ``metadata_row`` is the destination row, written last.
    """

    room: int
    indices: dict[str, bytes]
    metadata_row: int
    #: Decode's ``strict_index_lengths``: either side can ask for strictness.
    strict: bool = False
    #: Decode's ``checksum``: either side can ask for the end-to-end checksum.
    checksum: bool = False


class ChunkDone(_Msg, tag="chunk_done", frozen=True):
    """Prefill -> decode: chunk ``chunk`` of ``room`` has landed (not sent for the last chunk: ``Done`` says it)."""

    room: int
    chunk: int
    last: bool


class Checksum(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What one prefill rank wrote for a room, for decode to check (``kvbridge.core.sessions.checksum``).

    ``digest`` is ``algorithm`` over the source bytes in destination-address
    order; ``ranges`` the destination ranges written, in that order, as
    little-endian int64 ``(address, nbytes)`` pairs.
    """

    algorithm: str
    digest: int
    ranges: bytes


class MetadataRow(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Decode's metadata row, carried in ``Done`` instead of written by the engine (``kvbridge.core.sessions.row``).

    ``row`` is the row decode asked for; ``pieces`` one ``(destination
    address, bytes)`` per metadata region, each exactly one row of it.
    """

    row: int
    pieces: tuple[tuple[int, bytes], ...]


class Done(_Msg, tag="done", frozen=True):
    """Prefill -> decode: everything for ``room`` from this rank has landed, the metadata row last.

    ``row``: the metadata row itself, when it is small and in host memory on
    both sides (decode copies it into place before it counts this ``Done``);
    else it was written by the engine after every other byte.
    """

    room: int
    #: Set when either side asked for the end-to-end checksum.
    checksum: Checksum | None = None
    row: MetadataRow | None = None


class Failed(_Msg, tag="failed", frozen=True):
    room: int
    reason: str


class Abort(_Msg, tag="abort", frozen=True):
    """Either direction: the sender of this message gave up on ``room``.

    ``requested``: decode sent its ``TransferRequest`` for the room before
    giving up. False (its ``init`` failed) lets prefill fail a sender the host
    creates later; an abort of a requested room that prefill already finished
    is only answered.
    """

    room: int
    reason: str
    requested: bool = True


class Fenced(_Msg, tag="fenced", frozen=True):
    """Prefill -> decode: this rank has stopped ``room``: no write of it is in flight and none will start.

    Sent after ``Failed`` (or in answer to ``Abort``) once the room's running
    write has returned. Decode reports FAILED only once every prefill rank has
    fenced the room, or its fence timeout has passed.
    """

    room: int


class Heartbeat(_Msg, tag="heartbeat", frozen=True):
    """Decode pings each prefill rank it uses; the rank answers at once.

    ``clock`` makes the answer a lease: prefill puts its own
    ``time.monotonic()`` in its reply, and decode echoes the latest one it
    received from that rank in its next ping. An echoed clock proves decode
    was alive *after* that instant of prefill's own clock, however late the
    ping arrives (a queue that built up while prefill was frozen or cut off
    proves nothing newer than its content), so prefill writes to decode only
    within ``heartbeat_timeout`` of such a proof (``docs/failures.md``).
    """

    clock: float | None = None


class Reject(_Msg, tag="reject", frozen=True):
    """A message was refused. ``room`` is set when it concerned one."""

    reason: str
    room: int | None = None


class StagedRegion(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Consecutive pieces of a staged window that go to one of decode's regions, packed in order in the slot.

    ``region``: the region's position in decode's ``KVArgs.regions`` (as its ``Hello`` sent them). Piece
    ``k`` is ``counts[k]`` units (one where ``counts`` is empty) of ``unit`` bytes from unit ``offsets[k]``
    of the region; ``offsets`` and ``counts`` are little-endian uint32 arrays (4 bytes a piece).
    """

    region: int
    unit: int
    offsets: bytes
    counts: bytes = b""


class Staged(_Msg, tag="staged", frozen=True):
    """Prefill -> decode: a window of these rooms' pieces landed, gathered back to back, in decode's
    staging ``slot``; decode scatters it to ``pieces`` (runs of pieces in one region each, in slot
    order) only while every room is live there, then answers :class:`Unstaged`. Sent before those
    rooms' ``Done``, on the same connection: decode scatters before it can count a room's SUCCESS."""

    #: At least one: decode scatters only while every room named is live there, which no room would pass vacuously.
    rooms: Annotated[tuple[int, ...], msgspec.Meta(min_length=1)]
    slot: int
    pieces: Annotated[tuple[StagedRegion, ...], msgspec.Meta(max_length=MAX_STAGED_RUNS)]


class Unstaged(_Msg, tag="unstaged", frozen=True):
    """Decode -> prefill: staging ``slot`` is free again (scattered, or dropped for a room given up)."""

    slot: int


Message = Union[
    Register,
    RegisterAck,
    Lookup,
    LookupReply,
    Hello,
    HelloAck,
    TransferRequest,
    ChunkDone,
    Done,
    Failed,
    Abort,
    Fenced,
    Heartbeat,
    Reject,
    Staged,
    Unstaged,
]

_encoder = msgspec.msgpack.Encoder()
_decoder: msgspec.msgpack.Decoder[Message] = msgspec.msgpack.Decoder(Message)  # type: ignore[arg-type]


class _Envelope(msgspec.Struct):
    """Just enough of any message to explain why it was refused."""

    type: str = "?"
    v: int = PROTOCOL_VERSION  # absent on the wire means the current version, as in _Msg


_envelope_decoder = msgspec.msgpack.Decoder(_Envelope)


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes | memoryview) -> Message:
    """Decode one message strictly; :class:`ProtocolError` says what was wrong."""
    try:
        msg = _decoder.decode(data)
    except (ValueError, TypeError, ArithmeticError, RecursionError) as exc:  # msgspec's errors are ValueErrors; the rest from field checks
        try:
            env = _envelope_decoder.decode(data)
        except (ValueError, TypeError, ArithmeticError, RecursionError):
            raise ProtocolError(f"undecodable control message ({len(data)} bytes): {exc}") from None
        if env.v != PROTOCOL_VERSION:
            raise ProtocolError(
                f"protocol version {env.v} is not supported (this side speaks {PROTOCOL_VERSION}); "
                "run the same kvbridge version on prefill and decode"
            ) from None
        raise ProtocolError(f"malformed {env.type!r} message: {exc}") from None
    if msg.v != PROTOCOL_VERSION:
        raise ProtocolError(
            f"protocol version {msg.v} is not supported (this side speaks {PROTOCOL_VERSION}); "
            "run the same kvbridge version on prefill and decode"
        )
    return msg


def pack_indices(idx: npt.ArrayLike) -> bytes:
    arr = np.asarray(idx)
    if arr.size and (arr.min() < 0 or arr.max() > np.iinfo(np.int32).max):
        raise ProtocolError("indices must lie in 0 .. 2**31-1 to travel as int32")
    return arr.astype("<i4", copy=False).tobytes()


def unpack_indices(name: str, data: bytes) -> npt.NDArray[np.int64]:
    if len(data) % 4:
        raise ProtocolError(f"index list {name!r} has {len(data)} bytes, not a multiple of 4 (int32)")
    return np.frombuffer(data, dtype="<i4").astype(np.int64)
