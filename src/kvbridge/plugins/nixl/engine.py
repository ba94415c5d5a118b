"""NIXL itself: which wheel, the environment it needs before import, its errors, an agent.

Behaviour this module is built around (docs/engines.md, NIXL):

- **Exit crash.** A process that created a UCX-backed agent dies with SIGSEGV
  at interpreter exit (UCX's ``ib`` modules pull in a ``libnl-route`` whose
  destructor crashes in ``_dl_fini``). ``UCX_MODULES=^ib`` is therefore set,
  unless the user set it, before NIXL is first imported; on hosts with RDMA
  NICs, set ``UCX_MODULES`` yourself to keep the ``ib`` transports.
- **Logging.** NIXL's Python logger prints INFO lines (one per agent) to
  *stdout*, which belongs to the host (the e2e drivers print results there).
  Unless the user set ``NIXL_LOG_LEVEL``, it is defaulted to ``WARN`` and the
  ``nixl`` logger is lowered to WARNING, also when NIXL was imported earlier.
- **Idle CPU.** ``nixl_agent`` hard-codes ``pthrDelay=0``, so the progress
  thread polls with a zero timeout and spins a core. The agent is built with
  a delay of ``progress_delay_us`` (default 1000) instead: docs/engines.md
  measured 0.03 instead of 1.0 core idle and higher bandwidth on a 2-core box.
- **Thread safety.** Core writes to different peers from different threads
  and adds or removes peers from its I/O thread, so the agent is created with
  ``NIXL_THREAD_SYNC_STRICT``.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import re
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvbridge.core.control.auth import is_loopback

if TYPE_CHECKING:
    from nixl_cu12 import nixl_agent  # or nixl_cu13: same API

__all__ = ["engine_env", "engine_module", "error_hint", "make_agent", "mem_type", "nixl_errors", "quiet_nixl_logger",
           "torch_cuda"]

log = logging.getLogger(__name__)


_agent_lock = threading.Lock()


def engine_env(host: str) -> bool:
    """Environment NIXL must see before it is first imported; values the user set win.

    Returns whether the user chose NIXL's log level.
    """
    # UCX listens on every interface unless told otherwise; a loopback host keeps it on `lo`.
    if "UCX_NET_DEVICES" not in os.environ:
        if is_loopback(host):
            os.environ["UCX_NET_DEVICES"] = "lo"
        else:
            log.warning("nixl: UCX_NET_DEVICES is not set, so UCX listens on every interface, not only %s's; "
                        "set it to that interface (docs/security.md)", host)
    # Without this every process that created an agent exits with SIGSEGV (see the module docstring).
    os.environ.setdefault("UCX_MODULES", "^ib")
    # NIXL's Python logger writes INFO lines to stdout, which belongs to the host.
    user_level = "NIXL_LOG_LEVEL" in os.environ
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    return user_level


def quiet_nixl_logger() -> None:
    """Lower NIXL's Python logger to WARNING even if something imported NIXL before us."""
    logging.getLogger("nixl").setLevel(logging.WARNING)


def engine_module() -> str:
    """``nixl_cu12`` or ``nixl_cu13``: the wheel matching torch's CUDA major, else whichever is installed."""
    names = [n for n in ("nixl_cu12", "nixl_cu13") if importlib.util.find_spec(n) is not None]
    cuda = torch_cuda()
    wanted = f"nixl_cu{cuda.split('.')[0]}" if cuda else ""
    return wanted if wanted in names else (names[0] if names else "nixl_cu12")


_TORCH_CUDA = re.compile(r"^cuda\s*(?::[^=\n]*)?=\s*['\"]([^'\"]*)['\"]", re.M)


def torch_cuda() -> str:
    """The CUDA version torch was built for ('' without torch, or for a CPU build).

    Read from ``torch/version.py`` without importing torch, unless something already
    did: importing it costs 2-3 s of CPU and 230 MB in every process that makes an
    agent, which is most of a small process's start-up.
    """
    torch = sys.modules.get("torch")
    if torch is not None:
        return getattr(getattr(torch, "version", None), "cuda", None) or ""
    spec = importlib.util.find_spec("torch")
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        try:
            text = (Path(folder) / "version.py").read_text()
        except OSError:
            continue
        found = _TORCH_CUDA.search(text)
        return found.group(1) if found else ""
    return ""


def nixl_errors() -> tuple[type[BaseException], ...]:
    """NIXL's exception classes (they share no base class beyond ``Exception``)."""
    bindings = importlib.import_module(f"{engine_module()}._bindings")
    return tuple(
        v for k, v in vars(bindings).items()
        if k.startswith("nixl") and k.endswith("Error") and isinstance(v, type) and issubclass(v, BaseException)
    )


def make_agent(name: str, progress_delay_us: int, backend_params: dict[str, str]) -> nixl_agent:
    """An agent with one UCX backend whose progress thread waits ``progress_delay_us`` per poll.

    ``nixl_agent.__init__`` sets ``pthrDelay = 0`` on the binding config and
    offers no argument for it, so for the duration of this one constructor
    call the binding's ``nixlAgent`` is wrapped to override the delay, then
    restored. The lock keeps concurrent constructions in kvbridge apart.
    """
    engine = importlib.import_module(engine_module())
    nixl_agent, nixl_agent_config, nixl_thread_sync_t = engine.nixl_agent, engine.nixl_agent_config, engine.nixl_thread_sync_t

    bindings = sys.modules[nixl_agent.__module__].nixlBind
    config = nixl_agent_config(backends=[], sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
    with _agent_lock:
        original = bindings.nixlAgent

        def with_delay(agent_name: str, cfg: Any) -> Any:
            cfg.pthrDelay = progress_delay_us
            return original(agent_name, cfg)

        bindings.nixlAgent = with_delay
        try:
            agent = nixl_agent(name, config)
        finally:
            bindings.nixlAgent = original
    agent.create_backend("UCX", backend_params)
    return agent


def mem_type(vram: bool) -> str:
    """NIXL's name of a memory kind."""
    return "VRAM" if vram else "DRAM"


def error_hint(error: str) -> str:
    """What a NIXL exception's class name usually means, for an error message."""
    if error == "nixlRemoteDisconnectError":
        return "The peer's process died or closed its agent."
    if error == "nixlNotFoundError":
        return "A descriptor lies outside the memory either side registered."
    return "Bytes may have partly landed."
