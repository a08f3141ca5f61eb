"""One capacity point's result as a JSON-ready dict and as text lines."""

from __future__ import annotations

import math

from engine.whatif.costs import Costs
from engine.whatif.replay import Capacities, ReplayCounters


def _cap(tokens: float) -> int | str:
    return "inf" if math.isinf(tokens) else int(tokens)


def point_result(
    caps: Capacities,
    c: ReplayCounters,
    *,
    page_size: int,
    bytes_per_token: int,
    costs: Costs | None,
    replay_s: float,
    ceiling_share: float | None = None,
    optimum: ReplayCounters | None = None,
) -> dict:
    """Capacities, per-tier ``tokens_served`` / ``share`` (of all input tokens) and page and byte counts,
    the TTFT saving estimate (None without costs), the replay's wall time and ``ceiling_share``: the
    trace's share with an unbounded cache (:func:`engine.whatif.replay.ceiling_share`; None when not
    computed), the same for every point of a sweep. ``workers``: per worker of a trace that names them
    (each replayed with its own L1 and L2 at these capacities, one L3 shared), its input tokens and tokens
    served per tier; {} for a trace that does not.

    ``optimum`` (the same point replayed with Belady's MIN, :mod:`engine.whatif.belady`; None when not
    replayed): ``{"share", "l1_share", "l2_share", "l3_share", "workers": {name: share of its input}}``,
    and ``lost``: the ceiling's gap at this point in shares of all input tokens, ``{"capacity":
    ceiling - optimum (what no eviction policy keeps at these capacities), "policy": optimum - share (what a
    better policy would keep; negative if this policy beat the reference)}``; both None without the
    optimum, ``capacity`` None without the ceiling."""
    total = max(c.input_tokens, 1)
    page_bytes = page_size * bytes_per_token
    out = {
        "l1_tokens": _cap(caps.l1),
        "l2_tokens": _cap(caps.l2),
        "l3_tokens": _cap(caps.l3),
        "requests": c.requests,
        "rejected": c.rejected,
        "input_tokens": c.input_tokens,
        "l1": {
            "tokens_served": c.served_l1,
            "share": c.served_l1 / total,
            "pages_evicted": c.evicted_l1_pages,
        },
        "l2": {
            "tokens_served": c.served_l2,
            "share": c.served_l2 / total,
            "pages_loaded_back": c.loaded_back_pages,
            "pages_written": c.written_l2_pages,
            "pages_evicted": c.evicted_l2_pages,
            "bytes_loaded_back": c.loaded_back_pages * page_bytes,
            "bytes_written": c.written_l2_pages * page_bytes,
        },
        "l3": {
            "tokens_served": c.served_l3,
            "share": c.served_l3 / total,
            "pages_prefetched": c.prefetched_pages,
            "pages_written": c.written_l3_pages,
            "pages_evicted": c.evicted_l3_pages,
            "bytes_prefetched": c.prefetched_pages * page_bytes,
            "bytes_written": c.written_l3_pages * page_bytes,
        },
        "share": (c.served_l1 + c.served_l2 + c.served_l3) / total,
        "ceiling_share": ceiling_share,
        "bytes_per_token": bytes_per_token,
        "ttft_saving": None,
        "replay_s": round(replay_s, 3),
        # a trace naming its workers is replayed per worker (own L1 / L2, shared L3): each one's figures
        "workers": {
            name: {"input_tokens": n, "l1_tokens_served": l1, "l2_tokens_served": l2, "l3_tokens_served": l3}
            for name, (n, l1, l2, l3) in c.workers.items()
        },
    }
    out["optimum"], out["lost"] = None, {"capacity": None, "policy": None}
    if optimum is not None:
        best = optimum.served_l1 + optimum.served_l2 + optimum.served_l3
        out["optimum"] = {
            "share": best / total,
            "l1_share": optimum.served_l1 / total,
            "l2_share": optimum.served_l2 / total,
            "l3_share": optimum.served_l3 / total,
            "workers": {
                name: (l1 + l2 + l3) / max(n, 1) for name, (n, l1, l2, l3) in optimum.workers.items()
            },
        }
        out["lost"] = {
            "capacity": None if ceiling_share is None else ceiling_share - best / total,
            "policy": out["optimum"]["share"] - out["share"],
        }
    if costs is not None:
        saved = sum(costs.saving_s(s, bytes_per_token) for s in c.per_request_served)
        out["ttft_saving"] = {
            "total_s": saved,
            "mean_ms_per_request": 1e3 * saved / max(c.requests, 1),
            "prefill_s_per_token": costs.prefill_s_per_token,
            "l2_bytes_per_s": costs.l2_bytes_per_s,
            "l3_bytes_per_s": costs.l3_bytes_per_s,
            "measured": list(costs.measured),
        }
    return out


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"


def ceiling_line(share: float) -> str:
    """The sweep's header: what an unbounded cache would serve."""
    return (
        f"ceiling: {share:.1%} of input tokens repeat at all (an unbounded cache serves that much; "
        "no capacity or policy serves more)"
    )


def text_lines(r: dict) -> list[str]:
    """A human-readable block for one point."""
    lines = [
        f"L1 {r['l1_tokens']} / L2 {r['l2_tokens']} / L3 {r['l3_tokens']} tokens: "
        f"{r['share']:.1%} of {r['input_tokens']:,} input tokens served from cache "
        f"({r['requests']:,} requests, {r['rejected']} too long for L1, replay {r['replay_s']:.2f} s)"
        + (
            f", per worker: {len(r['workers'])} workers, each with these L1 and L2, one shared L3"
            if r.get("workers")
            else ""
        ),
        f"  L1 {r['l1']['tokens_served']:>14,} tokens {r['l1']['share']:7.2%}",
        f"  L2 {r['l2']['tokens_served']:>14,} tokens {r['l2']['share']:7.2%}   "
        f"loaded back {r['l2']['pages_loaded_back']:,} pages ({_gb(r['l2']['bytes_loaded_back'])}), "
        f"written {r['l2']['pages_written']:,} pages ({_gb(r['l2']['bytes_written'])})",
        f"  L3 {r['l3']['tokens_served']:>14,} tokens {r['l3']['share']:7.2%}   "
        f"prefetched {r['l3']['pages_prefetched']:,} pages ({_gb(r['l3']['bytes_prefetched'])}), "
        f"written {r['l3']['pages_written']:,} pages ({_gb(r['l3']['bytes_written'])})",
    ]
    o, lost = r.get("optimum"), r.get("lost") or {}
    if o is not None:
        line = (
            f"  optimum (Belady's MIN) {o['share']:7.2%}: a better policy would serve {lost['policy']:+.2%}"
        )
        if lost.get("capacity") is not None:
            line += f", no policy serves the {lost['capacity']:.2%} up to the ceiling at these capacities"
        lines.append(line)
    t = r["ttft_saving"]
    if t is not None:
        lines.append(
            f"  est. TTFT saving {t['mean_ms_per_request']:.1f} ms/request, {t['total_s']:.1f} s in all "
            f"(prefill {1e6 * t['prefill_s_per_token']:.1f} us/token, "
            f"L2 {t['l2_bytes_per_s'] / 1e9:.1f} GB/s, "
            f"L3 {t['l3_bytes_per_s'] / 1e9:.1f} GB/s)"
        )
    return lines
