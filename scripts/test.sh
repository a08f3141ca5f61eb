#!/usr/bin/env bash
# The whole suite: lint (ruff, incl. size/complexity; mypy on the cache, scheduler and control-plane
# services), then every test on SQLite, then the control-plane tests again on PostgreSQL
# when one answers at $POSTGRES_TEST_URL (default postgres://postgres@127.0.0.1:5432/test).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/services.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy engine/cache engine/scheduler controlplane/*/services*
ensure_redis
.venv/bin/python -m pytest "$@"
pg_url="${POSTGRES_TEST_URL:-postgres://postgres@127.0.0.1:5432/test}"
if postgres_reachable "$pg_url"; then
  echo "== control-plane tests on PostgreSQL ($pg_url)"
  DATABASE_URL="$pg_url" .venv/bin/python -m pytest tests/controlplane tests/browser -m "not browser" "$@"
else
  echo "== PostgreSQL not reachable at $pg_url: control-plane tests ran on SQLite only"
fi
