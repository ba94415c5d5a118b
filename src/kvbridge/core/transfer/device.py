"""The seam through which staging copies GPU memory: allocation, gather and scatter on a device.

Host staging copies with numpy (:mod:`kvbridge.core.planning.stage_index`); a window of GPU
pages needs a kernel, and core imports no torch. So the device half comes from
:data:`DEVICE_MODULE`, imported by name only when a rank would stage GPU memory
(``SessionConfig.staging`` auto or on, and GPU regions on a lane that reaches other
hosts: ``Transport.register``), as the checksum's ``DEVICE_MODULE``
(:mod:`kvbridge.core.sessions.wmix`) is. The module provides the functions of
:class:`DeviceCopy`: the copies take a window as unit runs
(:class:`~kvbridge.core.planning.stage_index.UnitRun`: a region's base, a unit and
each unit's offset in units, so the copy is an indexed copy over rows of the region)
where the window is such runs (a decode scatter always, a prefill gather of pages
of a pool), or as piece addresses and sizes (a gather of anything else).
:mod:`kvbridge.staging_torch` is the one shipped (torch's indexed copies, the
``cuda_ipc`` plugin's Triton kernel), :mod:`kvbridge.testing.host_device` a numpy
stand-in the CPU tests put in its place.

Every call returns once the copy is complete on the device: a gathered slice is read
by the engine right after, and a scattered window's room may reach SUCCESS right after.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from ..description.layout import Region
from ..planning.regions import RegionTable
from ..planning.stage_index import UnitRun

__all__ = ["DEVICE_MODULE", "FUNCTIONS", "Buffer", "DeviceCopy", "OnDevice", "load"]

log = logging.getLogger(__name__)

#: The module copying GPU memory for staging: outside core, imported on first use.
DEVICE_MODULE = "kvbridge.staging_torch"
#: What it provides (:class:`DeviceCopy`).
FUNCTIONS = ("alloc", "gather", "gather_units", "scatter_units")

IntArray = npt.NDArray[np.int64]


class DeviceCopy(Protocol):
    """What :data:`DEVICE_MODULE` provides (module-level functions)."""

    def alloc(self, nbytes: int, device: int) -> tuple[int, Any]:
        """``nbytes`` of zeroed memory on GPU ``device``: its address, and an object keeping it alive."""

    def gather(self, src: IntArray, nbytes: IntArray, slice_addr: int, device: int) -> None:
        """Copy the pieces at ``src`` (``nbytes`` each) back to back to ``slice_addr``, on GPU ``device``."""

    def gather_units(self, runs: Sequence[UnitRun], slice_addr: int, device: int) -> None:
        """Copy each run's units into the slice at ``slice_addr`` (from byte ``start``), on GPU ``device``."""

    def scatter_units(self, slice_addr: int, runs: Sequence[UnitRun], device: int) -> None:
        """Copy each run's units from the slice at ``slice_addr`` (from byte ``start``) into place, on GPU ``device``."""


@dataclass(frozen=True)
class OnDevice:
    """Where a staging buffer lives: the copy functions and the GPU."""

    copy: DeviceCopy
    index: int


class Buffer:
    """A staging or landing buffer of ``count`` slices in host memory (zeroed, so its pages are mapped before
    an engine registers, i.e. pins, them) or on ``device``'s GPU, as the registered ``Region`` ``name``; and
    the registered regions of that memory (``regions``, and ``table`` of them: where gathers read from or
    scatters write to)."""

    def __init__(self, name: str, count: int, slice_bytes: int, regions: Sequence[Region],
                 device: OnDevice | None) -> None:
        nbytes = count * slice_bytes
        self.host: npt.NDArray[np.uint8] | None = None
        if device is None:
            self.host = np.zeros(nbytes, np.uint8)
            addr, self.keep = self.host.ctypes.data, None
            self.regions = [r for r in regions if r.mem == "dram"]
        else:
            addr, self.keep = device.copy.alloc(nbytes, device.index)  # what holds the device memory
            self.regions = [r for r in regions if r.mem == "vram" and r.device == device.index]
        self.table = RegionTable(self.regions)
        self.region = Region(name=name, addr=addr, nbytes=nbytes, stride=slice_bytes, role="state",
                             index_space="kvbridge_staging", mem="dram" if device is None else "vram",
                             device=0 if device is None else device.index)


def load() -> DeviceCopy | None:
    """:data:`DEVICE_MODULE`, or None (logged, saying why) when it cannot be imported here: GPU windows
    are then written as planned, one descriptor per piece."""
    try:
        module: Any = importlib.import_module(DEVICE_MODULE)
        if not all(callable(getattr(module, name, None)) for name in FUNCTIONS):
            raise ImportError(f"{DEVICE_MODULE} lacks one of {', '.join(FUNCTIONS)}")
    except Exception as exc:  # ImportError (no torch or Triton), or torch failing to load its libraries
        log.info("staging: GPU windows are written as planned: %s cannot be used (%s: %s)",
                 DEVICE_MODULE, type(exc).__name__, exc)
        return None
    copy: DeviceCopy = module
    return copy
