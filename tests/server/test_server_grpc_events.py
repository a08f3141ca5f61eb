"""KV cache events as ``--grpc-mode`` streams them (``engine/cache/kv_events.py`` through
``engine/server/grpc_service.event_proto``), on an in-process engine with an L2: an insert is a ``stored``
of its pages in the device tier and (write-through) the host tier, chained by ``parent_block_hash``;
a snapshot lists the pages held, parents first; an L1 eviction a ``removed`` of the same block hashes
at cache level 0; a flush a ``cleared``; a request's salt is carried and puts its blocks under other
hashes than the same tokens unsalted."""

from __future__ import annotations

import queue
import uuid

import pytest
from server_testlib import wait_idle
from smg_grpc_proto.generated import common_pb2

from engine.scheduler import Req, SamplingParams
from engine.scheduler.messages import FlushCache, SnapshotKVEvents
from engine.server.args import ArgumentError, parse_args
from engine.server.grpc_service import attach_events, event_proto, to_int64

PAGE = 4


def _run(engine, prompt: list[int], salt: str | None = None) -> list[int]:
    events: queue.Queue = queue.Queue()
    sp = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    engine.scheduler.submit(Req(uuid.uuid4().hex, list(prompt), sp, events.put, cache_salt=salt))
    ids: list[int] = []
    while True:
        ev = events.get(timeout=120)
        ids += ev.new_ids
        if ev.finished:
            wait_idle(engine)
            return ids


def _drain(log) -> list:
    log.seal()
    out = [event_proto(e, i) for b in log.since(_drain.cursor) for i, e in enumerate(b.events)]
    _drain.cursor = log.sequence
    return out


_drain.cursor = 0


def _stored(events, level: int) -> list:
    stores = [e.stored for e in events if e.WhichOneof("data") == "stored"]
    return [b for s in stores for b in s.blocks if b.cache_level == level]


def test_stream_reports_inserts_evictions_flushes_and_salts(make_engine):
    engine = make_engine(
        "--page-size", str(PAGE), "--max-total-tokens", "96", "--enable-hierarchical-cache",
        "--hicache-ratio", "4", "--hicache-write-policy", "write_through",
    )  # fmt: skip
    log = attach_events(engine)
    _drain.cursor = 0
    prompt = [(7 * i) % 300 + 3 for i in range(20)]
    _run(engine, prompt)
    first = _drain(log)
    device = _stored(first, 0)
    # the prompt's whole pages are on the device, in order, each carrying its tokens
    tokens = [t for b in device for t in b.token_ids]
    assert tokens[: 4 * PAGE] == prompt[: 4 * PAGE] and all(b.block_size == PAGE for b in device)
    stores = [e.stored for e in first if e.WhichOneof("data") == "stored"]
    roots = [s for s in stores if not s.HasField("parent_block_hash")]
    assert roots and roots[0].blocks[0].token_ids == prompt[:PAGE]
    assert roots[0].tier == common_pb2.KV_CACHE_TIER_DEVICE
    hashes = [b.block_hash for b in device]
    assert len(set(hashes)) == len(hashes)
    # write-through: the same blocks reach L2 under the same hashes (cache level 1)
    host = _stored(first, 1)
    assert host and {b.block_hash for b in host} <= set(hashes)

    # the same tokens under a salt: other hashes, and the salt on every stored event of that request
    _run(engine, prompt, salt="tenant-a")
    salted = _drain(log)
    salted_stored = [e.stored for e in salted if e.WhichOneof("data") == "stored"]
    assert salted_stored and all(s.cache_salt == "tenant-a" for s in salted_stored)
    assert not {b.block_hash for s in salted_stored for b in s.blocks} & set(hashes)

    # a snapshot lists what is held now: the first prompt's device pages among them, parents first
    sequence, held = engine.scheduler.post(SnapshotKVEvents()).result(timeout=60)
    assert sequence == log.sequence
    held_device = [p for e in held if e.tier == "device" for p in e.page_ids]
    assert {to_int64(p) for p in held_device} >= set(hashes)
    seen: set = set()
    for e in held:
        assert e.parent_id is None or e.parent_id in seen
        seen.update(e.page_ids)

    # prompts that do not fit beside it push the first pages out of L1: removed, at level 0, same hashes
    for k in range(3):
        _run(engine, [(11 * i + 5 * k) % 300 + 3 for i in range(40)])
    later = _drain(log)
    removed_l1 = {h for e in later if e.WhichOneof("data") == "removed" and e.removed.cache_level == 0
                  for h in e.removed.block_hashes}  # fmt: skip
    assert removed_l1 & set(hashes)

    engine.scheduler.post(FlushCache()).result(timeout=60)
    assert any(e.WhichOneof("data") == "cleared" for e in _drain(log))


def test_grpc_flags_refuse_what_grpc_cannot_serve(tiny_model_dir, tmp_path):
    keys = tmp_path / "tenants.json"
    keys.write_text('{"tenants": []}')
    cases = [
        (["--disable-kv-events"], "--disable-kv-events: only a --grpc-mode worker"),
        (["--smg-http-sidecar-port", "30001"], "--smg-http-sidecar-port: only a --grpc-mode worker"),
        (["--grpc-mode", "--port", "30001", "--smg-http-sidecar-port", "30001"], "differ from --port"),
        (["--grpc-mode", "--tenant-keys-file", str(keys)], "--grpc-mode and --tenant-keys-file exclude"),
        (["--grpc-mode", "--disaggregation-mode", "decode"], "--grpc-mode: only a regular worker"),
    ]
    for flags, words in cases:
        with pytest.raises(ArgumentError) as err:
            parse_args(["--model-path", str(tiny_model_dir), *flags])
        assert words in str(err.value)
