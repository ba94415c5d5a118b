"""What a conformance test needs from a backend, read from its registration record.

A test names its needs with :func:`requires`; a backend whose
:class:`~kvbridge.core.description.records.BackendCapabilities` do not declare one is
skipped with a reason naming the missing capability. Capabilities are never
inferred: a backend that declares one and then fails the test fails.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from kvbridge.core.description.records import BackendCapabilities

__all__ = ["REQUIREMENTS", "Requirement", "requires", "unmet"]

F = TypeVar("F", bound=Callable[..., Any])

#: The attribute :func:`requires` sets on a test function.
ATTRIBUTE = "_kvbridge_requires"


@dataclass(frozen=True)
class Requirement:
    name: str
    what: str  # as a skip reason names it
    met: Callable[[BackendCapabilities], bool]
    #: True: a capability the backend declares; False: a property of this machine.
    declared: bool = True
    field: str | None = None  # the BackendCapabilities field a skip quotes


def _cuda_device() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return bool(torch.cuda.is_available() and torch.cuda.device_count() > 0)


REQUIREMENTS: dict[str, Requirement] = {
    r.name: r
    for r in (
        Requirement("vram", "memory_kinds containing 'vram'", lambda c: "vram" in c.memory_kinds, field="memory_kinds"),
        Requirement("dram", "memory_kinds containing 'dram'", lambda c: "dram" in c.memory_kinds, field="memory_kinds"),
        Requirement("one_sided", "one_sided=True", lambda c: c.one_sided, field="one_sided"),
        Requirement("native_notifications", "native_notifications=True", lambda c: c.native_notifications,
                    field="native_notifications"),
        Requirement("cuda_device", "a CUDA device visible to torch", lambda c: _cuda_device(), declared=False),
    )
}


def requires(*names: str) -> Callable[[F], F]:
    """Mark a conformance test as needing the named capabilities (keys of :data:`REQUIREMENTS`)."""
    unknown = [n for n in names if n not in REQUIREMENTS]
    if unknown:
        raise ValueError(f"unknown requirement(s) {unknown}; known: {', '.join(sorted(REQUIREMENTS))}")

    def mark(fn: F) -> F:
        setattr(fn, ATTRIBUTE, (*getattr(fn, ATTRIBUTE, ()), *names))
        return fn

    return mark


def unmet(fn: Callable[..., Any], backend: str, caps: BackendCapabilities) -> str | None:
    """Why ``fn`` cannot run against ``backend``: the first unmet requirement, or None.

    Declared capabilities are checked before machine properties, so a skip
    names what the backend lacks even on a machine that lacks more.
    """
    needed = [REQUIREMENTS[n] for n in getattr(fn, ATTRIBUTE, ())]
    for req in sorted(needed, key=lambda r: not r.declared):
        if req.met(caps):
            continue
        if req.declared:
            value = getattr(caps, req.field) if req.field else None
            return (f"needs capability {req.what}; backend {backend!r} declares "
                    f"{req.field}={value!r} in its BackendCapabilities")
        return f"needs {req.what}; this machine has none"
    return None
