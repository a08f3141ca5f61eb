"""Remove one local fleet's keys from a Redis it shares (``LocalFleet.stop``; the demo's ``$REDIS_URL``).

A fleet's control plane keys live under ``$REDIS_KEY_PREFIX`` (``<p>:tm:...`` telemetry, ``<p>:plan:...``
planner state, none with an expiry) and its Celery queue is named ``$CELERY_QUEUE``; kombu keeps the queue
as the key ``<q>`` (priority lanes ``<q>\\x06\\x16<n>``) and its exchange bindings as
``_kombu.binding.<q>`` / ``_kombu.binding_permanent.<q>``. Left behind, every demo run adds its keys for
good; ``delete_fleet_keys`` SCANs for exactly those names (never ``KEYS``, so a large shared Redis is not
blocked) and deletes them.
"""

from __future__ import annotations

import re

import redis


def _glob(text: str) -> str:
    """``text`` as a literal inside a Redis MATCH pattern."""
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


def delete_fleet_keys(url: str, prefix: str, queue: str) -> int:
    """Delete the keys of the fleet whose key prefix is ``prefix`` and Celery queue ``queue``; the count.

    Raises ``redis.RedisError`` when Redis does not answer.
    """
    client = redis.Redis.from_url(url, socket_connect_timeout=2)
    patterns = [
        f"{_glob(prefix)}:*",
        _glob(queue),
        f"{_glob(queue)}\x06\x16*",
        f"_kombu.binding.{_glob(queue)}",
        f"_kombu.binding_permanent.{_glob(queue)}",
    ]
    deleted = 0
    with client:
        for pattern in patterns:
            batch = list(client.scan_iter(match=pattern, count=500))
            for start in range(0, len(batch), 500):
                deleted += client.delete(*batch[start : start + 500])
    return deleted
