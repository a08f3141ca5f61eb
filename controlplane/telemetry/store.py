"""Telemetry state in Redis: latest snapshot and bounded history per worker, broadcast throttle keys.

Keys (prefix settings.REDIS_KEY_PREFIX): `<p>:tm:w:<id>:latest` (JSON), `<p>:tm:w:<id>:hist` (list, newest
first, at most HISTORY_LEN), `<p>:tm:w:<id>:recent` (sorted set of each sample's `recent.entry` JSON, score
its `ts`; only samples of the last `recent.WINDOW_S` by the server's clock, at most HISTORY_LEN; the key
expires when the worker stops reporting), `<p>:tm:w:<id>:seq` (counter), `<p>:tm:gate:<group>` (1 s send
window), `<p>:tm:pend:<group>` (a trailing flush is scheduled).
"""

import json
import time
from functools import lru_cache

import redis
from django.conf import settings

from controlplane.telemetry import recent
from controlplane.telemetry.metrics import RATE_WINDOW_S, rate_base

HISTORY_LEN = 1800  # one hour at the agent's 2 s push interval: the console's 1 h window
WINDOW_MS = 1000


@lru_cache(maxsize=4)
def _client(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, decode_responses=True)


def client() -> redis.Redis:
    return _client(settings.REDIS_URL)


def _key(*parts) -> str:
    return ":".join([settings.REDIS_KEY_PREFIX, "tm", *map(str, parts)])


def save_sample(worker_id: int, sample: dict) -> int:
    """Number `sample` (sets sample["seq"]), store it as latest and in history; returns that number."""
    sample["seq"] = int(client().incr(_key("w", worker_id, "seq")))
    pipe = client().pipeline()
    _queue_sample(pipe, worker_id, sample)
    pipe.execute()
    return sample["seq"]


def ingest_begin(worker_id: int, ts: float) -> tuple[dict | None, dict | None, int]:
    """One round trip before storing a new sample taken at ``ts`` (epoch s): the worker's latest sample
    (None if none), the base of the new sample's rates (`metrics.rate_base` over the worker's recent window:
    a `recent.entry`, None when no earlier sample is in it) and the number the new one gets."""
    window = _key("w", worker_id, "recent")
    pipe = client().pipeline(transaction=False)
    pipe.get(_key("w", worker_id, "latest"))
    pipe.zrevrangebyscore(window, ts - RATE_WINDOW_S, "-inf", start=0, num=1)
    pipe.zrangebyscore(window, f"({ts - RATE_WINDOW_S}", f"({ts}", start=0, num=1)
    pipe.incr(_key("w", worker_id, "seq"))
    raw, older, newer, seq = pipe.execute()
    base = rate_base(json.loads(older[0]) if older else None, json.loads(newer[0]) if newer else None)
    return (json.loads(raw) if raw else None), base, int(seq)


def ingest_commit(worker_id: int, sample: dict, groups: list[str]) -> list[float | bool | None]:
    """One round trip: store `sample` (its "seq" set) as latest, in history and in the recent window, and
    pass each of `groups` through its send window (:func:`gate`). Returns one gate answer per group."""
    pipe = client().pipeline(transaction=False)
    _queue_sample(pipe, worker_id, sample)
    for group in groups:
        _queue_gate(pipe, group)
    answers = pipe.execute()[-len(groups) :] if groups else []
    return [_gate_answer(a) for a in answers]


def _queue_sample(pipe, worker_id: int, sample: dict) -> None:
    body = json.dumps(sample)
    pipe.set(_key("w", worker_id, "latest"), body)
    pipe.lpush(_key("w", worker_id, "hist"), body)
    pipe.ltrim(_key("w", worker_id, "hist"), 0, HISTORY_LEN - 1)
    window = _key("w", worker_id, "recent")
    pipe.zadd(window, {json.dumps(recent.entry(sample)): float(sample["ts"])})
    pipe.zremrangebyscore(window, "-inf", time.time() - recent.WINDOW_S)
    pipe.zremrangebyrank(window, 0, -HISTORY_LEN - 1)
    pipe.expire(window, int(recent.WINDOW_S) + 60)


def latest(worker_id: int) -> dict | None:
    raw = client().get(_key("w", worker_id, "latest"))
    return json.loads(raw) if raw else None


def latest_many(worker_ids: list[int]) -> dict[int, dict]:
    if not worker_ids:
        return {}
    raws = client().mget([_key("w", w, "latest") for w in worker_ids])
    return {w: json.loads(r) for w, r in zip(worker_ids, raws, strict=True) if r}


def recent_bounds(worker_ids: list[int], since: float) -> dict[int, tuple[dict, dict]]:
    """Per worker with a sample newer than ``since`` (epoch s): its (oldest, newest) such `recent.entry`
    (the same entry twice when it has one). One round trip for all workers."""
    if not worker_ids:
        return {}
    pipe = client().pipeline()
    for worker_id in worker_ids:
        key = _key("w", worker_id, "recent")
        pipe.zrangebyscore(key, f"({since}", "+inf", start=0, num=1)
        pipe.zrevrangebyscore(key, "+inf", f"({since}", start=0, num=1)
    raws = pipe.execute()
    out = {}
    for i, worker_id in enumerate(worker_ids):
        first, last = raws[2 * i], raws[2 * i + 1]
        if first and last:
            out[worker_id] = (json.loads(first[0]), json.loads(last[0]))
    return out


def history(worker_id: int, limit: int = HISTORY_LEN) -> list[dict]:
    """Oldest first."""
    raws = client().lrange(_key("w", worker_id, "hist"), 0, max(0, min(limit, HISTORY_LEN) - 1))
    return [json.loads(r) for r in reversed(raws)]


# KEYS: gate, pend; ARGV: window ms. -2: the window was open (now closed for ARGV[1] ms): send now. >= 0:
# it is closed for that many ms more and this caller must schedule the trailing flush. -1: closed, and a
# flush is already scheduled.
_GATE_LUA = """
if redis.call('SET', KEYS[1], '1', 'NX', 'PX', ARGV[1]) then return -2 end
local ttl = redis.call('PTTL', KEYS[1])
if ttl < 1 then ttl = 1 end
if redis.call('SET', KEYS[2], '1', 'NX', 'PX', ttl + 50) then return ttl end
return -1
"""


def _queue_gate(pipe, group: str) -> None:
    # EVAL, not a registered Script: in a pipeline that costs a SCRIPT EXISTS round trip on every execute
    pipe.eval(_GATE_LUA, 2, _key("gate", group), _key("pend", group), WINDOW_MS)


def _gate_answer(raw) -> float | bool | None:
    raw = int(raw)
    return True if raw == -2 else (None if raw == -1 else raw / 1000.0)


def gate(group: str) -> float | bool | None:
    """Pass `group` through its 1 s send window in one round trip: True when the window was open (it is
    now closed for a second: send now); else the seconds until it reopens when this caller must schedule the
    one trailing flush, or None when one is already scheduled."""
    pipe = client().pipeline(transaction=False)
    _queue_gate(pipe, group)
    return _gate_answer(pipe.execute()[0])


def open_window(group: str) -> bool:
    """True (and the window closes for 1 s) when `group` may be sent to now."""
    return bool(client().set(_key("gate", group), "1", nx=True, px=WINDOW_MS))


def claim_trailing_flush(group: str) -> float | None:
    """When the window is closed: seconds until it reopens if this caller must schedule the flush."""
    ttl_ms = client().pttl(_key("gate", group))
    if not client().set(_key("pend", group), "1", nx=True, px=max(ttl_ms, 1) + 50):
        return None
    return max(ttl_ms, 0) / 1000.0


def release_trailing_flush(group: str) -> None:
    client().delete(_key("pend", group))
