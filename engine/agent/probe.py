"""Read a worker's live state over its HTTP API: ``/metrics`` (Prometheus text), ``/server_info`` and, with
``--record-trace``, ``/recorded_trace``."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

TIERS = ("device", "host", "storage")


def metrics_text(url: str, timeout: float = 3.0) -> str | None:
    """The worker's ``/metrics`` text, or None when it does not answer 200."""
    try:
        resp = httpx.get(f"{url}/metrics", timeout=timeout)
    except httpx.HTTPError:
        return None
    return resp.text if resp.status_code == 200 else None


def server_info(url: str, timeout: float = 3.0) -> dict | None:
    """The worker's ``/server_info`` JSON, or None when it does not answer 200."""
    try:
        resp = httpx.get(f"{url}/server_info", timeout=timeout)
    except httpx.HTTPError:
        return None
    return resp.json() if resp.status_code == 200 else None


def recorded_trace(url: str, after: int, timeout: float = 5.0) -> dict | None:
    """``{"next", "dropped", "requests"}`` from the worker's ``/recorded_trace?after=``, or None."""
    try:
        resp = httpx.get(f"{url}/recorded_trace", params={"after": after}, timeout=timeout)
    except httpx.HTTPError:
        return None
    return resp.json() if resp.status_code == 200 else None


def cached_tokens(text: str) -> dict[str, float]:
    """Total ``sglang:cached_tokens_total`` per ``cache_source`` (device, host, storage) in ``text``."""
    out = dict.fromkeys(TIERS, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "sglang:cached_tokens_total" and sample.labels.get("cache_source") in out:
                out[sample.labels["cache_source"]] += sample.value
    return out
