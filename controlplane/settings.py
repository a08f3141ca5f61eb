"""Control-plane settings, all read from the environment.

Variables: SECRET_KEY (required unless DEBUG=1), DEBUG (0/1, default 0), ALLOWED_HOSTS (comma list),
CSRF_TRUSTED_ORIGINS (comma list), DATABASE_URL (default SQLite under var/), REDIS_URL (default
redis://127.0.0.1:6379/0), HTTPS (0/1; default the inverse of DEBUG: SSL redirect, secure cookies and HSTS),
FIELD_ENCRYPTION_KEY (Fernet key for worker admin keys; default derived from SECRET_KEY), TOKEN_PEPPER (HMAC
key of API token digests; default from SECRET_KEY), CELERY_QUEUE, REDIS_KEY_PREFIX,
PROMETHEUS_URL, PROMETHEUS_TIMEOUT_S, TELEMETRY_PUBLISH_INTERVAL_S, FLEET_PAGE_SIZE (workers a page of the
fleet table), DB_POOL_MIN_SIZE / DB_POOL_MAX_SIZE / DB_POOL_TIMEOUT_S (PostgreSQL connection pool per
process), HEARTBEAT_DB_REFRESH_S.
"""

import math
import os
from pathlib import Path

import dj_database_url
from django.core.exceptions import ImproperlyConfigured


def _env_bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    return default if raw is None or raw == "" else raw.strip().lower() in {"1", "true", "yes", "on"}


def _env_list(name: str, default: str) -> list[str]:
    return [item.strip() for item in os.environ.get(name, default).split(",") if item.strip()]


BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = BASE_DIR / "var"
VAR_DIR.mkdir(exist_ok=True)

DEBUG = _env_bool("DEBUG", False)
SECRET_KEY = os.environ.get("SECRET_KEY", "")
if not SECRET_KEY:
    if not DEBUG:
        raise ImproperlyConfigured(
            "SECRET_KEY is not set: export SECRET_KEY (50+ random characters), or DEBUG=1 for development"
        )
    SECRET_KEY = "dev-only-insecure-key-set-SECRET_KEY-in-production"
ALLOWED_HOSTS = _env_list("ALLOWED_HOSTS", "localhost,127.0.0.1,[::1],testserver")
CSRF_TRUSTED_ORIGINS = _env_list("CSRF_TRUSTED_ORIGINS", "")

INSTALLED_APPS = [
    "daphne",
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "django_filters",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "channels",
    "controlplane.accounts",
    "controlplane.inventory",
    "controlplane.configs",
    "controlplane.audit",
    "controlplane.operations",
    "controlplane.telemetry",
    "controlplane.capacity",
    "controlplane.rebalance",
    "frontend",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "controlplane.core.middleware.RequestContextMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "controlplane.core.middleware.ApiSlashMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "controlplane.urls"
WSGI_APPLICATION = "controlplane.wsgi.application"
ASGI_APPLICATION = "controlplane.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]

DATABASES = {
    "default": dj_database_url.parse(os.environ.get("DATABASE_URL") or f"sqlite:///{VAR_DIR / 'db.sqlite3'}")
}
if DATABASES["default"]["ENGINE"].endswith("sqlite3"):
    # WAL + IMMEDIATE transactions let the web process and Celery workers write the same file without
    # "database is locked"; test databases are files too, so worker subprocesses see them.
    DATABASES["default"]["OPTIONS"] = {
        "timeout": 30,
        "transaction_mode": "IMMEDIATE",
        "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
    }
    DATABASES["default"]["TEST"] = {"NAME": str(VAR_DIR / f"test_controlplane_{os.getpid()}.sqlite3")}

# PostgreSQL: a bounded connection pool per process (psycopg_pool through Django's native "pool" option).
# A request or task borrows a connection for as long as it runs and returns it at its end; at most
# DB_POOL_MAX_SIZE are open per process, and a caller that finds all of them busy waits up to
# DB_POOL_TIMEOUT_S for one, then gets 503 database_unavailable (never a new connection past the bound).
# Size the server for it: max_connections >= processes x DB_POOL_MAX_SIZE + headroom (docs/deployment.md).
# SQLite (no server) keeps Django's persistent connections.
DB_POOL_MIN_SIZE = int(os.environ.get("DB_POOL_MIN_SIZE", "1"))
DB_POOL_MAX_SIZE = int(os.environ.get("DB_POOL_MAX_SIZE", "10"))
DB_POOL_TIMEOUT_S = float(os.environ.get("DB_POOL_TIMEOUT_S", "10"))
if DATABASES["default"]["ENGINE"].endswith("postgresql") and DB_POOL_MAX_SIZE > 0:
    DATABASES["default"].setdefault("OPTIONS", {})["pool"] = {
        "min_size": min(DB_POOL_MIN_SIZE, DB_POOL_MAX_SIZE),
        "max_size": DB_POOL_MAX_SIZE,
        "timeout": DB_POOL_TIMEOUT_S,
        "max_idle": 300,
    }
    DATABASES["default"]["CONN_MAX_AGE"] = 0  # the pool keeps connections; Django must not
else:
    # Persistent connections: Celery workers and the ASGI threads reuse them across tasks and requests.
    DATABASES["default"]["CONN_MAX_AGE"] = int(os.environ.get("CONN_MAX_AGE", "60"))
DATABASES["default"]["CONN_HEALTH_CHECKS"] = True  # with the pool: a connection is checked when borrowed
# Threads of one ASGI process that run requests' Django code (controlplane.core.asgi_handler): each holds at
# most one pooled connection while it runs a request, so by default as many as the pool has connections.
ASGI_THREADS = int(os.environ.get("ASGI_THREADS", str(max(DB_POOL_MAX_SIZE, 1))))

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
]
LOGIN_URL = "console:login"
LOGIN_REDIRECT_URL = "console:fleet"
LOGOUT_REDIRECT_URL = "console:login"

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = False
USE_TZ = True
STATIC_URL = "static/"
STATIC_ROOT = Path(os.environ.get("STATIC_ROOT") or VAR_DIR / "static")
STATIC_ROOT.mkdir(parents=True, exist_ok=True)
# WhiteNoise serves the console's JS/CSS and the Swagger UI straight from the apps (no build step), unless
# WHITENOISE_USE_FINDERS=0: then only the copy collectstatic put in STATIC_ROOT. Without autorefresh it
# records each file's size when the server starts and reads the file at each request, so a source file
# edited (or pulled) under a running server is served cut to its old size: a script that does not parse.
# The local fleet (make demo) serves its own collected copy, which nothing else writes.
WHITENOISE_USE_FINDERS = _env_bool("WHITENOISE_USE_FINDERS", True)
WHITENOISE_AUTOREFRESH = DEBUG

# Transport security: on by default whenever DEBUG is off (behind a TLS-terminating proxy set HTTPS=1 and
# SECURE_PROXY_SSL_HEADER is honoured).
HTTPS = _env_bool("HTTPS", not DEBUG)
SECURE_SSL_REDIRECT = HTTPS
SESSION_COOKIE_SECURE = HTTPS
CSRF_COOKIE_SECURE = HTTPS
SECURE_HSTS_SECONDS = 31536000 if HTTPS else 0
SECURE_HSTS_INCLUDE_SUBDOMAINS = HTTPS
SECURE_HSTS_PRELOAD = HTTPS
SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
SECURE_CONTENT_TYPE_NOSNIFF = True
X_FRAME_OPTIONS = "DENY"

FIELD_ENCRYPTION_KEY = os.environ.get("FIELD_ENCRYPTION_KEY", "")
TOKEN_PEPPER = os.environ.get("TOKEN_PEPPER", "")

# Redis: Celery broker/results, channel layer and telemetry keys share one server, separated by DB and prefix.
REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
REDIS_KEY_PREFIX = os.environ.get("REDIS_KEY_PREFIX", "kvfleet")

CELERY_BROKER_URL = REDIS_URL
CELERY_BROKER_TRANSPORT = "controlplane.core.broker:Transport"  # kombu's Redis transport, restart-safe
CELERY_RESULT_BACKEND = None
CELERY_TASK_DEFAULT_QUEUE = os.environ.get("CELERY_QUEUE", "controlplane")
CELERY_TASK_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
# The Prometheus-compatible TSDB the console reads fleet metrics from (PromQL): the embedded one started by
# make demo / docker-compose.yml, or an operator's own (docs/deployment.md, "Metrics"). Queries time out after
# PROMETHEUS_TIMEOUT_S; the fleet summary and the open worker pages' views are queried once per
# TELEMETRY_PUBLISH_INTERVAL_S and pushed.
PROMETHEUS_URL = os.environ.get("PROMETHEUS_URL", "http://127.0.0.1:9090")
PROMETHEUS_TIMEOUT_S = float(os.environ.get("PROMETHEUS_TIMEOUT_S", "3"))
TELEMETRY_PUBLISH_INTERVAL_S = float(os.environ.get("TELEMETRY_PUBLISH_INTERVAL_S", "5"))
# Workers per page of the fleet page's table: the fleet push carries one page, not the whole fleet.
FLEET_PAGE_SIZE = int(os.environ.get("FLEET_PAGE_SIZE", "50"))
if FLEET_PAGE_SIZE < 1:
    raise ImproperlyConfigured(f"FLEET_PAGE_SIZE must be at least 1, not {FLEET_PAGE_SIZE}")
# Agent traffic and the database: a heartbeat writes only what changed, and refreshes a host's or worker's
# last_seen only once the stored one is this old (the live time is the heartbeat itself; an offline worker is
# written at once).
HEARTBEAT_DB_REFRESH_S = float(os.environ.get("HEARTBEAT_DB_REFRESH_S", "30"))
PLANNER_INTERVAL_S = float(os.environ.get("PLANNER_INTERVAL_S", "15"))  # P:D planner evaluations
# PD routers' worker lists and workers' roles brought back to the inventory (rebalance/services/reconcile.py)
RECONCILE_INTERVAL_S = float(os.environ.get("RECONCILE_INTERVAL_S", "15"))
CELERY_BEAT_SCHEDULE = {
    "telemetry-publish-fleet": {"task": "telemetry.publish_fleet", "schedule": TELEMETRY_PUBLISH_INTERVAL_S},
    "telemetry-audit-storage": {"task": "telemetry.audit_storage", "schedule": TELEMETRY_PUBLISH_INTERVAL_S},
    "telemetry-publish-workers": {
        "task": "telemetry.publish_workers",
        "schedule": TELEMETRY_PUBLISH_INTERVAL_S,
    },
    "telemetry-publish-pools": {"task": "telemetry.publish_pools", "schedule": TELEMETRY_PUBLISH_INTERVAL_S},
    "operations-reap": {"task": "operations.reap_stuck_targets", "schedule": 10.0},
    "operations-purge-idempotency": {"task": "operations.purge_idempotency_records", "schedule": 3600.0},
    "rebalance-plan": {"task": "rebalance.plan_all", "schedule": PLANNER_INTERVAL_S},
    "rebalance-resume-stalled": {"task": "rebalance.resume_stalled", "schedule": 30.0},
    "rebalance-reconcile": {"task": "rebalance.reconcile_all", "schedule": RECONCILE_INTERVAL_S},
}
CELERY_IMPORTS = ["controlplane.rebalance.planner.tasks"]

# redis-py >= 8 defaults socket_timeout to 5 s, the same as channels_redis's blocking-pop timeout, so an idle
# consumer's BZPOPMIN races the socket timeout and the socket dies with 1011; give reads more room.
CHANNEL_REDIS_HOST = {"address": REDIS_URL, "socket_timeout": 30}
CHANNEL_LAYERS = {
    "default": {
        "BACKEND": "controlplane.core.channel_layer.BatchReceiveLayer",  # channels_redis's, batched receives
        "CONFIG": {"hosts": [CHANNEL_REDIS_HOST], "capacity": 10000, "prefix": f"{REDIS_KEY_PREFIX}:asgi"},
    }
}

# Operations: how long a target may wait for its worker to become idle, and the poll interval.
OPERATION_IDLE_TIMEOUT_S = float(os.environ.get("OPERATION_IDLE_TIMEOUT_S", "120"))
OPERATION_POLL_INTERVAL_S = float(os.environ.get("OPERATION_POLL_INTERVAL_S", "0.5"))
OPERATION_APPLY_TIMEOUT_S = float(os.environ.get("OPERATION_APPLY_TIMEOUT_S", "60"))
# restart_with_flags: how long a target waits for its agent to restart the worker with the flags asked and
# for it to answer /health with them (an upstream SGLang worker takes about 100 s to start on a CPU).
OPERATION_RESTART_TIMEOUT_S = float(os.environ.get("OPERATION_RESTART_TIMEOUT_S", "600"))
# Rebalances (P:D role switches): defaults for a POST that leaves them out, the canary's HTTP timeout, and
# how long past the soak a re-added worker may take to show healthy in the router's list.
REBALANCE_SOAK_S = float(os.environ.get("REBALANCE_SOAK_S", "30"))
REBALANCE_IDLE_TIMEOUT_S = float(os.environ.get("REBALANCE_IDLE_TIMEOUT_S", "120"))
REBALANCE_CANARY_TIMEOUT_S = float(os.environ.get("REBALANCE_CANARY_TIMEOUT_S", "30"))
REBALANCE_ROUTER_JOIN_TIMEOUT_S = float(os.environ.get("REBALANCE_ROUTER_JOIN_TIMEOUT_S", "60"))
# A step whose engine cannot switch in place asks the worker's agent to restart it in the new role (the
# agent reads it from its next heartbeat answer, stops the engine, starts it again and waits for /health):
# how long the step waits for /server_info to report that role with /health answering.
REBALANCE_RESTART_TIMEOUT_S = float(os.environ.get("REBALANCE_RESTART_TIMEOUT_S", "300"))
REBALANCE_CANARY_MAX_NEW_TOKENS = (
    8  # greedy tokens per canary prompt (controlplane/rebalance/services/canary.py)
)
WORKER_HTTP_TIMEOUT_S = float(os.environ.get("WORKER_HTTP_TIMEOUT_S", "5"))
# A change request (attach builds a store client, detach drains its queues) may take longer than a read.
WORKER_APPLY_HTTP_TIMEOUT_S = float(os.environ.get("WORKER_APPLY_HTTP_TIMEOUT_S", "30"))
# The worker's cost probe (POST /hicache/costs/probe) runs a prefill of up to a few thousand tokens per size:
# about 40 s with its default sizes on a loaded 2-core CPU host, far less on an accelerator.
WORKER_PROBE_HTTP_TIMEOUT_S = float(os.environ.get("WORKER_PROBE_HTTP_TIMEOUT_S", "300"))

# Task delivery across a worker death. The longest operation step (idle read, state read, apply, read-back,
# router re-add) is bounded by its HTTP timeouts; the soft limit is that bound, the hard limit kills a step
# half as long again (prefork; the threads pool relies on the HTTP timeouts). Steps run acks_late, so a step
# whose worker died stays unacked in Redis and is redelivered once the visibility timeout passes: it must
# exceed the longest a message is held (its countdown, one poll interval, plus the hard limit), with a 2x
# margin, and no more, since it is also how long a lost step waits. Workers sweep for expired messages every
# tenth of it (kombu's default sweep, 10 s x a throttle of 10, would add up to 100 s).
OPERATION_STEP_MAX_S = WORKER_APPLY_HTTP_TIMEOUT_S + 6 * WORKER_HTTP_TIMEOUT_S
CELERY_TASK_SOFT_TIME_LIMIT = OPERATION_STEP_MAX_S
CELERY_TASK_TIME_LIMIT = 1.5 * OPERATION_STEP_MAX_S
# A rebalance with no advance for this long lost its task chain (one advance is bounded by the worker HTTP
# timeouts, the canary and the router join wait: below twice the hard limit); beat starts a new chain.
REBALANCE_STALL_S = float(os.environ.get("REBALANCE_STALL_S", str(2 * CELERY_TASK_TIME_LIMIT)))
_VISIBILITY_TIMEOUT_S = math.ceil(2 * (OPERATION_POLL_INTERVAL_S + CELERY_TASK_TIME_LIMIT))
_RESTORE_INTERVAL_S = max(1, _VISIBILITY_TIMEOUT_S // 10)
CELERY_BROKER_TRANSPORT_OPTIONS = {
    "visibility_timeout": _VISIBILITY_TIMEOUT_S,
    "unacked_restore_interval": _RESTORE_INTERVAL_S,
    "unacked_restore_throttle": 1,
}
# The reaper settles a target only once no step of it can come back: a step taken before the target's
# deadline by a worker that then died is redelivered at most a visibility timeout plus one sweep interval
# later and runs for at most the hard limit; past the deadline by that much, nothing of it is left in flight.
# (A fixed 30 s grace let the reaper act at 90 s on an applying target whose step came back at 181 s.)
OPERATION_REAPER_GRACE_S = _VISIBILITY_TIMEOUT_S + _RESTORE_INTERVAL_S + CELERY_TASK_TIME_LIMIT

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "controlplane.accounts.authentication.ApiTokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["controlplane.accounts.permissions.RolePermission"],
    "DEFAULT_FILTER_BACKENDS": [
        "controlplane.core.filters.KnownQueryParamsFilter",
        "django_filters.rest_framework.DjangoFilterBackend",
        "controlplane.core.filters.OrderingFilter",
    ],
    "DEFAULT_PAGINATION_CLASS": "controlplane.core.pagination.LimitOffsetPagination",
    "PAGE_SIZE": 50,
    "EXCEPTION_HANDLER": "controlplane.core.exceptions.exception_handler",
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "UNAUTHENTICATED_USER": "django.contrib.auth.models.AnonymousUser",
}
SPECTACULAR_SETTINGS = {
    "TITLE": "KVFleet control plane API",
    "DESCRIPTION": "Inventory, config revisions, operations, audit and telemetry of a HiCache engine fleet.",
    "VERSION": "1.0.0",
    "SERVE_INCLUDE_SCHEMA": False,
    "COMPONENT_SPLIT_REQUEST": True,
    "SCHEMA_PATH_PREFIX": r"/api/v1",
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "ENUM_NAME_OVERRIDES": {
        "RouterPolicyEnum": "controlplane.inventory.models.RouterPolicy",
        "OperationPolicyEnum": "controlplane.operations.models.Policy",
        "UserRoleEnum": "controlplane.accounts.models.Role",
        "WorkerRoleEnum": "controlplane.inventory.models.WorkerRole",
    },
}

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "root": {"handlers": ["console"], "level": os.environ.get("LOG_LEVEL", "WARNING")},
}

# Capacity what-if: the shared Mooncake traces, and how long one replay (a sweep) may run.
KVFLEET_TRACE_DIR = os.environ.get("KVFLEET_TRACE_DIR", "/work/shared/data/mooncake-traces")
WHATIF_TIMEOUT_S = float(os.environ.get("WHATIF_TIMEOUT_S", "240"))
# Each replay is a CPU-bound child process: at most this many at once per user and in all (429 beyond).
WHATIF_MAX_PER_USER = int(os.environ.get("WHATIF_MAX_PER_USER", "1"))
WHATIF_MAX_RUNNING = int(os.environ.get("WHATIF_MAX_RUNNING", "2"))
