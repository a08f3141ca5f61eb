"""Upstream SGLang workers in tests: its environment, the demo model as an HF folder, and what a CPU-only
host adds (the stand-ins in ``sglang_cpu/``, named and documented there; the environment and flags that
use them are ``engine/bench/upstream_cpu.py``'s, shared with the benchmarks).

``sglang_python()`` is the interpreter ``scripts/sglang_env.sh`` built (``make test`` exports it as
``KVFLEET_SGLANG_PYTHON``; run alone, a test builds or finds it the same way). ``CPU_WORKER_ENV`` and
``CPU_FLAGS`` are what an upstream worker needs on this machine, as a spec's ``env`` table and flag keys.
"""

from __future__ import annotations

import os
import subprocess
from functools import cache
from pathlib import Path

from engine.bench.upstream_cpu import CPU_FLAGS, CPU_WORKER_ENV

__all__ = ["CPU_FLAGS", "CPU_WORKER_ENV", "sglang_python", "smollm2_hf", "spec_table"]

REPO = Path(__file__).resolve().parents[2]


@cache
def sglang_python() -> str:
    """Path of the upstream environment's python (built on first use: minutes)."""
    given = os.environ.get("KVFLEET_SGLANG_PYTHON")
    if given:
        return given
    out = subprocess.run(
        [str(REPO / "scripts" / "sglang_env.sh")], capture_output=True, text=True, check=True
    )
    return out.stdout.strip().splitlines()[-1]


@cache
def smollm2_hf() -> str:
    """The SmolLM2 demo model as an HF folder (``engine.fleet.hf_export``)."""
    from engine.fleet.hf_export import export

    return str(export("smollm2"))


def spec_table(**values) -> str:
    """``key = value`` TOML lines (strings quoted, booleans lower case, tables inline)."""
    import json

    def toml(v) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, dict):
            return "{ " + ", ".join(f"{k} = {toml(x)}" for k, x in v.items()) + " }"
        return json.dumps(v) if isinstance(v, str) else str(v)

    return "\n".join(f"{k} = {toml(v)}" for k, v in values.items())
