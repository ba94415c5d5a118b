"""The fixture contract for testing a kvbridge backend end to end (shipped in the wheel).

:class:`BackendHarness` is what a test class inherits to get real prefill and
decode processes on a named backend. The class sets::

    backend = "mytransport"        # required: the name its BackendSpec registers
    backend_options = {}           # optional: SessionConfig.backend_options of every manager
    timeout_scale = 1.0            # optional: multiplies every deadline and wait (not heartbeats)
    companion = "nixl"             # optional: for a backend moving GPU memory only, the lane after it
                                   # in hybrid-model runs, for host memory and GPU -> host

A class that sets no backend, or names one that is not installed or whose
engine is missing, fails every test with a message saying what to set or
install. Tests marked with :func:`~kvbridge.testing.requirements.requires`
are skipped, naming the capability, when the backend's registration does not
declare it.

Prefill and decode always run in different processes: one side is often the
pytest process (a PrefillManager with its BootstrapServer, or a DecodeManager)
and the other a driver from :mod:`kvbridge.testing.e2e` or
:mod:`kvbridge.testing.hybrid`. Hostile peers are bare zmq DEALER sockets
speaking the control protocol by hand. Every wait is bounded and every child
process is killed at teardown.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, ClassVar

import msgspec
import numpy as np
import pytest
import zmq

from kvbridge.core.transfer.backend import host_id
from kvbridge.core.control import protocol as P
from kvbridge.core.control.auth import MAGIC, PLAIN, Auth, auth_for
from kvbridge.core.control.bootstrap import BootstrapServer
from kvbridge.core.control.channel import Channel
from kvbridge.core.description.layout import KVArgs
from kvbridge.core.description.plugins import PluginError, get_registry
from kvbridge.core.description.records import BackendCapabilities, BackendSpec
from kvbridge.core.sessions.session import DecodeManager, Poll, PrefillManager, Receiver, Sender, SessionConfig
from kvbridge.core.transfer.transport import open_transport
from kvbridge.testing.e2e import SENTINEL, Pools, Request, Scenario, meta_row_for, prefill_pools, schedule, serve
from kvbridge.testing.hybrid import Spec
from kvbridge.testing.memory import state as process_state
from kvbridge.testing.requirements import unmet

__all__ = [
    "BASE",
    "BackendHarness",
    "Child",
    "LocalDecode",
    "LocalPrefill",
    "RawClient",
    "all_sentinel",
    "all_succeeded",
    "check_contract",
    "finished",
    "send_all",
    "snapshot",
    "unchanged",
    "wait_until",
]

SLACK = 1.0  # seconds allowed past a configured deadline (tick granularity, a loaded 2-core box)
START_WAIT = 30.0  # a driver process printing its bootstrap address
EXIT_WAIT = 30.0  # a driver process finishing its schedule and closing its engine
REPLY_WAIT = 3.0  # one control-message round trip

#: Small everything: two layers of 64-byte pages, short timeouts, fast heartbeats.
BASE = Scenario(
    backend="?",
    layers=2,
    page_nbytes=64,
    prefill_pages=1024,
    decode_pages=1024,
    requests=8,
    max_pages=32,
    concurrency=8,
    max_chunks=3,
    bootstrap_timeout=5.0,
    waiting_timeout=30.0,
    transfer_timeout=5.0,
    heartbeat_interval=0.2,
    heartbeat_timeout=1.5,
    deadline=30.0,
)


# -- the contract ----------------------------------------------------------------------------
def check_contract(cls: type) -> BackendSpec:
    """The registration of ``cls.backend``; fails (never skips) saying what to set or install."""
    where = f"{cls.__module__}.{cls.__qualname__}"
    registry = get_registry()
    installed = ", ".join(sorted(registry.backends)) or "none"
    name = getattr(cls, "backend", None)
    if not isinstance(name, str) or not name:
        pytest.fail(
            f"{where}: set the class attribute `backend = \"<name>\"` to the name your plugin's "
            f"BackendSpec registers (installed backends: {installed}; `kvbridge plugins` lists them)",
            pytrace=False,
        )
    try:
        spec = registry.backend_spec(name)
        if not registry.backend_available(name):
            registry.load_backend(name)  # raises, saying which package installs the engine
    except PluginError as exc:
        pytest.fail(f"{where}: backend = {name!r} cannot be used: {exc}", pytrace=False)
    options = getattr(cls, "backend_options", {})
    if not isinstance(options, Mapping) or not all(isinstance(k, str) and isinstance(v, str) for k, v in options.items()):
        pytest.fail(f"{where}: backend_options must be a dict of str to str (SessionConfig.backend_options), "
                    f"got {options!r}", pytrace=False)
    scale = getattr(cls, "timeout_scale", 1.0)
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or scale <= 0:
        pytest.fail(f"{where}: timeout_scale must be a number > 0, got {scale!r}", pytrace=False)
    return spec


# -- driver processes --------------------------------------------------------------------------
class Child:
    """A driver process; its output goes to files so a full pipe never blocks it.

    ``prefix`` runs it under another command (``ip netns exec NAME``); ``env`` adds to its environment."""

    def __init__(self, role: str, spec: Scenario | Spec, stem: Path, bootstrap: str | None, scale: float,
                 module: str | None = None, extra: Sequence[str] = (), prefix: Sequence[str] = (),
                 env: Mapping[str, str] | None = None) -> None:
        self.role = role
        self.scale = scale
        self.out_path, self.err_path = stem.with_suffix(".out"), stem.with_suffix(".err")
        default, flag = ("kvbridge.testing.hybrid", "--spec") if isinstance(spec, Spec) else ("kvbridge.testing.e2e", "--scenario")
        cmd = [*prefix, sys.executable, "-X", "faulthandler", "-m", module or default, role, flag, msgspec.json.encode(spec).decode(), *extra]
        if bootstrap is not None:
            cmd += ["--bootstrap", bootstrap]
        with open(self.out_path, "wb") as out, open(self.err_path, "wb") as err:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=err, env={**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"})

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stdout(self) -> str:
        return self.out_path.read_text(errors="replace")

    def stderr(self) -> str:
        return self.err_path.read_text(errors="replace")

    def first_line(self, word: str) -> list[str]:
        """The words after ``word`` on the first line the driver prints, which must start with it."""
        wait = START_WAIT * self.scale
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            line, newline, _ = self.stdout().partition("\n")
            if newline:
                assert line.startswith(f"{word} "), f"{self.role} printed {line!r} first"
                return line.split()[1:]
            if self.proc.poll() is not None:
                pytest.fail(f"{self.role} exited with {self.proc.returncode} before printing {word}:\n{self.stderr()[-3000:]}")
            time.sleep(0.02)
        pytest.fail(f"{self.role} printed no {word} line within {wait}s")

    @cached_property
    def bootstrap(self) -> str:
        """The ``host:port`` a prefill-side driver prints first."""
        return self.first_line("BOOTSTRAP")[0]

    def finish(self, timeout: float | None = None) -> tuple[int, dict[str, Any] | None]:
        """Wait for the exit; return the exit code and the last JSON line printed."""
        timeout = EXIT_WAIT * self.scale if timeout is None else timeout
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{self.role} did not exit within {timeout}s; stderr tail:\n{self.stderr()[-3000:]}")
        lines = [line for line in self.stdout().splitlines() if line.startswith("{")]
        return rc, json.loads(lines[-1]) if lines else None

    def freeze(self) -> None:
        """SIGSTOP the process and wait (bounded) until the kernel shows it stopped: the signal is asynchronous."""
        os.kill(self.proc.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 5.0
        while process_state(self.proc.pid) not in ("T", None) and time.monotonic() < deadline:
            time.sleep(0.001)

    def thaw(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)  # harmless unless frozen
            self.proc.kill()
        self.proc.wait(10)


@dataclass
class LocalPrefill:
    pools: Pools
    server: BootstrapServer
    mgr: PrefillManager

    @property
    def address(self) -> str:
        return self.server.address


@dataclass
class LocalDecode:
    pools: Pools
    mgr: DecodeManager


class RawClient:
    """A bare zmq DEALER speaking the control protocol by hand: no kvbridge session code.

    It seals what it sends with ``auth`` (the process's secret by default),
    as any holder of the secret could; ``seal=False`` sends bytes as they are.
    """

    def __init__(self, address: str, name: str, auth: Auth | None = None) -> None:
        self.identity = f"{name}-{uuid.uuid4().hex[:8]}"
        self.chan = Channel(zmq.Context.instance(), zmq.DEALER, auth or auth_for(), endpoint="decode",
                            max_bytes=1 << 30, to=address.encode(), identity=self.identity.encode())
        self.sock = self.chan.sock
        self.chan.connect(address)
        self.engine: Any = None

    def send_raw(self, payload: bytes, seal: bool = True) -> None:
        if seal:
            self.chan.send(payload)
        else:
            self.sock.send(payload)

    def reply(self, wait: float = REPLY_WAIT) -> P.Message:
        """The next reply: opened if sealed, decoded as it is if not (a refusal to an unauthenticated sender)."""
        if not self.sock.poll(int(wait * 1000), zmq.POLLIN):
            pytest.fail(f"no reply within {wait}s")
        frame = self.sock.recv()
        if frame[:4] not in (MAGIC, PLAIN):
            return P.decode(frame)
        got = self.chan.receive([frame])
        assert got is not None, f"a sealed reply was refused: {self.chan.last_refusal}"
        return got[1]

    def ask_raw(self, payload: bytes, seal: bool = True) -> P.Message:
        self.send_raw(payload, seal)
        return self.reply()

    def ask(self, msg: P.Message, seal: bool = True) -> P.Message:
        return self.ask_raw(P.encode(msg), seal)

    def send(self, msg: P.Message, seal: bool = True) -> None:
        self.send_raw(P.encode(msg), seal)

    def engine_metadata(self, pools: Pools, backend: str, options: Mapping[str, str] | None = None) -> dict[str, bytes]:
        """Real engine metadata for the memory ``pools`` describe (kept alive with the client); nothing is ever written to it."""
        self.pools = pools
        self.engine = open_transport(backend, host="127.0.0.1", name=self.identity,
                                     transfer_timeout=BASE.transfer_timeout, options=dict(options or {}))
        self.engine.register(pools.kvargs.regions)
        meta: dict[str, bytes] = self.engine.metadata()
        return meta

    def handshake(self, pools: Pools, backend: str, options: Mapping[str, str] | None = None) -> None:
        # Real engine metadata, so the prefill's backend accepts the peer: the
        # hostility is in what this client sends afterwards.
        meta = self.engine_metadata(pools, backend, options)
        reply = self.ask(P.Hello(peer_id=self.identity, lanes=meta, host=host_id(), kvargs=pools.kvargs))
        assert isinstance(reply, P.HelloAck), reply

    def close(self) -> None:
        self.sock.close(linger=0)
        if self.engine is not None:
            self.engine.close()


# -- helpers -------------------------------------------------------------------------------------
def wait_until(condition: Callable[[], bool], timeout: float, what: str) -> float:
    """Poll ``condition`` until true; return the seconds it took, fail after ``timeout``."""
    t0 = time.monotonic()
    while not condition():
        if time.monotonic() - t0 > timeout:
            pytest.fail(f"{what}: not within {timeout}s")
        time.sleep(0.005)
    return time.monotonic() - t0


def finished(room: Sender | Receiver) -> Callable[[], bool]:
    return lambda: room.poll() in (Poll.SUCCESS, Poll.FAILED)


def send_all(sender: Sender, src_pages: list[int], chunks: list[int]) -> None:
    bounds = np.cumsum([0, *chunks])
    for c in range(len(chunks)):
        sender.send(np.asarray(src_pages[bounds[c]:bounds[c + 1]]), last=c == len(chunks) - 1)


def snapshot(pools: Pools) -> list[np.ndarray]:
    return [a.copy() for a in (*pools.kv, pools.meta)]


def unchanged(pools: Pools, before: list[np.ndarray]) -> bool:
    return all(np.array_equal(a, b) for a, b in zip((*pools.kv, pools.meta), before))


def all_sentinel(pools: Pools) -> bool:
    return all((a == SENTINEL).all() for a in (*pools.kv, pools.meta))


def all_succeeded(prefill: dict[str, Any], decode: dict[str, Any]) -> None:
    """Every room of a hybrid run succeeded on both sides and every decode buffer matched."""
    for side in (prefill, decode):
        for room, states in side["rooms"].items():
            assert all(state == "SUCCESS" for state, _ in states), f"{side['role']} room {room}: {states}"
    assert decode["mismatches"] == [], decode["mismatches"][:10]


# -- the fixtures ----------------------------------------------------------------------------------
class BackendHarness:
    """Fixtures for end-to-end tests of one backend; see the module docstring for the contract."""

    backend: ClassVar[str] = ""
    backend_options: ClassVar[dict[str, str]] = {}
    timeout_scale: ClassVar[float] = 1.0
    companion: ClassVar[str] = "nixl"

    @pytest.fixture(autouse=True)
    def _kvbridge_backend_contract(self, request: pytest.FixtureRequest) -> None:
        spec = check_contract(type(self))
        reason = unmet(request.function, spec.name, spec.capabilities)
        if reason is not None:
            pytest.skip(reason)

    @property
    def capabilities(self) -> BackendCapabilities:
        return get_registry().backend_spec(self.backend).capabilities

    def scaled(self, seconds: float) -> float:
        return seconds * self.timeout_scale

    @property
    def slack(self) -> float:
        return SLACK * self.timeout_scale

    def scenario(self, **changes: Any) -> Scenario:
        """:data:`BASE` for this backend with ``changes``; transfer timeouts times ``timeout_scale``."""
        sc = msgspec.structs.replace(BASE, backend=self.backend, backend_options=dict(self.backend_options), **changes)
        k = self.timeout_scale
        return msgspec.structs.replace(sc, bootstrap_timeout=sc.bootstrap_timeout * k, waiting_timeout=sc.waiting_timeout * k,
                                       transfer_timeout=sc.transfer_timeout * k, deadline=sc.deadline * k)

    def waiting_room(self, local_prefill: Callable[..., LocalPrefill], children: Callable[..., Child], **changes: Any
                     ) -> tuple[LocalPrefill, Child, Sender, Request]:
        """One request of :meth:`scenario` (``changes`` applied): prefill in this process with its metadata
        row filled, decode a driver process; returns once the room's Sender has decode's request."""
        sc = self.scenario(**changes)
        (req,) = schedule(sc)
        prefill = local_prefill(sc)
        decode = children("decode", sc, bootstrap=prefill.address)
        prefill.pools.meta[0] = meta_row_for(req.room)
        sender = self.sender_when_asked(prefill, req.room, metadata_row=0)
        return prefill, decode, sender, req

    def sender_when_asked(self, prefill: LocalPrefill, room: int, metadata_row: int = 0) -> Sender:
        """``room``'s Sender, created once a decode driver's request for it arrived, at WAITING_FOR_INPUT.

        Created after the request, as a host whose request reached it first does: a driver's start-up
        (imports, the engine) on a loaded machine can outlast ``bootstrap_timeout``, which a sender
        created first would count from its creation (tests of that timeout create theirs on purpose)."""
        wait_until(lambda: prefill.mgr.requested(room), self.scaled(START_WAIT), f"decode's request for room {room}")
        sender = Sender(prefill.mgr, room, metadata_row=metadata_row)
        wait_until(lambda: sender.poll() >= Poll.WAITING_FOR_INPUT, self.scaled(START_WAIT), "decode's request")
        return sender

    def hybrid_spec(self, **changes: Any) -> Spec:
        """The hybrid model's run over this backend. A backend that moves GPU memory only gets the model's
        caches on the GPU and :attr:`companion` after it as a second lane for what it cannot move (host
        metadata rows; GPU -> host for decode's C4 rows): the run shows which lanes moved something."""
        if "dram" not in self.capabilities.memory_kinds:
            changes = {"device": "cuda", "backend": f"{self.backend},{self.companion}", **changes}
        return Spec(**{"backend": self.backend, "backend_options": dict(self.backend_options),
                       "timeout": 60.0 * self.timeout_scale, **changes})

    @pytest.fixture
    def children(self, tmp_path: Path) -> Iterator[Callable[..., Child]]:
        """``start(role, scenario_or_spec, bootstrap=None)`` runs a driver process, killed at teardown."""
        started: list[Child] = []

        def start(role: str, spec: Scenario | Spec, bootstrap: str | None = None) -> Child:
            child = Child(role, spec, tmp_path / f"{len(started)}-{role}", bootstrap, self.timeout_scale)
            started.append(child)
            return child

        yield start
        for child in started:
            child.kill()

    @pytest.fixture
    def local_prefill(self) -> Iterator[Callable[..., LocalPrefill]]:
        """Prefill in this process: source pools filled with the e2e pattern, a bootstrap server, a manager."""
        made: list[LocalPrefill] = []

        def make(sc: Scenario, config: SessionConfig | None = None) -> LocalPrefill:
            pools = prefill_pools(sc)
            server = BootstrapServer("127.0.0.1")
            try:
                mgr = PrefillManager(pools.kvargs, sc.backend, bootstrap=server.address, config=config or sc.session_config())
            except BaseException:
                server.close()
                raise
            made.append(LocalPrefill(pools, server, mgr))
            return made[-1]

        yield make
        for p in made:
            p.mgr.close()
            p.server.close()

    @pytest.fixture
    def local_decode(self) -> Iterator[Callable[..., LocalDecode]]:
        """Decode in this process: sentinel-filled pools and a manager (``kvargs`` overrides the description)."""
        made: list[LocalDecode] = []

        def make(sc: Scenario, config: SessionConfig | None = None, kvargs: KVArgs | None = None,
                 meta_rows: int | None = None) -> LocalDecode:
            pools = Pools(sc, sc.decode_pages, meta_rows=meta_rows or sc.concurrency)
            mgr = DecodeManager(kvargs or pools.kvargs, sc.backend, config=config or sc.session_config())
            made.append(LocalDecode(pools, mgr))
            return made[-1]

        yield make
        for d in made:
            d.mgr.close()

    @pytest.fixture
    def raw_clients(self) -> Iterator[Callable[[str, str], RawClient]]:
        made: list[RawClient] = []

        def make(address: str, name: str) -> RawClient:
            made.append(RawClient(address, name))
            return made[-1]

        yield make
        for c in made:
            c.close()

    def serve_a_fresh_decode(self, prefill: LocalPrefill, children: Callable[..., Child], sc: Scenario) -> None:
        """The in-process prefill serves ``sc`` to a new decode process, which verifies every byte."""
        decode = children("decode", sc, bootstrap=prefill.address)
        assert serve(prefill.mgr, prefill.pools, sc) == 0
        rc, result = decode.finish()
        assert rc == 0, f"decode: {result}\n{decode.stderr()[-3000:]}"
        assert result is not None and result["requests"] == sc.requests and result["failed"] == []
        assert result["mismatched_regions"] == 0
        wait_until(lambda: prefill.mgr.active_rooms() == 0, self.slack, "prefill rooms released")

    def run_hybrid(self, children: Callable[..., Child], spec: Spec) -> tuple[dict[str, Any], dict[str, Any], str]:
        """Run :mod:`kvbridge.testing.hybrid`'s two processes; return both result lines and their logs."""
        prefill = children("prefill", spec)
        decode = children("decode", spec, bootstrap=prefill.bootstrap)
        rc_d, d = decode.finish(spec.timeout + EXIT_WAIT * self.timeout_scale)
        rc_p, p = prefill.finish()
        logs = prefill.stderr() + decode.stderr()
        assert rc_d == 0 and rc_p == 0 and d is not None and p is not None, (
            f"decode exit {rc_d}: {decode.stdout()[-2000:]}\n{decode.stderr()[-3000:]}\n"
            f"prefill exit {rc_p}: {prefill.stdout()[-2000:]}\n{prefill.stderr()[-3000:]}"
        )
        return p, d, logs
