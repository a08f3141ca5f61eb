#!/usr/bin/env bash
# The main job: a complete local KVFleet (control plane, Celery, Mooncake master, the agent with two SmolLM2
# workers, the sglang-router) with multi-turn traffic; prints the console and router URLs. Ctrl-C stops it.
#   scripts/demo.sh                   run until Ctrl-C
#   scripts/demo.sh --duration 180    bounded: exit 0 once every worker shows device/host/storage hits
#   scripts/demo.sh --pd              2 prefill + 1 decode workers (2P1D, rebalance-able), router in PD mode
# `make demo DEMO_SECONDS=180` passes --duration, `make demo PD=1` passes --pd. Logs: logs/demo-<time>/.
set -euo pipefail
cd "$(dirname "$0")/.."
args=("$@")
if [ -n "${DEMO_SECONDS:-}" ]; then args+=(--duration "$DEMO_SECONDS"); fi
if [ "${PD:-0}" = 1 ]; then args+=(--pd); fi
exec .venv/bin/python deploy/localfleet.py "${args[@]}"
