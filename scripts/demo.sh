#!/usr/bin/env bash
# The main job. Until the full fleet demo lands, runs the hierarchical-cache demo on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python -m engine.cache.demo "$@"
