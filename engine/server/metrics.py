"""Prometheus metrics with SGLang's names (``sglang:`` prefix, ``model_name`` label), served on ``/metrics``.

Per-request counters and histograms are updated by the scheduler thread through the hook methods below
(prometheus-client is thread-safe). Queue gauges and the HiCache counters are read at scrape time from the
snapshot the scheduler publishes (``Scheduler.state``), so a scrape never touches the cache. Histogram buckets
follow SGLang's collector (TTFT 0.1…400 s, ITL 0.002…8 s, e2e 0.1…2400 s), with a few finer TTFT buckets.
Miss attribution (``engine/cache/misses.py``): ``sglang:miss_tokens{cause}``, ``sglang:tenant_miss_tokens
{tenant,cause}`` and ``sglang:miss_evicted_tokens{radix_eviction_policy}``, counted at admission from the
request's ``misses``; the first sums to ``prompt_tokens`` less ``cached_tokens`` of every tier.
``sglang:kv_cost_{operations,tokens,seconds}_total{operation,size}``: what loading a prefix costs against
recomputing it, by size bucket (engine/cache/costs.py), the control plane's crossover reads them.
The HiCache per-operation histograms (load-back and eviction seconds, L3 batch pages and GB/s) are bucketed by
the cache itself (``engine.cache.stats.HISTOGRAM_BUCKETS``, SGLang's buckets) and exported from the snapshot.

``tp_rank`` label, where upstream's collectors carry it: the scheduler's gauges (running / queued requests,
token usage, pool sizes, cache hit rate) and the L3 storage metrics (prefetched / backed-up tokens, the L3
batch histograms). The request-side counters and latency histograms carry ``model_name`` only, as upstream's
tokenizer metrics do. Only rank 0 serves ``/metrics`` (the other ranks of a ``--tp-size`` worker have no
HTTP server), so the label is always ``"0"`` here; its figures are rank 0's, which every rank shares
(they take the same scheduling decisions).

``dp_rank`` label (DP attention, ``--enable-dp-attention``), as upstream adds it then: the scheduler
gauges (``cache_hit_rate`` too: each rank's last prefill batch) and the L3 storage counters get one
series per DP rank (``tp_rank`` = ``dp_rank``, each DP rank being one attention rank); the other cache
counters (``cached_tokens`` by source, hits, evictions) are summed over the DP ranks.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from engine.cache.eviction_names import EVICTION_POLICIES
from engine.cache.misses import MISS_CAUSES
from engine.cache.storage.health import STATES as BREAKER_STATES
from engine.server.tenants import salt_label

_HIT_RATE_DOC = "Prefix hit rate of the last prefill batch (cached / prompt tokens)"
TENANT_LABEL_LIMIT = 16
"""Tenants (cache salts) with a ``tenant`` label of their own; later ones are counted as ``other``."""

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
ITL_BUCKETS = (
    0.002,
    0.005,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.035,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    1,
    2,
    4,
    8,
)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2400)
QUEUE_BUCKETS = (0.0, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300, 1000, 3000)

# HiCache counters taken from the cache's CacheStats snapshot: metric suffix -> stats key.
CACHE_COUNTERS = {
    "load_back_tokens": "load_back_tokens",
    "evicted_tokens": "evicted_tokens",
    "prefetched_tokens": "prefetched_tokens",
    "backuped_tokens": "backuped_tokens",
    "prefetch_completed": "prefetch_completed",
    "prefetch_timeout": "prefetch_timed_out",
    "prefetch_revoked": "prefetch_revoked",
    # evicted pages the miss attribution's record forgot (bounded): later misses of them read not_seen_here
    "miss_record_forgotten_pages": "miss_record_forgotten_pages",
}
# HiCache per-operation histograms (CacheStats.histograms); the L3 ones carry a storage_backend label.
CACHE_HISTOGRAMS = {
    "load_back_duration_seconds": "Seconds per L2 -> L1 load-back (all layers)",
    "eviction_duration_seconds": "Seconds per L1 eviction call that freed slots",
    "prefetch_bandwidth": "GB/s per L3 -> L2 read batch",
    "backup_bandwidth": "GB/s per L2 -> L3 write batch",
    "prefetch_pgs": "Pages per L3 -> L2 read batch",
    "backup_pgs": "Pages per L2 -> L3 write batch",
}
_STORAGE_HISTOGRAMS = ("prefetch_bandwidth", "backup_bandwidth", "prefetch_pgs", "backup_pgs")
_STORAGE_COUNTERS = ("prefetched_tokens", "backuped_tokens")


class TenantLabels:
    """The ``tenant`` label of a cache salt, bounded: the configured tenants' labels first, then the first
    salts seen up to ``limit`` in all (``none``: no salt); every later salt is ``other``. First come, not
    top N by traffic, so every series stays a monotonic counter."""

    def __init__(self, configured: list[str], limit: int = TENANT_LABEL_LIMIT):
        self.limit = limit
        self._known = set(configured[:limit])

    def __call__(self, salt: str | None) -> str:
        label = salt_label(salt)
        if label in self._known or label == "none":
            return label
        if len(self._known) < self.limit:
            self._known.add(label)
            return label
        return "other"


class EngineMetrics:
    """The worker's metric registry; ``state()`` returns the scheduler's latest snapshot dict. ``tenants``:
    the metric labels of the configured tenants (``--tenant-keys-file``), which always get a series."""

    def __init__(
        self,
        model_name: str,
        state,
        tenants: Sequence[str] = (),
        tp_rank: int = 0,
        dp_states: Sequence[Callable[[], dict]] = (),
    ):
        """``dp_states``: with DP attention, each DP rank's snapshot reader (rank order); two or more add
        upstream's ``dp_rank`` label to the scheduler gauges and L3 storage metrics, one series per rank,
        and sum the other cache counters over the ranks."""
        self.registry = CollectorRegistry()
        self.state = state
        self.dp_states = list(dp_states) if len(dp_states) > 1 else []
        self.model_name = model_name
        self.tp_rank = str(tp_rank)
        labels = ["model_name"]
        r = self.registry
        self.prompt_tokens = Counter("sglang:prompt_tokens", "Prefill tokens", labels, registry=r)
        self.generation_tokens = Counter("sglang:generation_tokens", "Generated tokens", labels, registry=r)
        self.num_requests = Counter("sglang:num_requests", "Finished requests", labels, registry=r)
        self.num_aborted = Counter("sglang:num_aborted_requests", "Aborted requests", labels, registry=r)
        self.num_so = Counter(
            "sglang:num_so_requests", "Finished structured-output requests", labels, registry=r
        )
        self.ttft = Histogram(
            "sglang:time_to_first_token_seconds",
            "Time to first token",
            labels,
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "sglang:inter_token_latency_seconds",
            "Inter-token latency",
            labels,
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "sglang:e2e_request_latency_seconds",
            "End-to-end latency",
            labels,
            buckets=E2E_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            "sglang:queue_time_seconds", "Waiting-queue time", labels, buckets=QUEUE_BUCKETS, registry=r
        )
        self.bootstrap_failed = Counter(
            "sglang:num_bootstrap_failed_reqs", "PD requests failed while pairing", labels, registry=r
        )
        self.transfer_failed = Counter(
            "sglang:num_transfer_failed_reqs",
            "PD requests failed after pairing (KV transfer failed, aborted by the peer or timed out)",
            labels,
            registry=r,
        )
        for counter in (self.bootstrap_failed, self.transfer_failed):
            counter.labels(model_name)  # exported from 0, before the first failure
        for counter in (self.prompt_tokens, self.generation_tokens, self.num_requests):
            counter.labels(model_name)  # from 0, so a window's increase counts the first request too
        self.tenant_label = TenantLabels(list(tenants))
        tenant_labels = ["model_name", "tenant"]
        self.tenant_prompt_tokens = Counter(
            "sglang:tenant_prompt_tokens", "Prompt tokens admitted, by tenant", tenant_labels, registry=r
        )
        self.tenant_cached_tokens = Counter(
            "sglang:tenant_cached_tokens",
            "Prompt tokens served from cache, by tenant and tier",
            [*tenant_labels, "cache_source"],
            registry=r,
        )
        self.tenant_rejected = Counter(
            "sglang:tenant_rejected_requests",
            "Requests refused because the tenant had max_requests in flight",
            tenant_labels,
            registry=r,
        )
        # Miss attribution (engine/cache/misses.py): every admitted prompt token the cache did not serve,
        # by cause; they sum to sglang:prompt_tokens less sglang:cached_tokens (attribution on).
        self.miss_tokens = Counter(
            "sglang:miss_tokens",
            "Prompt tokens not served from cache, by cause",
            [*labels, "cause"],
            registry=r,
        )
        self.tenant_miss_tokens = Counter(
            "sglang:tenant_miss_tokens",
            "Prompt tokens not served from cache, by tenant and cause",
            [*tenant_labels, "cause"],
            registry=r,
        )
        self.miss_evicted_tokens = Counter(
            "sglang:miss_evicted_tokens",
            "Missed prompt tokens this worker had evicted, by the eviction policy that evicted them",
            [*labels, "radix_eviction_policy"],
            registry=r,
        )
        for cause in MISS_CAUSES:  # exported from 0
            self.miss_tokens.labels(model_name, cause)
        for policy in EVICTION_POLICIES:
            self.miss_evicted_tokens.labels(model_name, policy)
        for label in tenants:  # exported from 0
            self.tenant_prompt_tokens.labels(model_name, label)
            self.tenant_rejected.labels(model_name, label)
            for source in ("device", "host", "storage"):
                self.tenant_cached_tokens.labels(model_name, label, source)
        self.registry.register(_StateCollector(self))

    # hooks called by the scheduler thread
    def on_admit(self, req) -> None:
        m = self.model_name
        self.prompt_tokens.labels(m).inc(len(req.input_ids))
        self.queue_time.labels(m).observe(time.perf_counter() - req.arrival)
        tenant = self.tenant_label(req.cache_salt)
        self.tenant_prompt_tokens.labels(m, tenant).inc(len(req.input_ids))
        for source, tokens in req.cached.items():
            self.tenant_cached_tokens.labels(m, tenant, source).inc(tokens)
        if req.misses is not None:
            for cause, tokens in req.misses.causes.items():
                self.miss_tokens.labels(m, cause).inc(tokens)
                self.tenant_miss_tokens.labels(m, tenant, cause).inc(tokens)
            for policy, tokens in req.misses.evicted_by.items():
                self.miss_evicted_tokens.labels(m, policy).inc(tokens)

    def on_tenant_rejected(self, label: str) -> None:
        """A tenant's request was refused at its ``max_requests`` (``label``: the tenant's metric label)."""
        self.tenant_rejected.labels(self.model_name, label).inc()

    def on_first_token(self, seconds: float) -> None:
        self.ttft.labels(self.model_name).observe(seconds)

    def on_inter_token(self, seconds: float) -> None:
        """The gap between two consecutive output tokens of one request (ITL, one sample per gap)."""
        self.itl.labels(self.model_name).observe(seconds)

    def on_pd_failure(self, stage: str) -> None:
        """A PD request failed (not a client abort): ``stage`` ``bootstrap`` (pairing) or ``transfer``."""
        counter = self.bootstrap_failed if stage == "bootstrap" else self.transfer_failed
        counter.labels(self.model_name).inc()

    def on_finish(self, req) -> None:
        m = self.model_name
        n = len(req.output_ids)
        self.num_requests.labels(m).inc()
        self.generation_tokens.labels(m).inc(n)
        now = time.perf_counter()
        self.e2e.labels(m).observe(now - req.arrival)
        if req.aborted:
            self.num_aborted.labels(m).inc()
        if req.grammar is not None:  # constrained (upstream counts it at the finish, as here)
            self.num_so.labels(m).inc()

    def render(self) -> bytes:
        """Prometheus text exposition of every metric."""
        return generate_latest(self.registry)


class _StateCollector:
    """Gauges and HiCache counters read from the scheduler snapshot at scrape time."""

    def __init__(self, metrics: EngineMetrics):
        self.metrics = metrics

    def collect(self):
        m = self.metrics
        if m.dp_states:
            yield from self._collect_dp([read() for read in m.dp_states])
            return
        yield from self._collect_one(m.state())

    def _collect_one(self, state: dict):
        m = self.metrics
        name, ranked = [m.model_name], [m.model_name, m.tp_rank]

        def gauge(metric, doc, value):  # a scheduler gauge: upstream labels it with the tp rank
            g = GaugeMetricFamily(f"sglang:{metric}", doc, labels=["model_name", "tp_rank"])
            g.add_metric(ranked, value)
            return g

        used = state.get("num_used_tokens", 0)
        total = state.get("max_total_num_tokens", 0)
        yield gauge("num_running_reqs", "Requests in the running batch", state.get("num_running_reqs", 0))
        yield gauge("num_queue_reqs", "Requests in the waiting queue", state.get("num_waiting_reqs", 0))
        yield gauge("num_used_tokens", "KV slots held by requests", used)
        yield gauge("max_total_num_tokens", "L1 KV pool capacity (tokens)", total)
        yield gauge("token_usage", "Used / capacity", round(used / total, 2) if total else 0.0)
        yield gauge("cache_hit_rate", _HIT_RATE_DOC, state.get("cache_hit_rate", 0.0))
        stats = state.get("cache_stats") or {}
        if state.get("hicache") is not None:
            yield gauge("hicache_host_used_tokens", "L2 tokens in use", stats.get("host_used_tokens", 0))
            yield gauge(
                "hicache_host_total_tokens", "L2 capacity (tokens)", stats.get("host_total_tokens", 0)
            )
        cached = CounterMetricFamily(
            "sglang:cached_tokens", "Prompt tokens served from cache", labels=["model_name", "cache_source"]
        )
        for source in ("device", "host", "storage"):
            cached.add_metric([m.model_name, source], stats.get(f"{source}_hit_tokens", 0))
        yield cached
        for metric, key in CACHE_COUNTERS.items():
            storage = metric in _STORAGE_COUNTERS  # upstream's storage collector: tp_rank labelled
            labels = ["model_name", "tp_rank"] if storage else ["model_name"]
            c = CounterMetricFamily(f"sglang:{metric}", f"HiCache {key}", labels=labels)
            c.add_metric(ranked if storage else name, stats.get(key, 0))
            yield c
        yield from self._tail(state, stats)

    def _tail(self, state: dict, stats: dict):
        """Errors, breaker, tenant caps, histograms and costs of one snapshot (rank 0's with DP attention:
        the breaker and tenant caps are per rank, the same settings on each)."""
        m = self.metrics
        errors = CounterMetricFamily(
            "sglang:hicache_storage_errors",
            "Failed L3 storage operations (seen by the cache or counted by the backend)",
            labels=["model_name"],
        )
        errors.add_metric([m.model_name], stats.get("storage_errors", 0) + stats.get("backend_errors", 0))
        yield errors
        if state.get("storage_health"):
            yield from _breaker(m.model_name, state["storage_health"])
        if state.get("tenant_usage"):
            yield from _tenant_caps(m.model_name, state["tenant_usage"])
        yield from _histograms(m.model_name, stats.get("histograms", []), m.tp_rank)
        yield from _costs(m.model_name, stats.get("costs") or {})

    def _collect_dp(self, states: list[dict]):
        """DP attention: one series per DP rank (``dp_rank``; ``tp_rank`` is the rank's attention leader,
        the DP rank itself at tp == dp) for the scheduler gauges and L3 storage counters, the other
        counters summed over the ranks, the rest rank 0's (``_tail``; its error counter summed)."""
        m = self.metrics
        labels = ["model_name", "tp_rank", "dp_rank"]
        rows = [
            ([m.model_name, str(i), str(i)], st, st.get("cache_stats") or {}) for i, st in enumerate(states)
        ]

        def gauge(metric, doc, value_of):
            g = GaugeMetricFamily(f"sglang:{metric}", doc, labels=labels)
            for values, st, stats in rows:
                g.add_metric(values, value_of(st, stats))
            return g

        def usage(st, _):
            used, total = st.get("num_used_tokens", 0), st.get("max_total_num_tokens", 0)
            return round(used / total, 2) if total else 0.0

        yield gauge(
            "num_running_reqs", "Requests in the running batch", lambda st, _: st.get("num_running_reqs", 0)
        )
        yield gauge(
            "num_queue_reqs", "Requests in the waiting queue", lambda st, _: st.get("num_waiting_reqs", 0)
        )
        yield gauge(
            "num_used_tokens", "KV slots held by requests", lambda st, _: st.get("num_used_tokens", 0)
        )
        yield gauge(
            "max_total_num_tokens",
            "L1 KV pool capacity (tokens)",
            lambda st, _: st.get("max_total_num_tokens", 0),
        )
        yield gauge("token_usage", "Used / capacity", usage)
        yield gauge("cache_hit_rate", _HIT_RATE_DOC, lambda st, _: st.get("cache_hit_rate", 0.0))
        if states[0].get("hicache") is not None:
            yield gauge(
                "hicache_host_used_tokens", "L2 tokens in use", lambda _, s: s.get("host_used_tokens", 0)
            )
            yield gauge(
                "hicache_host_total_tokens",
                "L2 capacity (tokens)",
                lambda _, s: s.get("host_total_tokens", 0),
            )

        def summed(key: str) -> float:
            return sum(stats.get(key, 0) for _, _, stats in rows)

        cached = CounterMetricFamily(
            "sglang:cached_tokens", "Prompt tokens served from cache", labels=["model_name", "cache_source"]
        )
        for source in ("device", "host", "storage"):
            cached.add_metric([m.model_name, source], summed(f"{source}_hit_tokens"))
        yield cached
        for metric, key in CACHE_COUNTERS.items():
            c = CounterMetricFamily(
                f"sglang:{metric}",
                f"HiCache {key}",
                labels=labels if metric in _STORAGE_COUNTERS else ["model_name"],
            )
            if metric in _STORAGE_COUNTERS:
                for values, _, stats in rows:
                    c.add_metric(values, stats.get(key, 0))
            else:
                c.add_metric([m.model_name], summed(key))
            yield c
        total_stats = dict(rows[0][2])
        total_stats["storage_errors"] = summed("storage_errors")
        total_stats["backend_errors"] = summed("backend_errors")
        yield from self._tail(states[0], total_stats)


def _breaker(model_name: str, health: dict):
    """The L3 circuit breaker's state (0 closed, 1 half-open, 2 open), transitions and what it saved."""
    labels, values = ["model_name", "storage_backend"], [model_name, health["storage_backend"]]
    state = GaugeMetricFamily(
        "sglang:hicache_storage_breaker_state", "L3 breaker: 0 closed, 1 half-open, 2 open", labels=labels
    )
    state.add_metric(values, BREAKER_STATES.index(health["state"]))
    yield state
    moves = CounterMetricFamily(
        "sglang:hicache_storage_breaker_transitions", "L3 breaker state changes", labels=[*labels, "state"]
    )
    for to, count in health["transitions"].items():
        moves.add_metric([*values, to], count)
    yield moves
    for metric, key, doc in (
        ("hicache_storage_breaker_short_circuited", "short_circuited", "L3 calls skipped (breaker open)"),
        ("hicache_storage_dropped_backup_pages", "dropped_backup_pages", "L3 backups dropped (breaker)"),
        ("hicache_storage_breaker_failed_calls", "failed_calls", "L3 calls failed or too slow"),
    ):
        c = CounterMetricFamily(f"sglang:{metric}", doc, labels=labels)
        c.add_metric(values, health[key])
        yield c
    for metric, key, doc in (  # gauges present only while they mean something
        (
            "hicache_storage_breaker_last_failure_age_seconds",
            "last_failure_age_s",
            "Seconds since the last failed or too slow L3 call (absent before the first)",
        ),
        (
            "hicache_storage_backup_ramp_share",
            "ramp_share",
            "Share of L3 backup pages written while ramping up after a recovery (absent otherwise)",
        ),
    ):
        if health.get(key) is not None:
            g = GaugeMetricFamily(f"sglang:{metric}", doc, labels=labels)
            g.add_metric(values, health[key])
            yield g
    if health.get("auto_detach"):
        yield from _auto_detach(labels, values, health["auto_detach"])


def _auto_detach(labels: list[str], values: list[str], auto: dict):
    """With ``auto_detach_after_s``: how often the worker took its L3 backend out and put it back itself,
    and, while it is out, for how long (absent otherwise)."""
    for metric, key, doc in (
        ("hicache_storage_auto_detach", "detaches", "L3 backend detached automatically (breaker open)"),
        ("hicache_storage_auto_attach", "attaches", "L3 backend re-attached automatically (probe answered)"),
    ):
        c = CounterMetricFamily(f"sglang:{metric}", doc, labels=labels)
        c.add_metric(values, auto[key])
        yield c
    if auto.get("detached_for_s") is not None:
        g = GaugeMetricFamily(
            "sglang:hicache_storage_auto_detached_seconds",
            "Seconds since the L3 backend was detached automatically (absent while attached)",
            labels=labels,
        )
        g.add_metric(values, auto["detached_for_s"])
        yield g


TENANT_CAP_METRICS = (  # (metric, usage key, kind, doc)
    ("tenant_l2_used_tokens", "l2_tokens_used", "gauge", "L2 (host pool) tokens a capped tenant holds"),
    ("tenant_l2_cap_tokens", "l2_tokens_cap", "gauge", "A tenant's L2 cap in tokens"),
    ("tenant_l2_cap_evicted_tokens", "l2_evicted_tokens", "counter", "L2 tokens evicted by a tenant's cap"),
    ("tenant_l2_cap_refused_tokens", "l2_refused_tokens", "counter", "L2 copies refused by a tenant's cap"),
    ("tenant_l3_sent_pages", "l3_pages_sent", "gauge", "Pages sent to L3 for a tenant since attach/clear"),
    ("tenant_l3_cap_pages", "l3_pages_cap", "gauge", "A tenant's L3 cap in pages"),
    ("tenant_l3_cap_skipped_pages", "l3_skipped_pages", "counter", "L3 backups skipped by a tenant's cap"),
)


def _tenant_caps(model_name: str, usage: dict):
    """Per capped tenant (``tenant``: the label of its group's salt, as the hit counters use): occupancy,
    caps (absent when the tenant has none for that tier) and what the caps did."""
    for metric, key, kind, doc in TENANT_CAP_METRICS:
        family_type = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
        family = family_type(f"sglang:{metric}", doc, labels=["model_name", "tenant"])
        for owner, figures in usage.items():
            if figures[key] is not None:
                family.add_metric([model_name, salt_label(owner)], figures[key])
        yield family


def _histograms(model_name: str, observed: list[dict], tp_rank: str = "0"):
    """One family per ``CACHE_HISTOGRAMS`` entry with a series per observed (metric, storage backend); the
    L3 ones are labelled with the tp rank, as upstream's storage collector does."""
    for metric, doc in CACHE_HISTOGRAMS.items():
        storage = metric in _STORAGE_HISTOGRAMS
        labels = ["model_name", "storage_backend", "tp_rank"] if storage else ["model_name"]
        family = HistogramMetricFamily(f"sglang:{metric}", doc, labels=labels)
        for h in observed:
            if h["metric"] != metric:
                continue
            values = [model_name, h["storage_backend"] or "", tp_rank] if storage else [model_name]
            buckets = [(_bound(le), count) for le, count in h["buckets"]]
            family.add_metric(values, buckets, sum_value=h["sum"])
        yield family


COST_METRICS = {  # metric suffix -> (TransferCosts.snapshot key, doc)
    "kv_cost_operations": ("count", "Load-backs (L2->L1), prefetches (L3->L2) and prefill passes, by size"),
    "kv_cost_tokens": ("tokens", "Tokens loaded back, prefetched or prefilled, by operation and size"),
    "kv_cost_seconds": ("seconds", "Wall seconds of the same operations, by operation and size"),
}


def _costs(model_name: str, costs: dict):
    """What loading costs against recomputing (engine/cache/costs.py): per ``operation`` (``load_back``,
    ``prefetch``, ``prefill``) and ``size`` bucket (upper bound in tokens, ``+Inf``), the operations, tokens
    and seconds since start, as counters; a bucket appears once observed. Tokens per second of a bucket over
    a window: ``increase(tokens) / increase(seconds)``."""
    labels = ["model_name", "operation", "size"]
    for metric, (key, doc) in COST_METRICS.items():
        family = CounterMetricFamily(f"sglang:{metric}", doc, labels=labels)
        for operation, buckets in costs.items():
            for b in buckets:
                family.add_metric([model_name, operation, b["size"]], b[key])
        yield family


def _bound(le) -> str:
    return le if le == "+Inf" else repr(float(le))
