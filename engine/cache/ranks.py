"""Cross-rank agreement for cache decisions (docs/upstream.md H3).

Every decision that must be identical on all tensor-parallel ranks (write/load ack counts, L3 hit
length, prefetch termination and committed length, control-queue drains) goes through one function
``reduce(op, values) -> values`` with ``op`` in ``"min"``/``"max"`` over a list of ints. One rank:
identity. Several: an all-reduce on a ``torch.distributed`` gloo group.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

Reduce = Callable[[str, list[int]], list[int]]


def identity_reduce(op: str, values: list[int]) -> list[int]:
    """Single rank: the values themselves."""
    if op not in ("min", "max"):
        raise ValueError(f"reduce op must be 'min' or 'max', got {op!r}")
    return list(values)


def make_reduce(tp_size: int, group=None) -> Reduce:
    """``identity_reduce`` for one rank; otherwise a gloo all-reduce over ``group``.

    With ``tp_size > 1`` and no ``group``, a new gloo group over all ranks is created (every rank must
    call this in the same order, as with any ``torch.distributed`` group). Raises ``RuntimeError`` when
    ``torch.distributed`` is not initialised.
    """
    if tp_size <= 1:
        return identity_reduce
    if not dist.is_initialized():
        raise RuntimeError("tp_size > 1 needs torch.distributed initialised (gloo) before the cache")
    if group is None:
        group = dist.new_group(backend="gloo")

    def reduce(op: str, values: list[int]) -> list[int]:
        if op not in ("min", "max"):
            raise ValueError(f"reduce op must be 'min' or 'max', got {op!r}")
        tensor = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN if op == "min" else dist.ReduceOp.MAX, group=group)
        return tensor.tolist()

    return reduce
