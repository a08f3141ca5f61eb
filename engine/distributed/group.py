"""The tensor-parallel rank group: collectives over ``torch.distributed``.

One process per rank. On the CPU every collective runs on a gloo group; on CUDA tensors go through NCCL and
Python objects (the scheduler's per-iteration work list, sampled tokens) through a gloo group beside it, as
upstream does. ``single_rank()`` is the group of a worker without TP: every collective is the identity and
nothing touches ``torch.distributed``.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

# How long a collective may wait for a peer. A dead peer closes its sockets, so a collective fails at once
# (a worker never waits this long for a crashed rank); this bounds a hung one.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)


@dataclass
class TPGroup:
    """Rank ``rank`` of ``size``; ``device_group`` carries tensors, ``cpu_group`` Python objects (both None
    for one rank)."""

    rank: int = 0
    size: int = 1
    device_group: Any = None
    cpu_group: Any = None
    backend: str = "gloo"

    def close(self) -> None:
        """Leave the group (``destroy_process_group``): its gloo threads stop here rather than at interpreter
        exit, where a still-joinable one aborts the process (SIGABRT, "terminate called without an active
        exception"). Call it once every rank's last collective has returned; a no-op for one rank."""
        if self.size > 1 and dist.is_initialized():
            dist.destroy_process_group()

    @property
    def is_leader(self) -> bool:
        """Rank 0: the one with HTTP, the tokenizer and the request inbox."""
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place where possible; returns the sum (same shape and dtype). On gloo
        a half-precision tensor is summed in float32 and cast back."""
        if self.size == 1:
            return x
        if self.backend == "gloo" and x.dtype != torch.float32:
            wide = x.float()
            dist.all_reduce(wide, group=self.device_group)
            return wide.to(x.dtype)
        dist.all_reduce(x, group=self.device_group)
        return x

    def row_parallel(self, y: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """A row-parallel linear layer's output: its partial ``(T, out)`` summed over the ranks, then its
        ``bias`` ``(out,)`` (held whole by every rank) added once. One rank: ``y`` as it is (the layer added
        its bias itself)."""
        if self.size == 1:
            return y
        y = self.all_reduce(y)
        return y if bias is None else y + bias

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's ``x`` ``(..., n)`` along the last dim, rank order: ``(..., size * n)``."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.device_group)
        return torch.cat(parts, dim=-1)

    def broadcast_object(self, obj: object = None) -> object:
        """Rank 0's ``obj`` on every rank (picklable; the others pass anything)."""
        if self.size == 1:
            return obj
        box = [obj if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=self.cpu_group)
        return box[0]

    def all_min(self, values: list[int]) -> list[int]:
        """Element-wise minimum of ``values`` over the ranks (every rank passes a list of the same length)."""
        if self.size == 1:
            return list(values)
        t = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return t.tolist()


def single_rank() -> TPGroup:
    """The group of a worker without tensor parallelism."""
    return TPGroup()


def init_tp_group(rank: int, size: int, init_method: str, device: str = "cpu") -> TPGroup:
    """Join the ``size``-rank group at ``init_method`` (``tcp://host:port``) as ``rank``; blocks until every
    rank has joined (or ``COLLECTIVE_TIMEOUT``). ``device`` "cpu": gloo for everything; "cuda": NCCL for
    tensors (this process must already have picked its GPU) plus a gloo group for objects."""
    if size == 1:
        return single_rank()
    backend = "nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(
        backend=backend, init_method=init_method, rank=rank, world_size=size, timeout=COLLECTIVE_TIMEOUT
    )
    world = dist.group.WORLD
    cpu_group = world if backend == "gloo" else dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT)
    return TPGroup(rank, size, world, cpu_group, backend)
