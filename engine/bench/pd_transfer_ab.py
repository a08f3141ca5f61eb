"""Same-run A/B of the PD KV transfer (``engine.bench.pd_transfer``) between a git revision and this tree.

``python -m engine.bench.pd_transfer_ab [--base main] [--reps 4] -- PD_TRANSFER_ARGS``

``--base`` is checked out into a temporary detached git worktree (removed at the end); each repetition runs
``python -m engine.bench.pd_transfer ARGS`` once in the base tree and once in this tree, in alternating
order, each in a fresh process. For every case row it prints both trees' engine ms (p50 over the trials,
median over repetitions), the ratio this / base of those within each repetition (median, min-max; below
1.00 this tree is faster) and both trees' raw/engine ratio (the transfer against a raw TransferEngine write
of the same pages in the same process: the load-independent figure), with the load average.

Raises ``subprocess.CalledProcessError`` (with the child's output) when a run or ``git worktree`` fails.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

from engine.bench.ab import alternate


def run_bench(tree: Path, args: list[str]) -> dict[str, tuple[float, float]]:
    """Case -> (engine ms p50, raw/engine best ratio) of ``engine.bench.pd_transfer`` run in ``tree``."""
    cmd = [sys.executable, "-m", "engine.bench.pd_transfer", *args]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, check=True).stdout
    rows = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 11 and cells[0].isdigit():
            rows[f"{cells[0]} tok, page {cells[1]}, {cells[2]}"] = (float(cells[7]), float(cells[9]))
    return rows


def main() -> None:
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default="main", help="git revision to compare against")
    ap.add_argument("--reps", type=int, default=4)
    args = ap.parse_args(argv[:split])
    bench_args = argv[split + 1 :]
    runs = alternate(args.base, args.reps, lambda tree: run_bench(tree, bench_args))
    print(f"\nbase {args.base} vs this tree, {args.reps} repetitions, pd_transfer {' '.join(bench_args)}")
    print(
        "| case | base engine ms | this engine ms | this / base (median, min-max) | raw/engine base | this |"
    )
    print("|---|---:|---:|---|---:|---:|")
    for case in runs["base"][0]:
        b = [r[case] for r in runs["base"]]
        t = [r[case] for r in runs["this"]]
        ratios = [x[0] / y[0] for x, y in zip(t, b, strict=True)]
        print(
            f"| {case} | {statistics.median(x[0] for x in b):.1f} | {statistics.median(x[0] for x in t):.1f} "
            f"| {statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}) "
            f"| {statistics.median(x[1] for x in b):.2f} | {statistics.median(x[1] for x in t):.2f} |"
        )


if __name__ == "__main__":
    main()
