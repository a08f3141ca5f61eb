"""Read a worker's live state over its HTTP API: ``/metrics`` (Prometheus text), ``/server_info``, with its
admin key ``/hicache/storage-backend`` and, with ``--record-trace``, ``/recorded_trace``."""

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


def loads(url: str, timeout: float = 3.0) -> dict | None:
    """Upstream SGLang's ``GET /v1/loads`` (``{"loads": [{dp_rank, num_running_reqs, num_waiting_reqs,
    queues, disaggregation, ...}]}``), or None when it does not answer 200."""
    try:
        resp = httpx.get(f"{url}/v1/loads", timeout=timeout)
    except httpx.HTTPError:
        return None
    return resp.json() if resp.status_code == 200 else None


def storage_backend(url: str, admin_key: str | None, timeout: float = 3.0) -> dict | None:
    """The worker's ``GET /hicache/storage-backend`` (its attached L3 backend, extra config and policies as
    they are now; an admin route), or None without ``admin_key`` or when it does not answer 200."""
    if not admin_key:
        return None
    try:
        resp = httpx.get(
            f"{url}/hicache/storage-backend",
            headers={"Authorization": f"Bearer {admin_key}"},
            timeout=timeout,
        )
        body = resp.json() if resp.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None
    return body if isinstance(body, dict) else None


def _answers(url: str, path: str, key: str | None, timeout: float) -> bool:
    headers = {"Authorization": f"Bearer {key}"} if key else None
    try:
        return httpx.get(f"{url}{path}", headers=headers, timeout=timeout).status_code == 200
    except httpx.HTTPError:
        return False


def capabilities(url: str, info: dict | None, admin_key: str | None, timeout: float = 3.0) -> list[str]:
    """What the worker at ``url`` can do, by asking it (names of ``engine.server.contract.CAPABILITIES``):
    each admin route answered 200 with ``admin_key``, ``is_idle`` present in its ``/server_info`` (``info``),
    ``/v1/loads`` answered, ``enable_pd_role_switch`` / ``record_trace`` on. ``[]`` when ``info`` is None
    (the worker did not answer)."""
    if info is None:
        return []
    kvfleet = "is_idle" in info
    found = []
    if info.get("enable_hierarchical_cache") and _answers(
        url, "/hicache/storage-backend", admin_key, timeout
    ):
        found.append("storage_attach")
    if _answers(url, "/hicache/config", admin_key, timeout):
        found.append("runtime_config")
    # Upstream 0.5.23 has a /pd_role_switch route too, but its answer is not the contract KVFleet's
    # rebalance reads (engine/server/contract.py): an upstream worker is switched by a restart instead.
    if kvfleet and info.get("enable_pd_role_switch"):
        found.append("role_switch")
    if kvfleet:
        found.append("exact_idle")
    if _answers(url, "/v1/loads", None, timeout):
        found.append("load_report")
    if info.get("record_trace"):
        found.append("recorded_trace")
    return found
