"""Demo processes end with the ``kvbridge demo`` that started them, even one killed with SIGKILL.

``kvbridge demo`` starts its servers and router in their own sessions (so it
can stop each with its TP ranks); a launcher killed outright could not stop
them, and they would serve on, holding ports, forever. Each asks the kernel
for SIGTERM when its parent dies (Linux ``PR_SET_PDEATHSIG``), which ends it
the same way the demo's own stop does.
"""

from __future__ import annotations

import ctypes
import os
import signal

#: The launcher's pid, in the environment of the processes it starts.
ENV = "KVBRIDGE_DEMO_PARENT"
PR_SET_PDEATHSIG = 1


def follow_parent() -> None:
    """Get SIGTERM when the launcher named in :data:`ENV` dies (no-op without it, or off Linux)."""
    parent = os.environ.pop(ENV, None)  # popped: the TP ranks this process starts follow it, not the launcher
    if not parent:
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
            return
    except (OSError, AttributeError):
        return
    if os.getppid() != int(parent):  # the launcher died before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)
