"""Why prompt tokens missed, fleet-wide: the workers' own attribution with its ``not_seen_here`` split.

A worker attributes every prompt token its cache did not serve to one cause from what it knows
(``engine/cache/misses.py``); what it cannot know is whether a token it never saw had been computed by
another worker. Its recorded traffic says: each row carries its ``misses`` (the causes, and the token ranges
of the ``not_seen_here`` ones) beside the chained block ids that are equal exactly when two prompts share
the prefix, on every worker. Walking the pool's rows in arrival order, each ``not_seen_here`` page becomes

* ``new``: no earlier request of the pool computed it (input or cached answer): the fleet-wide first
  sighting, as the what-if's ceiling counts it (``engine.whatif.replay.ceiling_share``);
* ``elsewhere``: another worker computed it earlier and this request was not routed there (the rows carry
  no evictions, so that worker may have evicted it since: a routing or capacity question, not reuse);
* ``not_seen_here`` (what stays): only this worker computed it before: evicted longer ago than its bounded
  record remembers, or computed by a concurrent request of its own.

Tokens move between these three only, so per worker and for the fleet the causes add up to the measured
misses exactly (input tokens less the tokens its cache served, as the worker reported them). Rows with no
``misses`` (attribution off, an older worker) count toward the ceiling's history but not toward shares.
Pages are the worker's ``--page-size``; every worker of the pool is assumed to share it (as the what-if
does).
"""

from __future__ import annotations

from collections import deque

from engine.cache.misses import MISS_CAUSES as WORKER_CAUSES
from engine.whatif.trace import TraceRequest, output_page_keys, page_keys

FLEET_CAUSES = ("new", "elsewhere")
MISS_CAUSES = (*FLEET_CAUSES, *WORKER_CAUSES)
"""Every cause in the order the console stacks them: the fleet's split first, then the worker's."""


def _empty() -> dict:
    return {
        "requests": 0,
        "attributed_requests": 0,
        "input_tokens": 0,
        "served_tokens": 0,
        "ceiling_tokens": 0,
        "causes": dict.fromkeys(MISS_CAUSES, 0),
    }


def _finish(acc: dict) -> dict:
    """Shares of the attributed requests' input tokens (None without any)."""
    total = acc["input_tokens"]
    acc["miss_tokens"] = sum(acc["causes"].values())
    acc["served_share"] = acc["served_tokens"] / total if total else None
    acc["ceiling_share"] = acc["ceiling_tokens"] / total if total else None
    acc["cause_shares"] = {c: (t / total if total else None) for c, t in acc["causes"].items()}
    return acc


def attribute_rows(rows: list[dict], *, block_tokens: int, page_size: int, recent: int = 0) -> dict:
    """Split ``rows`` (one pool's recorded traffic in arrival order: ``worker`` (name), ``input_length``,
    ``output_length``, ``hash_ids``, ``output_hash_ids``, ``misses``) into causes per worker and for the
    fleet. Returns ``{"fleet": figures, "workers": {name: figures}}``; figures: ``requests``,
    ``attributed_requests`` (rows with the worker's attribution), over those: ``input_tokens``,
    ``served_tokens`` (input less misses), ``miss_tokens``, ``causes`` ({cause: tokens}, every one of
    :data:`MISS_CAUSES`, summing to ``miss_tokens``), ``ceiling_tokens`` (what a fleet-wide unbounded cache
    would have served them), and the same as shares of ``input_tokens`` (None when it is 0). With
    ``recent`` > 0, each figures also has ``recent``: the newest ``recent`` attributed requests of that worker
    (of the pool for ``fleet``), newest first, each as figures of its own (``requests`` 1) plus ``worker``
    and ``arrived_ms`` (the row's, when it carries one: ms since the epoch)."""
    P = page_size
    latest: dict[str, deque] = {}  # worker name ("" for the fleet) -> its newest attributed requests
    computed: dict[int, set[str]] = {}  # page id -> workers that computed it
    fleet, workers = _empty(), {}
    for row in rows:
        name = row["worker"]
        acc = workers.setdefault(name, _empty())
        req = TraceRequest(
            0.0, row["input_length"], row["output_length"], tuple(row["hash_ids"]), name,
            tuple(row.get("output_hash_ids") or ()),
        )  # fmt: skip
        keys = page_keys(req, req.input_length, block_tokens, P)
        misses = row.get("misses") or {}
        for target in (acc, fleet):
            target["requests"] += 1
        if misses.get("causes") is not None:
            match = keys[: max(req.input_length - 1, 0) // P]
            hit = next((i for i, page in enumerate(match) if page not in computed), len(match))
            causes = dict(misses["causes"])
            moved = {"new": 0, "elsewhere": 0}
            for start, end in misses.get("unseen") or ():
                for k in range(start // P, end // P):
                    owners = computed.get(keys[k])
                    cause = "new" if owners is None else "elsewhere" if owners - {name} else None
                    if cause is not None:
                        moved[cause] += P
            stays = causes.get("not_seen_here", 0) - moved["new"] - moved["elsewhere"]
            causes.update(moved, not_seen_here=stays)
            one = _empty()
            served = req.input_length - sum(misses["causes"].values())
            # what the worker served was computed before, if not in the rows (traffic before them, or not
            # recorded): an unbounded cache would serve it too, so the ceiling is never under it
            ceiling = max(hit * P, served)
            for target in (acc, fleet, one):
                target["attributed_requests"] += 1
                target["input_tokens"] += req.input_length
                target["served_tokens"] += served
                target["ceiling_tokens"] += ceiling
                for cause, tokens in causes.items():
                    target["causes"][cause] = target["causes"].get(cause, 0) + tokens
            if recent > 0:
                one.update(requests=1, worker=name, arrived_ms=row.get("arrived_ms"))
                for key in (name, ""):
                    latest.setdefault(key, deque(maxlen=recent)).append(one)
        for page in (*keys, *output_page_keys(req, block_tokens, P)):
            computed.setdefault(page, set()).add(name)
    if recent > 0:
        for key, figures in (("", fleet), *workers.items()):
            figures["recent"] = [_finish(one) for one in reversed(latest.get(key, ()))]
    return {"fleet": _finish(fleet), "workers": {n: _finish(w) for n, w in sorted(workers.items())}}


def pool_misses(*, pool: str, since_ms: int | None = None, recent: int = 0) -> dict:
    """The pool's recorded traffic (``selectors.recorded_trace_lines``, from ``since_ms`` when given)
    attributed per worker and for the pool (:func:`attribute_rows`, with its ``recent`` newest requests
    each) at the pool's ``--page-size``, with
    ``causes``: the order of :data:`MISS_CAUSES` and ``pool``, ``requests``, ``block_tokens`` and
    ``page_size``; workers of the pool with no recorded rows are not listed."""
    from controlplane.capacity import selectors

    rows = selectors.recorded_trace_lines(pool=pool, since_ms=since_ms, with_misses=True)
    block_tokens = selectors.recorded_block_tokens(pool=pool)
    page_size = selectors.pool_page_size(pool=pool)
    if rows and (block_tokens % page_size and page_size % block_tokens):
        raise ValueError(f"page size {page_size} and block size {block_tokens}: neither divides the other")
    out = attribute_rows(rows, block_tokens=block_tokens or page_size, page_size=page_size, recent=recent)
    return {
        "pool": pool,
        "causes": list(MISS_CAUSES),
        "block_tokens": block_tokens,
        "page_size": page_size,
        **out,
    }


TENANT_QUERIES = {
    "prompt": "sum by (worker, tenant) (sglang:tenant_prompt_tokens_total)",
    "cached": "sum by (worker, tenant) (sglang:tenant_cached_tokens_total)",
    "miss": "sum by (worker, tenant, cause) (sglang:tenant_miss_tokens_total)",
}


def tenant_misses(workers: list[str]) -> list[dict]:
    """Per tenant (the workers' ``tenant`` label of a cache salt), from the TSDB's newest scrape of the
    workers named ``workers`` (counters since each started): ``tenant``, ``input_tokens`` (prompt tokens
    admitted), ``served_tokens``, ``miss_tokens``, ``causes`` ({cause: tokens} of the worker's causes; the
    fleet's ``new`` / ``elsewhere`` None: the recorded traffic names no tenant, so its ``not_seen_here``
    stays whole) and the shares; ``ceiling_share`` None (no trace per tenant), and ``workers``: the same
    per worker. Raises ``promql.PromQLError`` when the TSDB does not answer."""
    from controlplane.telemetry.promql import PromQL

    if not workers:
        return []
    client = PromQL()
    names = set(workers)
    table: dict[tuple[str, str], dict] = {}
    for kind, expr in TENANT_QUERIES.items():
        for item in client.query(expr):
            labels = item["labels"]
            worker, tenant = labels.get("worker"), labels.get("tenant")
            if worker not in names or not tenant:
                continue
            acc = table.setdefault((tenant, worker), {"prompt": 0.0, "cached": 0.0, "causes": {}})
            if kind == "miss":
                cause = labels.get("cause", "")
                acc["causes"][cause] = acc["causes"].get(cause, 0.0) + item["value"]
            else:
                acc[kind] += item["value"]

    def figures(parts: list[dict]) -> dict:
        causes = dict.fromkeys(MISS_CAUSES, 0)
        for part in parts:
            for cause, tokens in part["causes"].items():
                causes[cause] = causes.get(cause, 0) + int(tokens)
        causes["new"] = causes["elsewhere"] = None
        total = int(sum(p["prompt"] for p in parts))
        out = {
            "input_tokens": total,
            "served_tokens": int(sum(p["cached"] for p in parts)),
            "miss_tokens": sum(t for t in causes.values() if t is not None),
            "causes": causes,
            "ceiling_share": None,
        }
        out["served_share"] = out["served_tokens"] / total if total else None
        out["cause_shares"] = {c: (t / total if total and t is not None else None) for c, t in causes.items()}
        return out

    rows = []
    for tenant in sorted({t for t, _ in table}):
        mine = {w: acc for (t, w), acc in table.items() if t == tenant}
        rows.append(
            {
                "tenant": tenant,
                **figures(list(mine.values())),
                "workers": {w: figures([acc]) for w, acc in sorted(mine.items())},
            }
        )
    return rows
