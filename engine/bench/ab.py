"""Same-run A/B of the decode step between a git revision and the working tree.

``python -m engine.bench.ab [--base main] [--reps 6] -- DECODE_PROFILE_ARGS``

e.g. ``python -m engine.bench.ab --base main --reps 6 -- --batch 4 --context 512 --steps 8 --variants
float32@2 bfloat16+int8wo@2``. ``--base`` is checked out into a temporary detached git worktree (removed at
the end); each repetition runs ``python -m engine.bench.decode_profile --no-breakdown --rounds 1 ARGS`` once
in the base tree and once in this tree, in alternating order, each in a fresh process of this interpreter
(the model is loaded by each). For every variant line of decode_profile's output it prints the wall ms per
step of both trees (median over repetitions) and the ratio this tree / base within each repetition, median
(min-max), with the load average after each repetition. Below 1.00 means this tree is faster.

Raises ``subprocess.CalledProcessError`` (with the child's output) when a run or ``git worktree`` fails.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

REPO = Path(__file__).resolve().parents[2]
T = TypeVar("T")


def alternate(base_rev: str, reps: int, run: Callable[[Path], T]) -> dict[str, list[T]]:
    """``run(tree)`` ``reps`` times in a temporary detached git worktree of ``base_rev`` and as often in this
    tree, alternating which goes first (A B, B A, ...) so a load change hits both alike; prints the load
    average after each repetition. Returns ``{"base": [...], "this": [...]}`` in repetition order. The
    worktree is removed at the end; raises ``subprocess.CalledProcessError`` when ``git worktree`` fails."""
    out: dict[str, list[T]] = {"base": [], "this": []}
    with tempfile.TemporaryDirectory(prefix="kvfleet-ab-") as tmp:
        base = Path(tmp) / "base"
        git = ["git", "-C", str(REPO), "worktree"]
        subprocess.run([*git, "add", "--detach", str(base), base_rev], check=True, capture_output=True)
        try:
            trees = {"base": base, "this": REPO}
            for rep in range(reps):
                for name in ("base", "this") if rep % 2 == 0 else ("this", "base"):
                    out[name].append(run(trees[name]))
                print(f"repetition {rep}: load {os.getloadavg()[0]:.1f}", flush=True)
        finally:
            subprocess.run([*git, "remove", "--force", str(base)], check=True)
    return out


def run_profile(tree: Path, args: list[str]) -> dict[str, float]:
    """Wall ms per step of each variant decode_profile prints, run in ``tree``."""
    cmd = [sys.executable, "-m", "engine.bench.decode_profile", "--no-breakdown", "--rounds", "1", *args]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, check=True).stdout
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("variant "))
    return {line.split()[0]: float(line.split()[1]) for line in lines[start + 1 :] if line.strip()}


def main() -> None:
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default="main", help="git revision to compare against")
    ap.add_argument("--reps", type=int, default=6)
    args = ap.parse_args(argv[:split])
    profile_args = argv[split + 1 :]
    runs = alternate(args.base, args.reps, lambda tree: run_profile(tree, profile_args))
    ms: dict[str, dict[str, list[float]]] = {"base": {}, "this": {}}
    for name, results in runs.items():
        for result in results:
            for variant, value in result.items():
                ms[name].setdefault(variant, []).append(value)
    print(f"\nbase {args.base} vs this tree, {args.reps} repetitions")
    print(f"decode_profile {' '.join(profile_args)}")
    print(f"{'variant':<22}{'base ms/step':>14}{'this ms/step':>14}   this / base (median, min-max)")
    for variant, base_ms in ms["base"].items():
        this_ms = ms["this"][variant]
        ratios = [t / b for t, b in zip(this_ms, base_ms, strict=True)]
        spread = f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})"
        base_med, this_med = statistics.median(base_ms), statistics.median(this_ms)
        print(f"{variant:<22}{base_med:>14.1f}{this_med:>14.1f}   {spread}")


if __name__ == "__main__":
    main()
