# Helpers sourced by scripts/*.sh: find or start the local services KVFleet uses.
REDIS_URL="${REDIS_URL:-redis://127.0.0.1:6379/0}"
export REDIS_URL

ensure_redis() {
  if .venv/bin/python -c "import redis,sys; redis.Redis.from_url('$REDIS_URL').ping()" 2>/dev/null; then
    return 0
  fi
  if command -v redis-server >/dev/null; then
    echo "Starting redis-server on 127.0.0.1:6379 (none answered at $REDIS_URL), data in var/redis"
    # deploy/localfleet.py REDIS_PERSISTENCE: an append-only file, so a restart keeps queued Celery tasks
    mkdir -p var/redis
    redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" \
      --appendonly yes --appendfsync everysec --dir "$PWD/var/redis" >/dev/null
    sleep 0.5
  else
    echo "No Redis answers at $REDIS_URL and redis-server is not installed (apt-get install redis-server)" >&2
    return 1
  fi
}

postgres_reachable() {
  .venv/bin/python - "$1" <<'PY' 2>/dev/null
import sys, psycopg
psycopg.connect(sys.argv[1], connect_timeout=2).close()
PY
}
