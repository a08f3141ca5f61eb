"""Torch/OpenMP thread settings for a decode step, each in a fresh process, interleaved.

``python -m engine.bench.threads [--batch 1] [--reps 3]``

OpenMP reads its thread count and wait policy once, when torch loads it, so every setting runs in its own
``python -m engine.bench.decode_profile --no-breakdown --variants float32@N`` process with its environment:
2 threads with libgomp's default wait (spin, then sleep), 2 threads with ``OMP_WAIT_POLICY=PASSIVE`` (sleep
at once), and 1 thread. Repetitions alternate the order; printed: wall ms per decode step (median over
repetitions) and the ratio to the first setting in the same repetition, median (min-max), with the load
average seen after each repetition.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

SETTINGS = (
    ("2 threads, libgomp default wait", "float32@2", ""),
    ("2 threads, OMP_WAIT_POLICY=PASSIVE", "float32@2", "PASSIVE"),
    ("1 thread", "float32@1", ""),
)


def step_ms(spec: str, wait_policy: str, batch: int, context: int) -> float:
    """Wall ms per decode step of one fresh process running variant ``spec``."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")}
    if wait_policy:
        env["OMP_WAIT_POLICY"] = wait_policy
    cmd = [sys.executable, "-m", "engine.bench.decode_profile", "--no-breakdown", "--batch", str(batch)]
    cmd += ["--context", str(context), "--steps", "8", "--rounds", "1", "--variants", spec]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, check=True).stdout
    return float(next(line for line in out.splitlines() if line.startswith(spec)).split()[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    wall: dict[str, list[float]] = {name: [] for name, _, _ in SETTINGS}
    ratios: dict[str, list[float]] = {name: [] for name, _, _ in SETTINGS}
    for rep in range(args.reps):
        this = {}
        for name, spec, policy in SETTINGS if rep % 2 == 0 else SETTINGS[::-1]:
            this[name] = step_ms(spec, policy, args.batch, args.context)
            wall[name].append(this[name])
        for name in this:
            ratios[name].append(this[name] / this[SETTINGS[0][0]])
        print(f"repetition {rep}: load average {os.getloadavg()[0]:.1f}", flush=True)
    print(f"\nbatch {args.batch}, context {args.context}, {args.reps} repetitions")
    print(f"{'setting':<38}{'wall ms/step':>14}   vs {SETTINGS[0][0]} (median, min-max)")
    for name, rs in ratios.items():
        spread = f"{statistics.median(rs):.2f} ({min(rs):.2f}-{max(rs):.2f})"
        print(f"{name:<38}{statistics.median(wall[name]):>14.1f}   {spread}")


if __name__ == "__main__":
    main()
