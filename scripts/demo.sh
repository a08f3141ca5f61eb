#!/usr/bin/env bash
# The main job: a complete local KVFleet (control plane, Celery, Mooncake master, the agent with two SmolLM2
# workers, the smg router) with multi-turn traffic; prints the console and router URLs. Ctrl-C stops it.
#   scripts/demo.sh                   run until Ctrl-C
#   scripts/demo.sh --duration 180    bounded: exit 0 once every worker shows device/host/storage hits
#   scripts/demo.sh --pd              2 prefill + 1 decode workers (2P1D, rebalance-able), router in PD mode
# `make demo DEMO_SECONDS=180` passes --duration, `make demo PD=1` (or yes/true/on) passes --pd; any other PD
# value is refused. `make demo ENGINE=sglang` runs the workers on upstream SGLang (--engine sglang).
# A demo started while another runs says so (var/demo.lock) and starts anyway. Logs: logs/demo-<time>/.
set -euo pipefail
cd "$(dirname "$0")/.."
args=("$@")
if [ -n "${DEMO_SECONDS:-}" ]; then args+=(--duration "$DEMO_SECONDS"); fi
case "${PD:-0}" in
  0 | "" | no | false | off) ;;
  1 | yes | true | on) args+=(--pd) ;;
  *) echo "make demo: PD=${PD}: use PD=1 for prefill + decode workers behind the router, or leave PD out" >&2; exit 2 ;;
esac
case "${ENGINE:-kvfleet}" in
  kvfleet | "") ;;
  sglang) args+=(--engine sglang) ;;
  *) echo "make demo: ENGINE=${ENGINE}: use ENGINE=sglang for upstream SGLang workers, or leave ENGINE out" >&2; exit 2 ;;
esac
exec .venv/bin/python deploy/localfleet.py "${args[@]}"
