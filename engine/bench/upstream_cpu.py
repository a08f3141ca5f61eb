"""What upstream SGLang needs to run on a CPU-only host, written once for the benchmarks and the tests.

Upstream's CPU engine, its ``torch_native`` attention, and the HiCache io backend / layout that have
plain-torch copies (the others need compiled kernels); ``PYTHONPATH`` puts the test-only stand-ins of
``tests/support/sglang_cpu/`` (documented there) in front of upstream's kernel package. Upstream's ``/health``
runs a one-token generation by default; on a loaded 2-core CPU host that outlasts a router's 5 s health
timeout, so its documented switch turns that off. Never used on a GPU host.
"""

from __future__ import annotations

from pathlib import Path

STAND_INS = Path(__file__).resolve().parents[2] / "tests" / "support" / "sglang_cpu"

CPU_WORKER_ENV = {
    "SGLANG_USE_CPU_ENGINE": "1",
    "PYTHONPATH": str(STAND_INS),
    "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "0",
}
"""Environment of an upstream worker on a CPU host (a fleet spec's ``env`` table)."""

CPU_FLAGS = {
    "device": "cpu",
    "attention_backend": "torch_native",
    "hicache_io_backend": "direct",
    "hicache_mem_layout": "layer_first",
}
"""Launch flags of an upstream worker on a CPU host, by SGLang dest name (a fleet spec's flag keys)."""


def cpu_command_line() -> list[str]:
    """:data:`CPU_FLAGS` as ``--flag=value`` items of a command line."""
    return [f"--{k.replace('_', '-')}={v}" for k, v in CPU_FLAGS.items()]
