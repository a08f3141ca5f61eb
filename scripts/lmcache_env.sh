#!/usr/bin/env bash
# Build the separate virtual environment that runs LMCache's own cache-policy code for
# `scripts/lmcache_policies.py` (the anchor of `python -m engine.bench.kv_capacity --part policies`), and print
# its python's path.
#
#   scripts/lmcache_env.sh            # or: make lmcache-env
#
# LMCache (`lmcache` on PyPI, pinned below) cannot share the project's venv: its requirements pin numpy,
# protobuf, setuptools, transformers and CUDA packages (cupy-cuda13x, cuda-python, cufile-python) that break
# the project's pins. So it goes into $LMCACHE_VENV (default .cache/lmcache-venv/ in the repository,
# gitignored), installed --no-deps, beside only the packages that importing its policy modules needs
# (lmcache.v1.storage_backend.cache_policy, lmcache.v1.distributed.eviction_policy,
# lmcache.tools.cache_simulator); with no GPU it starts in its "CLI-only" device mode. torch is pinned to the
# release the pip configuration of the dev box offers as a CPU wheel; elsewhere pip fetches the same release's
# default (CUDA) wheel, which also runs on the CPU but is several GB. A second run prints the path without
# reinstalling; delete the folder to rebuild. Needs python3 >= 3.10 (3.11 for the wheel below) and network
# access to PyPI.
#
# Exit status: 0 with the venv's python on stdout; 1 when an install step fails or the policy modules do not
# import (pip's or Python's error is on stderr).
set -euo pipefail

LMCACHE_VERSION=0.5.6
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${LMCACHE_VENV:-$ROOT/.cache/lmcache-venv}
PY=$VENV/bin/python
STAMP=$VENV/.installed-$LMCACHE_VERSION
PYTHON=${PYTHON:-python3}
# What `import lmcache.v1.storage_backend.cache_policy, lmcache.v1.distributed.eviction_policy,
# lmcache.tools.cache_simulator.simulator` reaches (found by importing until nothing was missing).
DEPS=(
    "torch==2.13.*" numpy numba sortedcontainers pyyaml requests cachetools prometheus_client py-cpuinfo psutil
    aiohttp aiofile msgspec pyzmq transformers cryptography
)
CHECK="import lmcache.v1.storage_backend.cache_policy, lmcache.v1.distributed.eviction_policy, \
lmcache.tools.cache_simulator.simulator"

if [[ -f $STAMP ]]; then
    echo "$PY"
    exit 0
fi
test -x "$PY" || "$PYTHON" -m venv "$VENV" >&2
echo "installing lmcache $LMCACHE_VERSION (--no-deps) and its policy modules' imports into $VENV" >&2
"$PY" -m pip install -q --disable-pip-version-check "${DEPS[@]}" >&2
"$PY" -m pip install -q --disable-pip-version-check --no-deps "lmcache==$LMCACHE_VERSION" >&2
if ! "$PY" -c "$CHECK" >/dev/null 2>"$VENV/import-check.log"; then
    echo "LMCache's policy modules do not import in $VENV:" >&2
    tail -5 "$VENV/import-check.log" >&2
    exit 1
fi
touch "$STAMP"
echo "$PY"
