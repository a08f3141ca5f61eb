"""CPU cost of the control plane's fleet miss split (``controlplane/capacity/misses.py``) on a large trace.

``python -m controlplane.bench.miss_split [--trace conversation_trace.jsonl] [--page-size 64] [--workers 4]``

Mooncake's trace as a pool's recorded traffic: requests dealt round-robin to ``--workers`` workers, each row
with the attribution a worker that never kept anything would report (every whole matchable page
``not_seen_here``, the rest ``partial_page``), so every page of every request goes through the split.
Prints the rows, the process CPU time of :func:`attribute_rows`, per row and per page, the fleet's causes,
and whether they add up to the misses. No database: the rows are built in memory.
"""

from __future__ import annotations

import argparse
import time

from controlplane.capacity.misses import attribute_rows
from engine.whatif.trace import SHARED_TRACE_DIR, load_trace


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default="conversation_trace.jsonl")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--workers", type=int, default=4)
    args = ap.parse_args(argv)
    P, rows, pages = args.page_size, [], 0
    for i, r in enumerate(load_trace(SHARED_TRACE_DIR / args.trace)):
        aligned = max(r.input_length - 1, 0) // P * P
        pages += aligned // P
        misses = {"causes": {"not_seen_here": aligned, "partial_page": r.input_length - aligned},
                  "unseen": [[0, aligned]] if aligned else []}  # fmt: skip
        row = {"worker": f"w{i % args.workers}", "input_length": r.input_length,
               "output_length": r.output_length, "hash_ids": list(r.hash_ids)}  # fmt: skip
        rows.append({**row, "misses": misses})
    start = time.process_time()
    out = attribute_rows(rows, block_tokens=512, page_size=P)
    cpu = time.process_time() - start
    fleet = out["fleet"]
    causes = {c: t for c, t in fleet["causes"].items() if t}
    print(f"{len(rows):,} rows, {pages:,} missed pages, page {P}: {cpu:.2f} s CPU "
          f"({1e3 * cpu / len(rows):.3f} ms/row, {1e6 * cpu / max(pages, 1):.2f} us/page)")  # fmt: skip
    exact = fleet["miss_tokens"] == fleet["input_tokens"] - fleet["served_tokens"]
    print(f"causes {causes}; add up to the misses: {exact}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
