"""Concurrent what-if replays: at most ``WHATIF_MAX_PER_USER`` per user and kind and ``WHATIF_MAX_RUNNING``
in all, counted across every web process in Redis (a sorted set of run ids scored by their deadline, so a
slot a killed process held frees itself once ``WHATIF_TIMEOUT_S`` plus a margin has passed)."""

import contextlib
import time
import uuid

from django.conf import settings

from controlplane.core.exceptions import ApplicationError
from controlplane.telemetry.store import client

# KEYS: global set, user set; ARGV: now, deadline, run id, global max, user max. Expired slots are dropped
# first; returns 0 (taken), 1 (the user is at the limit) or 2 (the control plane is).
_ACQUIRE = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', ARGV[1])
if redis.call('ZCARD', KEYS[2]) >= tonumber(ARGV[5]) then return 1 end
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[4]) then return 2 end
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[3])
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[3])
redis.call('PEXPIREAT', KEYS[2], math.floor(ARGV[2] * 1000))
return 0
"""


class TooManyRuns(ApplicationError):
    status_code = 429
    code = "too_many_whatif_runs"


KINDS = ("whatif", "calibration")  # the capacity page's Run and the replay it starts on every load


def _keys(user_id: int, kind: str) -> list[str]:
    prefix = f"{settings.REDIS_KEY_PREFIX}:whatif:running"
    return [prefix, f"{prefix}:user:{user_id}:{kind}"]


@contextlib.contextmanager
def whatif_slot(*, user_id: int, kind: str = "whatif"):
    """Hold one what-if slot for the block. ``kind``: one of ``KINDS``, each with its own per-user limit,
    so the calibration replay a page load starts never refuses the user's Run (both count against the
    control plane's). Raises TooManyRuns (429, ``detail.limit`` the limit reached and
    ``detail.retry_after_s``) when the user or the control plane already runs as many as allowed."""
    if kind not in KINDS:
        raise ValueError(f"kind: {kind!r} is not one of {', '.join(KINDS)}")
    keys = _keys(user_id, kind)
    run_id = uuid.uuid4().hex
    now = time.time()
    per_user, overall = settings.WHATIF_MAX_PER_USER, settings.WHATIF_MAX_RUNNING
    taken = client().eval(
        _ACQUIRE, 2, *keys, now, now + settings.WHATIF_TIMEOUT_S + 30, run_id, overall, per_user
    )
    if taken:
        who, limit = (f"you run ({kind})", per_user) if taken == 1 else ("the control plane runs", overall)
        raise TooManyRuns(
            f"{who} {limit} what-if replay(s) already, the most allowed at once: retry when one has finished",
            detail={"limit": "per_user" if taken == 1 else "overall", "max": limit, "retry_after_s": 10},
        )
    try:
        yield
    finally:
        pipe = client().pipeline()
        for key in keys:
            pipe.zrem(key, run_id)
        pipe.execute()
