#!/usr/bin/env bash
# Build (once) the separate environment that runs upstream SGLang workers, and print its python's path.
#
#   scripts/sglang_env.sh            # or: make sglang-env
#
# Upstream SGLang (`sglang` on PyPI, pinned below) cannot share the project's venv: it pins its own torch
# (a CUDA build, ~11 GB installed with its kernels) and transformers. It goes into $SGLANG_VENV (default
# ~/.cache/kvfleet/sglang-<version>/, outside the clone, so every clone and CI run on this machine reuses it;
# about 4 minutes the first time). The SmolLM2 demo model is also written as an HF folder (upstream reads HF
# folders) into ~/.cache/kvfleet/models/ by `python -m engine.fleet.hf_export` of the project venv.
# On a CPU-only host upstream needs the two test-only stand-ins in tests/support/sglang_cpu/ (see its
# files); on a GPU host it runs as installed.
#
# Exit status: 0 with the venv's python on stdout; 1 when an install step fails or `sglang` does not import.
set -euo pipefail

SGLANG_VERSION=0.5.23
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CACHE=${XDG_CACHE_HOME:-$HOME/.cache}/kvfleet
VENV=${SGLANG_VENV:-$CACHE/sglang-$SGLANG_VERSION}
PY=$VENV/bin/python
STAMP=$VENV/.installed-$SGLANG_VERSION-2  # -2: with Mooncake
PYTHON=${PYTHON:-python3}

if [[ ! -f $STAMP ]]; then
    test -x "$PY" || "$PYTHON" -m venv "$VENV" >&2
    echo "installing sglang==$SGLANG_VERSION into $VENV (first time: several minutes, ~11 GB)" >&2
    "$PY" -m pip install -q --disable-pip-version-check "sglang==$SGLANG_VERSION" >&2
    # Mooncake's TransferEngine for upstream's PD transport (--disaggregation-transfer-backend mooncake /
    # mooncake_tcp) and Mooncake L3; the non-CUDA build, the one requirements.txt pins (a GPU host takes
    # mooncake-transfer-engine instead).
    "$PY" -m pip install -q --disable-pip-version-check "mooncake-transfer-engine-non-cuda==0.3.13.post1" >&2
    if ! "$PY" -c "import sglang.srt.server_args" 2>"$VENV/import-check.log"; then
        echo "sglang does not import in $VENV:" >&2
        tail -5 "$VENV/import-check.log" >&2
        exit 1
    fi
    touch "$STAMP"
fi
"$ROOT/.venv/bin/python" -m engine.fleet.hf_export >/dev/null
echo "$PY"
