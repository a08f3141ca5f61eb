"""What loading a cached prefix costs against recomputing it, measured from the worker's own traffic.

Three operations, each observed once per operation with its size in tokens and its wall time in seconds:

- ``load_back``: one L2 -> L1 load (all layers, merged as the controller runs it), from the load thread;
- ``prefetch``: one L3 -> L2 prefetch that brought pages in (hit query plus every read batch; the tokens it
  completed), from the prefetch thread;
- ``prefill``: one prefill forward pass with no load-back in it (the batch's new tokens), from the
  scheduler thread.

The cost probe (``POST /hicache/costs/probe``, engine/scheduler/costs_probe.py) observes the same three
operations on demand, for a worker whose traffic is thin; its observations join these sums.

Each goes into the size bucket of its tokens (``SIZE_BUCKETS``, upper bounds, ``le`` semantics; the last is
``+Inf``), where three numbers grow: operations, tokens and seconds. So memory is fixed (3 operations x 14
buckets x 3 numbers) however much traffic runs, an observation is a bisect and three additions under a lock,
and nothing is lost between two reads: the worker exports the sums as counters
(``sglang:kv_cost_{operations,tokens,seconds}_total{operation,size}``, engine/server/metrics.py) and a
reader takes throughput per bucket as tokens / seconds over any window. The control plane's crossover
(controlplane/capacity/crossover.py, docs/capacity.md) is computed from these counters.
"""

from __future__ import annotations

import bisect
import threading

COST_OPERATIONS = ("load_back", "prefetch", "prefill")
"""``load_back`` (L2 -> L1), ``prefetch`` (L3 -> L2), ``prefill`` (recompute): the ``operation`` label."""

SIZE_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
"""Upper bounds of the size buckets in tokens (a size lands in the first bound >= it; larger: ``+Inf``)."""

SIZE_LABELS = (*(str(b) for b in SIZE_BUCKETS), "+Inf")
"""The ``size`` label of each bucket, in bucket order."""


class TransferCosts:
    """Per operation and size bucket: operations, tokens and seconds (sums since start). Thread-safe."""

    def __init__(self) -> None:
        n = len(SIZE_LABELS)
        self._lock = threading.Lock()
        self._count = {op: [0] * n for op in COST_OPERATIONS}
        self._tokens = {op: [0] * n for op in COST_OPERATIONS}
        self._seconds = {op: [0.0] * n for op in COST_OPERATIONS}
        self._version = 0  # observations so far: a snapshot is rebuilt only after a new one
        self._snapshot: tuple[int, dict[str, list[dict]]] | None = None

    def observe(self, operation: str, tokens: int, seconds: float) -> None:
        """Count one ``operation`` (a ``COST_OPERATIONS`` name; ``KeyError`` otherwise) that moved or
        computed ``tokens`` tokens in ``seconds`` wall seconds. Nothing is counted for ``tokens`` <= 0 or a
        negative time."""
        if tokens <= 0 or seconds < 0:
            return
        i = bisect.bisect_left(SIZE_BUCKETS, tokens)
        count, total, secs = self._count[operation], self._tokens[operation], self._seconds[operation]
        with self._lock:
            count[i] += 1
            total[i] += tokens
            secs[i] += seconds
            self._version += 1

    def snapshot(self) -> dict[str, list[dict]]:
        """``{operation: [{"size": label, "count", "tokens", "seconds"}, ...]}``: the buckets observed at
        least once, in size order (an operation never observed has an empty list). The scheduler publishes
        one every iteration, so it is built again only after a new observation: callers must not change
        it."""
        with self._lock:
            if self._snapshot is not None and self._snapshot[0] == self._version:
                return self._snapshot[1]
            out = {
                op: [
                    {
                        "size": SIZE_LABELS[i],
                        "count": self._count[op][i],
                        "tokens": self._tokens[op][i],
                        "seconds": self._seconds[op][i],
                    }
                    for i in range(len(SIZE_LABELS))
                    if self._count[op][i]
                ]
                for op in COST_OPERATIONS
            }
            self._snapshot = (self._version, out)
            return out
