"""The console's one hit rate, written once: prompt tokens served from cache over prompt tokens admitted.

``hit rate = Δ sglang:cached_tokens_total (every tier) / Δ sglang:prompt_tokens_total`` over the last
``WINDOW_S`` seconds (``WINDOW_TEXT``), each Δ the counter's exact increase in the TSDB (:func:`increase`:
newest less oldest scrape in the window, no extrapolation), as the latency rules take their 5 min. A pool's is
the same ratio of its workers' summed increases (a token-weighted mean, never a mean of ratios); a tier's part
(``hit_rate_device`` / ``_host`` / ``_storage``) is that tier's cached increase over the same prompt increase,
so the parts add up to the hit rate. The tenant table takes the same ratio of the per-tenant counters
(``sglang:tenant_*``) over the same window.

Every page that shows a hit rate (the fleet's pool cards and worker table, the worker page's chart and its
tenant table) reads it through :func:`ratio` of figures built by :func:`increase`, so they show one number
for one window. (The P:D planner's pool hit rate is the same ratio over the planner's own window, which
its page names.)
"""

from __future__ import annotations

from controlplane.telemetry.metrics import TIERS

WINDOW_S = 300.0
WINDOW_TEXT = "last 5 min"
PROMPT = "hit_prompt_tokens"  # figure key: prompt tokens admitted in the window
CACHED = {t: f"hit_cached_tokens_{t}" for t in TIERS}  # figure keys: prompt tokens served from each tier
NO_PROMPT = f"no prompt token admitted in the {WINDOW_TEXT}"
NO_WINDOW = f"no prompt-token counter (sglang:prompt_tokens_total) with two scrapes in the {WINDOW_TEXT}"


def increase(selector: str, by: str = "worker") -> str:
    """PromQL: the exact increase of the counter ``selector`` (a metric with its label matchers) over
    ``WINDOW_S``, summed by the labels ``by``: per series its newest less its oldest scrape in the window
    (none when it restarted in it or has fewer than two scrapes in it); a series born in the window (a
    tenant's first request, an engine that exports a counter from its first increment) while its worker
    was already scraped before the window counts from 0, so its first tokens are not lost."""
    w = f"{WINDOW_S:g}s"
    window = f"{selector}[{w}]"
    born = (
        f"(max_over_time({window}) unless {selector} offset {w})"
        f' and on (worker) (up{{worker!=""}} offset {w} == 1)'
    )
    kept = f"(max_over_time({window}) - min_over_time({window})) and count_over_time({window}) > 1"
    return f"sum by ({by}) ((({born}) or ({kept})) and resets({window}) == 0)"


def figures(matchers: str = "") -> dict[str, str]:
    """``{figure key: PromQL}``: the window's prompt tokens and cached tokens per tier, by worker, for the
    workers ``matchers`` selects (label matchers without braces; "" for all)."""
    sep = "," if matchers else ""
    return {
        PROMPT: increase(f"sglang:prompt_tokens_total{{{matchers}}}"),
        **{
            key: increase(f'sglang:cached_tokens_total{{{matchers}{sep}cache_source="{tier}"}}')
            for tier, key in CACHED.items()
        },
    }


def ratio(cached: float | None, prompt: float | None) -> float | None:
    """``cached / prompt`` (0..1; clipped at 1 for a worker whose cached counter ran ahead of its prompt
    counter between two scrapes); None without either figure or with no prompt token."""
    if cached is None or prompt is None or prompt <= 0:
        return None
    return min(1.0, max(0.0, cached / prompt))


def rates(samples: list[dict]) -> dict:
    """The hit rate of ``samples`` (one or several workers' figures carrying the keys of :func:`figures`)
    taken together: ``{hit_rate, hit_rate_<tier>..., hit_prompt_tokens, hit_cached_tokens}`` (rates 0..1,
    None when no sample has both the prompt figure and a tier's, or no prompt token came in) and
    ``absent`` (figure -> why, for each None)."""
    both = [
        s for s in samples if s.get(PROMPT) is not None and any(s.get(k) is not None for k in CACHED.values())
    ]
    prompt = sum(float(s[PROMPT]) for s in both) if both else None
    tiers = {t: sum(float(s.get(k) or 0.0) for s in both) if both else None for t, k in CACHED.items()}
    cached = sum(v for v in tiers.values() if v is not None) if both else None
    out: dict = {"hit_rate": ratio(cached, prompt), "hit_prompt_tokens": prompt, "hit_cached_tokens": cached}
    for tier, value in tiers.items():
        out[f"hit_rate_{tier}"] = ratio(value, prompt)
    why = NO_WINDOW if not both else NO_PROMPT
    out["absent"] = {k: why for k, v in out.items() if k.startswith("hit_rate") and v is None}
    return out
