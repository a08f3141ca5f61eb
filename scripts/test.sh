#!/usr/bin/env bash
# The whole suite: lint (ruff, incl. size/complexity; mypy on the cache, scheduler, PD transfer, server and
# control-plane services), then the tests in three pytest sessions at once, by folder:
#   servers       tests/server, tests/e2e (real engine, router and fleet processes), SQLite
#   engine+ui     every other folder but tests/controlplane (in-process engine tests, browser tests), SQLite
#   controlplane  tests/controlplane, on PostgreSQL when one answers at $POSTGRES_TEST_URL (default
#                 postgres://postgres@127.0.0.1:5432/test), else on SQLite
# Most of the real-process tests wait on their servers, so the sessions overlap well on 2 cores. The sessions
# share nothing: each control-plane fixture set has its own Redis key prefix and Celery queue, each SQLite
# test database is named by its process id. A session's output is printed when it ends; the run fails if
# any session fails. Extra arguments go to every session (for example `-x` or `-k name`).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/services.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy engine/cache engine/scheduler engine/disaggregation engine/server controlplane/*/services*
ensure_redis
# Upstream SGLang's own environment for the upstream-worker tests (cached outside the clone; minutes the
# first time, a second otherwise). KVFLEET_SGLANG_PYTHON tells the tests where it is.
KVFLEET_SGLANG_PYTHON=$(scripts/sglang_env.sh)
export KVFLEET_SGLANG_PYTHON
# LMCache's own environment (the lmcache L3 tests' lmcache_server) is built by their session fixture on first
# use, inside the sessions rather than before them (scripts/lmcache_env.sh: 3-6 min once, cached outside the
# clone, one build at a time); those tests skip, saying why, where it cannot be built.

pg_url="${POSTGRES_TEST_URL:-postgres://postgres@127.0.0.1:5432/test}"
cp_env=()
if postgres_reachable "$pg_url"; then
  cp_env=(DATABASE_URL="$pg_url")
  cp_name="controlplane (PostgreSQL $pg_url)"
else
  echo "== PostgreSQL not reachable at $pg_url: control-plane tests run on SQLite"
  cp_name="controlplane (SQLite)"
fi

logs=$(mktemp -d)
names=() pids=()
start() {  # start NAME ENV... -- PYTEST ARGS...: one session in the background, output to $logs/N.log
  local name=$1 envs=()
  shift
  while [[ $1 != -- ]]; do envs+=("$1"); shift; done
  shift
  names+=("$name")
  env "${envs[@]}" .venv/bin/python -m pytest "$@" >"$logs/${#names[@]}.log" 2>&1 &
  pids+=($!)
}
start "servers" -- --durations=15 tests/server tests/e2e "$@"
start "engine+ui" -- --durations=15 --ignore=tests/controlplane --ignore=tests/server --ignore=tests/e2e "$@"
start "$cp_name" "${cp_env[@]}" -- --durations=10 tests/controlplane "$@"
# On an early exit (Ctrl-C, a failed wait) stop the sessions still running; never fail the exit itself.
trap 'kill "${pids[@]}" 2>/dev/null || true; rm -rf "$logs"' EXIT

failed=()
for i in "${!pids[@]}"; do
  rc=0
  wait "${pids[$i]}" || rc=$?
  echo "== ${names[$i]}: pytest exit $rc"
  cat "$logs/$((i + 1)).log"
  # 5 = nothing collected: expected in some sessions when arguments select tests (`-k name`)
  if ((rc != 0)) && ! ((rc == 5 && $# > 0)); then failed+=("${names[$i]}"); fi
done
if ((${#failed[@]})); then
  echo "== failed sessions: ${failed[*]}"
  exit 1
fi
echo "== all test sessions passed"
