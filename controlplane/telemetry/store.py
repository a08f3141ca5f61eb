"""Telemetry's Redis: one client per process and the key names under ``settings.REDIS_KEY_PREFIX``
(``<prefix>:tm:<parts...>``): the TSDB's availability (`promql`), the watched workers (`watchers`) and the L3
audit's last seen values (`storage_audit`). No metric sample is kept here: the TSDB holds them.
"""

from functools import lru_cache

import redis
from django.conf import settings


@lru_cache(maxsize=4)
def _client(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, decode_responses=True)


def client() -> redis.Redis:
    return _client(settings.REDIS_URL)


def key(*parts) -> str:
    """``<prefix>:tm:<parts...>``."""
    return ":".join([settings.REDIS_KEY_PREFIX, "tm", *map(str, parts)])
