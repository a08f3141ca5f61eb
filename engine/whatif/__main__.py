"""``python -m engine.whatif TRACE``: how much of a trace's input each cache tier would serve.

Replays a Mooncake-format trace through :class:`engine.whatif.replay.ReplayCache` once per capacity point
(the cross product of the ``--l1-tokens`` / ``--l2-tokens`` / ``--l3-tokens`` lists) and prints per tier
tokens served, share of input tokens, pages moved, bytes moved and an estimated TTFT saving, after one
line with the trace's ceiling (the share an unbounded cache serves); ``--json`` prints one JSON object
per point instead, each with the ceiling as ``ceiling_share``. ``--optimum`` replays each point a second
time with Belady's MIN (:mod:`engine.whatif.belady`: the offline optimum at that capacity) and reports it
beside the policy, with the gap to the ceiling split into what no policy keeps and what a better one would
(``--eviction belady`` replays the optimum alone). Exit status 2 with a message naming the flag on bad
input.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time

from engine.cache.config import ADMISSIONS, EVICTION_POLICIES, WRITE_POLICIES
from engine.whatif.belady import OPTIMUM
from engine.whatif.costs import Costs, measure_l2_bandwidth, measure_l3_bandwidth, measure_prefill
from engine.whatif.replay import Capacities, ceiling_share, replay_trace
from engine.whatif.report import ceiling_line, point_result, text_lines
from engine.whatif.trace import TraceError, load_trace


def capacity_list(text: str) -> list[float]:
    """``"0,1e6,inf"`` -> ``[0, 1000000, inf]`` (tokens; ``inf`` = unbounded)."""
    values = []
    for item in text.split(","):
        item = item.strip().lower()
        try:
            value = math.inf if item == "inf" else float(item)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item!r} is not a token count or inf") from None
        if value < 0 or (not math.isinf(value) and value != int(value)):
            raise argparse.ArgumentTypeError(f"{item!r} must be a whole number of tokens >= 0, or inf")
        values.append(value if math.isinf(value) else int(value))
    return values


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def l2_for_ratio(l1_tokens: float, ratio: float, page_size: int) -> float:
    """The host pool ``--hicache-ratio`` gives an L1 of ``l1_tokens`` (tokens; ``inf`` stays unbounded):
    ``engine.cache.host_pool.requested_host_tokens``, the engine's own rounding."""
    from engine.cache.host_pool import requested_host_tokens

    if math.isinf(l1_tokens):
        return math.inf
    return requested_host_tokens(int(l1_tokens), page_size, 1, ratio, 0)


def skip_line(caps: Capacities, message: str) -> str:
    """One short line for a sweep point the engine would refuse: the point, then why."""
    point = " / ".join(f"L{i} {v:g}" for i, v in enumerate((caps.l1, caps.l2, caps.l3), 1))
    if caps.l2 and not caps.l2 > caps.l1:
        return f"{point}: L2 must be larger than L1"
    if caps.l3 and not caps.l2:
        return f"{point}: L3 needs an L2"
    return f"{point}: {message}"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m engine.whatif", description=__doc__.split("\n\n")[0])
    a = p.add_argument
    a("trace", help="Mooncake-format JSONL trace")
    a("--block-tokens", type=positive_int, default=512, help="tokens per hash_ids block of the trace")
    a("--page-size", type=positive_int, default=16, help="the worker's --page-size (tokens; the demo's 16)")
    a("--l1-tokens", type=capacity_list, default=[1_000_000], help="L1 tokens, or a comma list to sweep")
    a("--l2-tokens", type=capacity_list, default=None, help="L2 tokens (0 = no host tier, inf = unbounded)")
    a(
        "--hicache-ratio",
        type=positive_float,
        default=None,
        help="instead of --l2-tokens: L2 = this x each L1 point, in whole pages, as the engine sizes it",
    )
    a("--l3-tokens", type=capacity_list, default=[0], help="L3 tokens (0 = no storage tier, inf = unbounded)")
    a(
        "--eviction",
        choices=(*EVICTION_POLICIES, OPTIMUM),
        default="lru",
        help=f"--radix-eviction-policy ({OPTIMUM}: the offline optimum, no engine policy)",
    )
    a("--optimum", action="store_true", help=f"also replay each point with {OPTIMUM} (Belady's MIN)")
    a("--write-policy", choices=WRITE_POLICIES, default="write_through", help="--hicache-write-policy")
    a("--l2-admission", choices=ADMISSIONS, default="none", help="extra config l2_admission (tinylfu)")
    a("--l3-admission", choices=ADMISSIONS, default="none", help="extra config l3_admission (tinylfu)")
    a("--prefetch-threshold", type=int, default=256, help="L3 prefetch threshold (tokens)")
    a(
        "--kv-bytes-per-token",
        type=positive_int,
        default=None,
        help="KV bytes per token (else from --model-path)",
    )
    a("--model-path", default="smollm2", help="model whose config gives the KV bytes per token")
    a("--kv-cache-dtype", default="bfloat16", help="dtype of the KV cache for the bytes per token")
    a("--prefill-us-per-token", type=positive_float, default=None, help="else measured with --model-path")
    a("--l2-gbps", type=positive_float, default=None, help="L2 -> L1 GB/s (else measured on this host)")
    a("--l3-gbps", type=positive_float, default=None, help="L3 -> L2 GB/s (else measured on this host)")
    a("--no-ttft", action="store_true", help="skip the TTFT estimate (and its measurements)")
    a("--json", action="store_true", help="one JSON object per capacity point per line")
    return p


def resolve_costs(args: argparse.Namespace, bytes_per_token: int) -> Costs | None:
    if args.no_ttft:
        return None
    measured = []
    if args.prefill_us_per_token is None:
        prefill = measure_prefill(args.model_path)
        measured.append("prefill")
    else:
        prefill = args.prefill_us_per_token / 1e6
    if args.l2_gbps is None:
        l2 = measure_l2_bandwidth()
        measured.append("l2")
    else:
        l2 = args.l2_gbps * 1e9
    if args.l3_gbps is None:
        l3 = measure_l3_bandwidth(args.page_size * bytes_per_token)
        measured.append("l3")
    else:
        l3 = args.l3_gbps * 1e9
    return Costs(prefill, l2, l3, tuple(measured))


def replay_point(reqs: list, caps: Capacities, args: argparse.Namespace, eviction: str):
    """One replay of ``reqs`` at ``caps`` with the parsed flags and eviction policy ``eviction``."""
    return replay_trace(
        reqs,
        caps,
        block_tokens=args.block_tokens,
        page_size=args.page_size,
        eviction_policy=eviction,
        write_policy=args.write_policy,
        prefetch_threshold=args.prefetch_threshold,
        l2_admission=args.l2_admission,
        l3_admission=args.l3_admission,
    )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    b, p = args.block_tokens, args.page_size
    if b % p and p % b:
        parser.error(f"--page-size {p}: must divide --block-tokens {b} or be a multiple of it")
    if args.hicache_ratio is not None and args.l2_tokens is not None:
        parser.error("--hicache-ratio: give it or --l2-tokens, not both")
    if args.hicache_ratio is not None:  # L2 follows each L1 point, as the engine's flags size it
        pairs = [(l1, l2_for_ratio(l1, args.hicache_ratio, p)) for l1 in args.l1_tokens]
    else:
        pairs = list(itertools.product(args.l1_tokens, args.l2_tokens or [0]))
    points, errors = [], []
    for caps in (Capacities(l1, l2, l3) for (l1, l2), l3 in itertools.product(pairs, args.l3_tokens)):
        try:
            caps.check()
            points.append(caps)
        except ValueError as exc:
            errors.append((caps, str(exc)))
    if not points:
        parser.error(errors[0][1])
    for caps, message in errors:  # a sweep skips the impossible combinations it crosses, one short line each
        print(f"skipped sweep points: {skip_line(caps, message)}", file=sys.stderr)
    try:
        reqs = load_trace(args.trace, b)
    except TraceError as exc:
        parser.error(f"trace: {exc}")
    bytes_per_token = args.kv_bytes_per_token
    if bytes_per_token is None:
        from engine.model.errors import ModelLoadError
        from engine.sizing.kv import model_kv_shape

        try:
            bytes_per_token = model_kv_shape(args.model_path, args.kv_cache_dtype).bytes_per_token
        except (ModelLoadError, ValueError) as exc:
            parser.error(f"--model-path / --kv-cache-dtype: {exc}")
    costs = resolve_costs(args, bytes_per_token)
    ceiling = ceiling_share(reqs, block_tokens=b, page_size=p)
    if not args.json:
        print(ceiling_line(ceiling), flush=True)
    for caps in points:
        start = time.perf_counter()
        counters = replay_point(reqs, caps, args, args.eviction)
        optimum = None
        if args.optimum:  # Belady's MIN at the same point (the point itself when it is the policy)
            optimum = counters if args.eviction == OPTIMUM else replay_point(reqs, caps, args, OPTIMUM)
        result = point_result(
            caps,
            counters,
            page_size=p,
            bytes_per_token=bytes_per_token,
            costs=costs,
            replay_s=time.perf_counter() - start,
            ceiling_share=ceiling,
            optimum=optimum,
        )
        if args.json:
            print(json.dumps(result), flush=True)
        else:
            print("\n".join(text_lines(result)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
