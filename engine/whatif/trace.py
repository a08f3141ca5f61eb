"""Mooncake-format request traces: reading, checking, and turning block ids into page keys.

A trace is JSON lines, one request per line: ``timestamp`` (ms from the start), ``input_length`` and
``output_length`` (tokens) and ``hash_ids``: one id per ``block_tokens``-token block of the input (the last
block may be partial); optionally ``output_hash_ids``: the ids of the blocks holding generated tokens of the
sequence the engine caches at the end (the input, then every output token but the last), from the first such
block on (a KVFleet recording has them, Mooncake's traces do not), and ``worker``: the name of the worker that
served it (a pool's recorded trace carries it, so the replay gives each worker its own L1 and L2, as the fleet
has them). Equal ids mean the same prefix up to the end of that block (Mooncake's traces are prefix-closed: an
id always has the same predecessor and position), so a page ending at token ``t`` is identified by the id of
the block holding ``t`` and ``t``'s offset in it. That page id is what the replay's radix tree keys on and
what stands in for the page's L3 key.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

# Mooncake's released traces (conversation_trace.jsonl, synthetic_trace.jsonl) on this installation.
SHARED_TRACE_DIR = Path(os.environ.get("KVFLEET_TRACE_DIR", "/work/shared/data/mooncake-traces"))
FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


class TraceError(ValueError):
    """A trace file that cannot be read; the message names the file, line and field."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request: arrival ``timestamp`` (ms), ``input_length``, ``output_length`` (tokens), ``hash_ids``,
    and the ``worker`` that served it ("" when the trace does not say)."""

    timestamp: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    worker: str = ""
    output_hash_ids: tuple[int, ...] = ()

    @property
    def computed_length(self) -> int:
        """Tokens the engine caches when the request ends: the input and every output token but the last."""
        return self.input_length + max(self.output_length - 1, 0)


def output_blocks(input_length: int, output_length: int, block_tokens: int) -> int:
    """How many ``output_hash_ids`` a row has: the blocks of its computed sequence from the first one
    holding a generated token (none with fewer than two output tokens)."""
    if output_length < 2:
        return 0
    computed = input_length + output_length - 1
    return -(-computed // block_tokens) - input_length // block_tokens


def parse_line(text: str, where: str, block_tokens: int) -> TraceRequest:
    """One trace line; raises ``TraceError`` naming ``where`` and the bad field."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{where}: not JSON ({exc.msg})") from None
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: expected a JSON object")
    for name in FIELDS:
        if name not in obj:
            raise TraceError(f"{where}: missing field {name!r}")
    ts, inp, out, ids = (obj[name] for name in FIELDS)
    if isinstance(ts, bool) or not isinstance(ts, int | float) or ts < 0:
        raise TraceError(f"{where}: timestamp must be a number >= 0, got {ts!r}")
    for name, value in (("input_length", inp), ("output_length", out)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise TraceError(f"{where}: {name} must be an integer >= 0, got {value!r}")
    if not isinstance(ids, list) or not all(
        isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in ids
    ):
        raise TraceError(f"{where}: hash_ids must be a list of integers >= 0")
    if len(ids) != -(-inp // block_tokens):
        raise TraceError(
            f"{where}: {len(ids)} hash_ids for input_length {inp} do not match --block-tokens {block_tokens} "
            f"(expected {-(-inp // block_tokens)})"
        )
    worker = obj.get("worker", "")
    if isinstance(worker, bool) or not isinstance(worker, str | int):
        raise TraceError(f"{where}: worker must be a name (string), got {worker!r}")
    extra = obj.get("output_hash_ids", [])
    if not isinstance(extra, list) or not all(
        isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in extra
    ):
        raise TraceError(f"{where}: output_hash_ids must be a list of integers >= 0")
    if extra and len(extra) != output_blocks(inp, out, block_tokens):
        raise TraceError(
            f"{where}: {len(extra)} output_hash_ids for input_length {inp} and output_length {out} do not "
            f"match --block-tokens {block_tokens} (expected {output_blocks(inp, out, block_tokens)})"
        )
    return TraceRequest(float(ts), inp, out, tuple(ids), str(worker), tuple(extra))


def load_trace(path: str | Path, block_tokens: int = 512) -> list[TraceRequest]:
    """Every request of the JSONL trace at ``path``, in arrival order (stable for equal timestamps).

    Raises ``TraceError`` for a missing file, a bad line or an empty trace.
    """
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise TraceError(f"{path}: cannot read ({exc.strerror})") from None
    reqs = [parse_line(t, f"{path}:{n}", block_tokens) for n, t in enumerate(lines, 1) if t.strip()]
    if not reqs:
        raise TraceError(f"{path}: no requests")
    return sorted(reqs, key=lambda r: r.timestamp)


def page_keys(req: TraceRequest, num_tokens: int, block_tokens: int, page_size: int) -> list[int]:
    """Page ids of the first ``num_tokens // page_size`` whole pages of ``req``'s input.

    Page ``k`` ends at token ``t = (k + 1) * page_size - 1``; its id is ``hash_ids[t // B] * B + t % B``
    (``B`` = ``block_tokens``), equal for two requests exactly when their prefixes up to ``t`` are equal.
    """
    B, ids = block_tokens, req.hash_ids
    if page_size == B:
        return [h * B + B - 1 for h in ids[: num_tokens // B]]
    ends = range(page_size - 1, num_tokens // page_size * page_size, page_size)
    return [ids[t // B] * B + t % B for t in ends]


def output_page_keys(req: TraceRequest, block_tokens: int, page_size: int) -> list[int]:
    """Page ids of the whole pages of ``req``'s computed sequence (``computed_length``) past its input's whole
    pages, from ``output_hash_ids``; [] when the row has none. Same ids as :func:`page_keys` gives a later
    request whose input holds this sequence (the block ids are chained)."""
    if not req.output_hash_ids:
        return []
    B, first = block_tokens, req.input_length // block_tokens  # output_hash_ids[0] is block ``first``
    start = req.input_length // page_size * page_size
    ends = range(start + page_size - 1, req.computed_length // page_size * page_size, page_size)
    return [req.output_hash_ids[t // B - first] * B + t % B for t in ends]
