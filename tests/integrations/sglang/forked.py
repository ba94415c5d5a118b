"""Run a function in a forked child of the test process (SGLang already imported: no 25 s import per child)."""

from __future__ import annotations

import multiprocessing
import os
import traceback
from collections.abc import Callable, Mapping
from typing import Any


def _child(fn: Callable[..., Any], env: Mapping[str, str | None], args: tuple, conn: Any) -> None:
    # The parent's OpenMP worker pool (torch's CPU kernels) does not survive fork: a parallel
    # region in the child would wait for it forever. One thread: torch runs kernels inline.
    import torch

    torch.set_num_threads(1)
    for key, value in env.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    try:
        conn.send(("ok", fn(*args)))
    except BaseException:  # the parent reports it
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()
        os._exit(0)


def run(fn: Callable[..., Any], env: Mapping[str, str | None], *args: Any, timeout: float = 60) -> Any:
    """``fn(*args)``'s result in a forked child with ``env`` applied (None removes a variable)."""
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(fn, env, args, child))
    proc.start()
    child.close()
    try:
        if not parent.poll(timeout):
            raise TimeoutError(f"{fn.__name__} did not finish in a forked child within {timeout}s")
        status, value = parent.recv()
    finally:
        proc.join(5)
        if proc.is_alive():
            proc.kill()
    if status == "error":
        raise AssertionError(f"{fn.__name__} failed in a forked child:\n{value}")
    return value
