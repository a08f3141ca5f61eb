#!/usr/bin/env bash
# Build the separate virtual environment that runs sglang-router 0.3.2, the router KVFleet pinned before smg,
# for deployments that still pin it, and print its python's path.
#
#   scripts/sglang_router_env.sh            # or: make sglang-router-env
#
# sglang-router 0.3.2 cannot share the project's venv with smg: both install a console script named `smg`,
# and whichever is installed last wins. So it goes into $SGLANG_ROUTER_VENV, default
# ${XDG_CACHE_HOME:-$HOME/.cache}/kvfleet/sglang-router-0.3.2/ (outside the repository, so a fresh clone reuses
# it), with its own requirements; the packages it shares with the project get the project's pins
# (requirements.txt as constraints). engine/fleet/router.py finds it there (router_command(kind="sglang-router"))
# and so does the test that shows check-isolation reporting its salt leak. A second run prints the path without
# reinstalling; delete the folder to rebuild. Needs python3 >= 3.11 and network access to PyPI.
#
# Exit status: 0 with the venv's python on stdout; 1 when an install step fails or sglang_router's launcher
# does not import (pip's or Python's error is on stderr).
set -euo pipefail

SGLANG_ROUTER_VERSION=0.3.2
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${SGLANG_ROUTER_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/kvfleet/sglang-router-$SGLANG_ROUTER_VERSION}
PY=$VENV/bin/python
STAMP=$VENV/.installed-$SGLANG_ROUTER_VERSION
PYTHON=${PYTHON:-python3}
CHECK="import sglang_router.launch_router, sglang_router.version as v; \
assert v.__version__ == '$SGLANG_ROUTER_VERSION', v.__version__"

if [[ -f $STAMP ]]; then
    echo "$PY"
    exit 0
fi
mkdir -p "$(dirname "$VENV")"
test -x "$PY" || "$PYTHON" -m venv "$VENV" >&2
echo "installing sglang-router $SGLANG_ROUTER_VERSION into $VENV" >&2
# requirements.txt (extras dropped: pip refuses them in constraints) as constraints: the project's pins for
# what both need; smg, pinned there too, is not requested, so it is not installed.
"$PY" -m pip install -q --disable-pip-version-check -c <(sed 's/\[[^]]*\]//' "$ROOT/requirements.txt") \
    "sglang-router==$SGLANG_ROUTER_VERSION" >&2
if ! "$PY" -c "$CHECK" >/dev/null 2>"$VENV/import-check.log"; then
    echo "sglang-router's launcher does not import in $VENV:" >&2
    tail -5 "$VENV/import-check.log" >&2
    exit 1
fi
touch "$STAMP"
echo "$PY"
