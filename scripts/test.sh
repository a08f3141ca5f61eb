#!/usr/bin/env bash
# The whole suite: lint (ruff, incl. size/complexity; mypy on the cache, scheduler and control-plane
# services), then the tests: the control-plane tests on PostgreSQL when one answers at $POSTGRES_TEST_URL
# (default postgres://postgres@127.0.0.1:5432/test), every other test (and, without PostgreSQL, those too)
# on SQLite.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/services.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy engine/cache engine/scheduler controlplane/*/services*
ensure_redis
pg_url="${POSTGRES_TEST_URL:-postgres://postgres@127.0.0.1:5432/test}"
if postgres_reachable "$pg_url"; then
  # The control-plane tests run once, on PostgreSQL (production's database); the rest (the engine, the
  # browser tests and the demo fleet, which run on SQLite as `make demo` does) on SQLite.
  .venv/bin/python -m pytest --durations=20 --ignore=tests/controlplane "$@"
  echo "== control-plane tests on PostgreSQL ($pg_url)"
  DATABASE_URL="$pg_url" .venv/bin/python -m pytest --durations=10 tests/controlplane "$@"
else
  echo "== PostgreSQL not reachable at $pg_url: control-plane tests run on SQLite"
  .venv/bin/python -m pytest --durations=20 "$@"
fi
