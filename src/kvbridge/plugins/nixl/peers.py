"""The NIXL adapter's peers (a part of :class:`~.backend.NixlBackend`): agents loaded, reloaded, page tables.

A peer's agent metadata is loaded with ``add_remote_agent`` and its regions' page table prepared
(:meth:`NixlPeers.add_peer`); a peer removed while a write to it is in progress is released by
that write (``_retire``); a peer whose UCX endpoint failed has its agent unloaded and loaded
again so that the next write connects anew (``_reload``; :mod:`.backend` says why).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvbridge.core import TransferError
from kvbridge.core.description.layout import Region
from kvbridge.core.planning.plan import RegionTable

from ..tcpfence import TcpFence
from .pages import PageTable

if TYPE_CHECKING:
    from nixl_cu12 import nixl_agent  # or nixl_cu13: same API

__all__ = ["NixlPeers"]

log = logging.getLogger(__name__)


@dataclass
class _Peer:
    name: str  # kvbridge's peer id
    agent: str  # the NIXL agent name add_remote_agent returned
    table: PageTable | None  # None when the peer registered no regions, or they mix memory kinds
    regions: RegionTable  # its regions, to place a batch core did not post (memory_of)
    metadata: bytes  # its agent metadata, to load again after its endpoint failed (_reload)
    region_list: list[Region]  # its regions as add_peer got them, for the page table _reload prepares again
    writes: int = 0  # writes in progress (guarded by the backend's lock)
    retired: bool = False  # removed while a write was in progress; released by the last write
    forget_agent: bool = True  # whether retiring also unloads the remote agent
    unloaded: bool = False  # _reload unloaded its agent and loading it again failed: the next write retries


class NixlPeers:
    """The peers of :class:`~.backend.NixlBackend` (a part of it: it keeps the state below and provides
    ``_live_agent``, ``_prep`` and ``_quietly``), kept here because it is one job with its own rules."""

    _tcp: TcpFence
    _lock: threading.Lock
    _agents: threading.RLock
    _peers: dict[str, _Peer]
    _agent: nixl_agent | None
    _errors: tuple[type[BaseException], ...]
    _live_agent: Callable[[], nixl_agent]
    _prep: Callable[[str, Sequence[Region]], PageTable | None]
    _quietly: Callable[[Any, str], None]

    def add_peer(self, peer: str, metadata: bytes, regions: Sequence[Region]) -> None:
        """Load ``peer``'s agent metadata and prepare the page table of its regions."""
        metadata = self._tcp.open(peer, metadata)
        with self._agents:
            self._add_peer(peer, metadata, regions)

    def _add_peer(self, peer: str, metadata: bytes, regions: Sequence[Region]) -> None:
        agent = self._live_agent()
        try:
            loaded = agent.add_remote_agent(bytes(metadata))
        except self._errors as exc:
            raise TransferError(
                f"nixl: peer {peer!r} sent {len(metadata)} bytes of metadata that NIXL could not load "
                f"({exc!r}); expected get_agent_metadata() of another nixl backend"
            ) from exc
        # NIXL returns the name as bytes (b"decode-..."); it accepts str everywhere.
        agent_name = loaded.decode(errors="replace") if isinstance(loaded, bytes) else str(loaded)
        try:
            table = self._prep(agent_name, regions)
        except self._errors as exc:
            with self._lock:
                in_use = any(p.agent == agent_name for p in self._peers.values())
            if not in_use:
                self._quietly(lambda: agent.remove_remote_agent(agent_name), f"unloading the agent of peer {peer!r}")
            raise TransferError(
                f"nixl: peer {peer!r} (agent {agent_name!r}) described {len(regions)} regions that its "
                f"agent metadata does not cover ({exc!r}); it must register them before sending metadata"
            ) from exc
        with self._lock:
            old = self._peers.pop(peer, None)
            table_of_regions = RegionTable(regions)
            self._peers[peer] = _Peer(peer, agent_name, table, table_of_regions, bytes(metadata), list(regions))
        if old is not None:
            self._retire(old, forget_agent=old.agent != agent_name)

    def remove_peer(self, peer: str) -> None:
        """Forget ``peer`` and disconnect from its agent. Unknown peers are ignored."""
        self._tcp.forget(peer)
        with self._lock:
            old = self._peers.pop(peer, None)
        if old is not None:
            self._retire(old, forget_agent=True)

    def abort_peer(self, peer: str, stuck: bool = False) -> int:
        return self._tcp.abort_peer(peer, stuck)

    def _retire(self, peer: _Peer, forget_agent: bool) -> None:
        """Release what ``peer`` holds now, or after the writes to it in progress."""
        with self._agents:
            with self._lock:
                peer.forget_agent = forget_agent
                if peer.writes:
                    peer.retired = True  # the last write in progress releases it
                    return
                # Another peer id may use the same agent (a re-handshake under a new id).
                forget_agent = forget_agent and not any(p.agent == peer.agent for p in self._peers.values())
            if peer.table is not None:
                self._quietly(peer.table.handle.release, f"releasing the page table of peer {peer.name!r}")
            if forget_agent and self._agent is not None:
                self._quietly(lambda: self._agent.remove_remote_agent(peer.agent),
                              f"removing the agent of peer {peer.name!r}")

    def _reload(self, p: _Peer) -> None:
        """Unload ``p``'s agent and load its metadata again, so that the next write connects anew: NIXL
        keeps a UCX endpoint that failed failed (the peer's connection was reset, by core's TCP fence
        among others) and every later write to it would fail too. Runs on the writing thread.

        Not for a peer that was retired or replaced meanwhile (a re-handshake loaded its agent afresh),
        nor while another peer id uses the same agent (its page table was prepared against that load)."""
        with self._agents:
            with self._lock:
                current = self._peers.get(p.name) is p and not p.retired
                shared = any(o is not p and o.agent == p.agent for o in self._peers.values())
            if not current or shared:
                log.info("nixl: not reloading the agent of peer %r: %s", p.name,
                         "another peer id uses it" if current else "the peer was replaced or removed")
                return
            agent = self._live_agent()
            if p.table is not None:
                self._quietly(p.table.handle.release, f"releasing the page table of peer {p.name!r}")
                p.table = None
            if not p.unloaded:
                self._quietly(lambda: agent.remove_remote_agent(p.agent), f"unloading the agent of peer {p.name!r}")
            try:
                agent.add_remote_agent(p.metadata)
                p.table = self._prep(p.agent, p.region_list)
            except self._errors as exc:
                # NIXL connects as it loads: a peer that is stopped or busy now may answer later (a process
                # resumed after SIGSTOP), so its next write tries again rather than failing for good.
                p.unloaded = True
                log.warning("nixl: loading the agent of peer %r again failed: %r; its next write tries again",
                            p.name, exc)
                return
            p.unloaded = False
        log.info("nixl: loaded the agent of peer %r again after its endpoint failed; the next write reconnects", p.name)
