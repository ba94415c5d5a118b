"""What the TP ranks of one server say to each other: lock-step control over a gloo group.

Rank 0 owns the server's front socket. Every loop iteration it broadcasts what
arrived; every rank then takes the same decisions (same allocators, same
order), and they agree on kvbridge's per-rank state by min-reducing
``poll()`` values, whose numeric order is there for exactly this. Messages
are JSON in uint8 tensors.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["Control"]


class Control:
    """Collectives of one server's ranks (no-ops at TP 1)."""

    def __init__(self, rank: int, size: int, group: Any = None) -> None:
        self.rank, self.size, self.group = rank, size, group

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if self.size == 1:
            return obj
        data = json.dumps(obj).encode() if self.rank == 0 else b""
        n = torch.tensor([len(data)], dtype=torch.int64)
        dist.broadcast(n, 0, group=self.group)
        if self.rank == 0:
            buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        else:
            buf = torch.empty(int(n), dtype=torch.uint8)
        dist.broadcast(buf, 0, group=self.group)
        return json.loads(bytes(buf.numpy()).decode())

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order, on every rank."""
        if self.size == 1:
            return [obj]
        data = json.dumps(obj).encode()
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]
        dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64), group=self.group)
        longest = max(int(s) for s in sizes)
        mine = torch.zeros(longest, dtype=torch.uint8)
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else mine[:0]
        bufs = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.size)]
        dist.all_gather(bufs, mine, group=self.group)
        return [json.loads(bytes(b[: int(s)].numpy()).decode()) for b, s in zip(bufs, sizes)]

    def min(self, values: list[int]) -> list[int]:
        """Element-wise minimum over the ranks (e.g. ``poll()`` states: FAILED anywhere wins)."""
        if self.size == 1 or not values:
            return values
        t = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return [int(v) for v in t]

    def max(self, values: list[float]) -> list[float]:
        """Element-wise maximum over the ranks."""
        if self.size == 1 or not values:
            return values
        t = -torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return [-float(v) for v in t]

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier(group=self.group)
