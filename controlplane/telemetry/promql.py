"""PromQL client (httpx) for the Prometheus-compatible TSDB at ``settings.PROMETHEUS_URL``.

Instant queries (``/api/v1/query``) give ``[Sample]``: ``{"labels": {name: value}, "ts": epoch s, "value":
float}``; range queries (``/api/v1/query_range``) give ``[Series]``: ``{"labels", "points": [(epoch s,
float), ...]}``, oldest first, with no point where the TSDB has none (a gap stays a gap). NaN values are
dropped (a quantile of no observations, a share of nothing): no figure rather than a false one.

Errors: :class:`MetricsUnavailable` when the server cannot be reached, times out (``PROMETHEUS_TIMEOUT_S``)
or answers 5xx; :class:`QueryError` when it refuses the query (4xx: a bug in ours, naming the expression).
Every call records the outcome in Redis, so every process shows the same "metrics unavailable since ..."
(:func:`unavailable_since`).
"""

from __future__ import annotations

import math
import threading
import time

import httpx
from django.conf import settings

from controlplane.telemetry.store import client as redis_client
from controlplane.telemetry.store import key as redis_key


class PromQLError(Exception):
    """A query gave no answer; ``message`` says why in words."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class MetricsUnavailable(PromQLError):
    """The TSDB did not answer (down, unreachable, slow, 5xx)."""


class QueryError(PromQLError):
    """The TSDB refused the query (bad expression or parameters)."""


def _down_key() -> str:
    return redis_key("tsdb", "down_since")


def unavailable_since() -> float | None:
    """Epoch s of the first failed query since the last one that succeeded (any process); None when up."""
    raw = redis_client().get(_down_key())
    return float(raw) if raw else None


_clients: dict[float, httpx.Client] = {}
_clients_lock = threading.Lock()


def _client(timeout: float) -> httpx.Client:
    """One keep-alive client per timeout for the process (thread-safe): a new client per query cost more CPU
    than the query (its TLS context is built at creation)."""
    with _clients_lock:
        if timeout not in _clients:
            _clients[timeout] = httpx.Client(timeout=timeout)
        return _clients[timeout]


def union(exprs: list[str]) -> str:
    """``exprs`` joined with ``or`` as a balanced tree, ``(a or b) or (c or d)``: the same vector as the
    chain ``a or b or c or d`` (``or`` is associative on series with distinct label sets, as tagged figures
    are), in O(n log k) work for k expressions of n series each where Prometheus evaluates a chain's left
    side again at each step, O(n k^2): at 1,000 workers and 40 figures the chain took 8.0 / 4.9 / 2.3 s per
    query, the tree 5.6 / 1.6 / 1.4 s in the same runs (docs/benchmarks.md, "Live-view lag"). Raises
    ValueError for no expression."""
    if not exprs:
        raise ValueError("union of no expression")
    if len(exprs) == 1:
        return exprs[0]
    mid = len(exprs) // 2
    return f"({union(exprs[:mid])} or {union(exprs[mid:])})"


def _float(raw: str) -> float | None:
    value = float(raw)
    return None if math.isnan(value) else value


class PromQL:
    """Queries against one server (``base_url``, default ``settings.PROMETHEUS_URL``); ``timeout`` in s."""

    def __init__(self, base_url: str | None = None, timeout: float | None = None):
        self.base_url = (base_url or settings.PROMETHEUS_URL).rstrip("/")
        self.timeout = settings.PROMETHEUS_TIMEOUT_S if timeout is None else timeout

    def _get(self, path: str, params: dict) -> dict:
        try:
            resp = _client(self.timeout).get(f"{self.base_url}{path}", params=params)
        except httpx.HTTPError as exc:
            self._failed()
            raise MetricsUnavailable(f"the TSDB at {self.base_url} did not answer: {exc}") from exc
        if resp.status_code >= 500:
            self._failed()
            answer = f"{resp.status_code}: {resp.text[:200]}"
            raise MetricsUnavailable(f"the TSDB at {self.base_url} answered {answer}")
        body = resp.json() if resp.headers.get("content-type", "").startswith("application/json") else {}
        if resp.status_code >= 400 or body.get("status") != "success":
            why = body.get("error") or resp.text[:200]
            raise QueryError(f"the TSDB refused {params.get('query')!r}: {why}")
        redis_client().delete(_down_key())
        return body["data"]

    def _failed(self) -> None:
        redis_client().set(_down_key(), repr(time.time()), nx=True)

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        """Instant vector ``expr`` at ``at`` (epoch s; default now): ``[{"labels", "ts", "value"}]``."""
        params = {"query": expr, **({"time": repr(at)} if at is not None else {})}
        data = self._get("/api/v1/query", params)
        if data["resultType"] != "vector":
            raise QueryError(f"{expr!r} is a {data['resultType']}, not an instant vector")
        out = []
        for item in data["result"]:
            ts, raw = item["value"]
            value = _float(raw)
            if value is not None:
                out.append({"labels": item["metric"], "ts": float(ts), "value": value})
        return out

    def raw(self, selector: str, window_s: float, at: float | None = None) -> list[dict]:
        """Every sample the TSDB stored of the series ``selector`` matches in the ``window_s`` s up to ``at``
        (epoch s; default now), with the scrape's own time: ``[{"labels", "points": [(epoch s, float),
        ...]}]`` oldest first (a range selector evaluated as an instant query: no step, no lookback)."""
        expr = f"{selector}[{round(window_s * 1000)}ms]"
        params = {"query": expr, **({"time": repr(at)} if at is not None else {})}
        data = self._get("/api/v1/query", params)
        if data["resultType"] != "matrix":
            raise QueryError(f"{expr!r} is a {data['resultType']}, not a range vector")
        return [
            {
                "labels": item["metric"],
                "points": [(float(ts), v) for ts, raw in item["values"] if (v := _float(raw)) is not None],
            }
            for item in data["result"]
        ]

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict]:
        """``expr`` from ``start`` to ``end`` (epoch s) every ``step`` s: ``[{"labels", "points"}]``."""
        params = {"query": expr, "start": repr(start), "end": repr(end), "step": f"{step:g}"}
        data = self._get("/api/v1/query_range", params)
        return [
            {
                "labels": item["metric"],
                "points": [(float(ts), v) for ts, raw in item["values"] if (v := _float(raw)) is not None],
            }
            for item in data["result"]
        ]
