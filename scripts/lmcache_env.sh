#!/usr/bin/env bash
# Build the separate virtual environment that runs LMCache: its server (`lmcache_server <host> <port> cpu`,
# the store of `--hicache-storage-backend lmcache`, started by engine/fleet/lmcache_server.py) and its own
# cache-policy code for `scripts/lmcache_policies.py` (the anchor of `python -m engine.bench.kv_capacity
# --part policies`); print its python's path.
#
#   scripts/lmcache_env.sh            # or: make lmcache-env
#
# LMCache (`lmcache` on PyPI, pinned below) cannot share the project's venv: its requirements pin numpy,
# protobuf, setuptools, transformers and CUDA packages (cupy-cuda13x, cuda-python, cufile-python) that break
# the project's pins. So it goes into $LMCACHE_VENV, default
# ${XDG_CACHE_HOME:-$HOME/.cache}/kvfleet/lmcache-0.5.6/ (outside the repository, so a fresh clone reuses it),
# installed --no-deps, beside only the packages that importing its server (lmcache.v1.server) and policy
# modules (lmcache.v1.storage_backend.cache_policy, lmcache.v1.distributed.eviction_policy,
# lmcache.tools.cache_simulator) needs; with no GPU it starts in its "CLI-only" device mode. torch is pinned
# to the release the pip configuration of the dev box offers as a CPU wheel; elsewhere pip fetches the same
# release's default (CUDA) wheel, which also runs on the CPU but is several GB. A second run prints the path
# without reinstalling; delete the folder to rebuild. A first build takes 3-6 minutes on the 2-core dev box
# (1.5 GB, mostly torch's CPU wheel); runs at once (the test sessions' fixtures) take turns on a lock file
# beside the venv, so one builds and the others find it built. Needs python3 >= 3.10 (3.11 for the wheel
# below) and network access to PyPI.
#
# Exit status: 0 with the venv's python on stdout; 1 when an install step fails, the server or policy modules
# do not import or `lmcache_server` is missing (pip's or Python's error is on stderr).
set -euo pipefail

LMCACHE_VERSION=0.5.6
VENV=${LMCACHE_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/kvfleet/lmcache-$LMCACHE_VERSION}
PY=$VENV/bin/python
STAMP=$VENV/.installed-$LMCACHE_VERSION
PYTHON=${PYTHON:-python3}
# What `import lmcache.v1.server.__main__, lmcache.v1.storage_backend.cache_policy,
# lmcache.v1.distributed.eviction_policy, lmcache.tools.cache_simulator.simulator` reaches (found by importing
# until nothing was missing).
DEPS=(
    "torch==2.13.*" numpy numba sortedcontainers pyyaml requests cachetools prometheus_client py-cpuinfo psutil
    aiohttp aiofile msgspec pyzmq transformers cryptography
)
CHECK="import lmcache.v1.server.__main__, lmcache.v1.storage_backend.cache_policy, \
lmcache.v1.distributed.eviction_policy, lmcache.tools.cache_simulator.simulator"

if [[ -f $STAMP ]]; then
    echo "$PY"
    exit 0
fi
mkdir -p "$(dirname "$VENV")"
exec 9>"$VENV.lock"
flock 9
if [[ -f $STAMP ]]; then  # built while this run waited for the lock
    echo "$PY"
    exit 0
fi
test -x "$PY" || "$PYTHON" -m venv "$VENV" >&2
echo "installing lmcache $LMCACHE_VERSION (--no-deps) and what its server and policy modules import into $VENV" >&2
"$PY" -m pip install -q --disable-pip-version-check "${DEPS[@]}" >&2
"$PY" -m pip install -q --disable-pip-version-check --no-deps "lmcache==$LMCACHE_VERSION" >&2
if ! "$PY" -c "$CHECK" >/dev/null 2>"$VENV/import-check.log"; then
    echo "LMCache's server or policy modules do not import in $VENV:" >&2
    tail -5 "$VENV/import-check.log" >&2
    exit 1
fi
if [[ ! -x $VENV/bin/lmcache_server ]]; then
    echo "lmcache $LMCACHE_VERSION installed no lmcache_server console script into $VENV/bin" >&2
    exit 1
fi
touch "$STAMP"
echo "$PY"
