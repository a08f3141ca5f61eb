"""Traffic recording (``--record-trace``): the worker's request stream as a Mooncake-format trace.

Each finished request becomes one trace row: ``timestamp`` (ms since the epoch at arrival), ``input_length``,
``output_length`` and ``hash_ids``, one per ``BLOCK_TOKENS``-token block of the input (the last may be
partial), and ``output_hash_ids``: the ids of the blocks that hold generated tokens in the sequence the engine
caches when the request finishes (the input, then every output token but the last, whose KV is never
computed), from the first such block on. Mooncake's format has no such field; without it a replay cannot see
that a conversation's next turn repeats the previous answer, which the engine serves from its cache. When the
worker attributes misses a row also has ``misses``: ``{"causes": {cause: tokens}, "unseen": [[start, end],
...]}``, the request's ``miss_tokens_details`` causes and the prompt token ranges of its ``not_seen_here``
ones (``engine/cache/misses.py``), from which the control plane tells a fleet-wide first sighting from a
prefix another worker computed. A block's id is the first 63 bits of a SHA-256 chain over the prompt's token
ids up to the end of that block (``digest_i = sha256(digest_{i-1} || block_i tokens)``), so equal ids mean
equal prefixes on every worker of a fleet (pool traces merge), the trace stays prefix-closed, and neither
text nor token ids are kept. Rows wait in a bounded
ring (``RING_SIZE``; the oldest go first, counted in ``dropped``) until read.

``GET /recorded_trace?after=N``: ``{"next": M, "dropped": D, "block_tokens": B, "requests": [...]}``, the rows
with sequence numbers above ``N`` (the agent passes back ``next``; ``B`` is ``BLOCK_TOKENS``, which a replay
needs as its ``--block-tokens``); 404 without ``--record-trace``.
"""

from __future__ import annotations

import hashlib
import struct
import threading
from collections import deque

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from engine.cache.misses import Misses
from engine.server.http_utils import error_response

# Tokens per hash id. Mooncake's released traces use 512; a recorder this coarse hides every shared prefix
# shorter than a block (a 300-token system prompt plus document is one partial block, unique per question),
# so the what-if saw almost no reuse where the fleet measured 90%. 16 is the demo's --page-size: sharing is
# seen to within a page, as the engine caches it.
BLOCK_TOKENS = 16
RING_SIZE = 100_000

router = APIRouter()


def block_hash_ids(input_ids: list[int], block_tokens: int = BLOCK_TOKENS) -> list[int]:
    """Chained 63-bit block ids of ``input_ids`` (one per block, the last may be partial)."""
    ids, digest = [], b""
    for start in range(0, len(input_ids), block_tokens):
        block = input_ids[start : start + block_tokens]
        digest = hashlib.sha256(digest + struct.pack(f"<{len(block)}q", *block)).digest()
        ids.append(int.from_bytes(digest[:8], "little") >> 1)
    return ids


class TraceRecorder:
    """Thread-safe bounded ring of trace rows with sequence numbers starting at 1."""

    def __init__(self, ring_size: int = RING_SIZE) -> None:
        self._rows: deque[tuple[int, dict]] = deque(maxlen=ring_size)
        self._seq = 0
        self.dropped = 0
        self._lock = threading.Lock()

    def record(
        self, input_ids: list[int], output_ids: list[int], arrival_s: float, misses: Misses | None = None
    ) -> None:
        computed = block_hash_ids(input_ids + output_ids[:-1]) if len(output_ids) > 1 else []
        row = {
            "timestamp": round(arrival_s * 1000),
            "input_length": len(input_ids),
            "output_length": len(output_ids),
            "hash_ids": block_hash_ids(input_ids),
            "output_hash_ids": computed[len(input_ids) // BLOCK_TOKENS :],
        }
        if misses is not None:  # the worker's own attribution, with where its not_seen_here tokens are
            row["misses"] = {"causes": dict(misses.causes), "unseen": [list(r) for r in misses.unseen]}
        with self._lock:
            if len(self._rows) == self._rows.maxlen:
                self.dropped += 1
            self._seq += 1
            self._rows.append((self._seq, row))

    def since(self, after: int) -> dict:
        with self._lock:
            rows = [row for seq, row in self._rows if seq > after]
            return {
                "next": self._seq,
                "dropped": self.dropped,
                "block_tokens": BLOCK_TOKENS,
                "requests": rows,
            }


@router.get("/recorded_trace")
async def recorded_trace(request: Request, after: str = "0"):
    recorder = request.app.state.engine.recorder
    if recorder is None:
        return error_response(404, "trace recording is off; start the worker with --record-trace")
    if not after.isdigit():
        return error_response(400, f"after: must be an integer >= 0, got {after!r}")
    return JSONResponse(recorder.since(int(after)))
