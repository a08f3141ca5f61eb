"""Which router answers at a URL, and which of its serving routes carry a request's ``cache_salt`` to the
worker: the one place KVFleet writes that knowledge down (the control plane's router inventory, its console,
and ``check-isolation`` read it from here).

``identify_router(body)`` reads the body of the router's ``GET /get_loads``:

- smg answers ``{"timestamp", "version": "smg-1.13.0", "dp_rank_count", "loads": [...]}``: kind ``"smg"``,
  version ``"1.13.0"``.
- sglang-router (0.3.2 and the releases before smg) answers ``{"workers": [{"worker", "load"}, ...]}`` and
  says nothing of its version over HTTP: kind ``"sglang-router"``, version ``""``.

Salt routes, measured with real workers (tests/server/test_server_cache_salt.py): smg 1.13.0 passes
``cache_salt`` on ``/generate``, ``/v1/completions`` and ``/v1/chat/completions``; sglang-router 0.3.2
rebuilds chat and ``/generate`` bodies from its own request types and drops it there (it passes it on
``/v1/completions``, and passes ``/generate``'s ``extra_key``). Both pass the client's ``Authorization``
header on unchanged, so a tenant API key (the worker's ``--tenant-keys-file``) isolates tenants through
either. An smg release older than the one measured is "not verified" (None), never assumed.

gRPC workers (``--grpc-mode``) are the exception to every route above: over gRPC no salt and no API key
reaches the worker (``serves_grpc``, ``grpc_isolation_problem``).
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

SALT_ROUTES = ("/generate", "/v1/completions", "/v1/chat/completions")
SMG_MEASURED = (1, 13, 0)  # the oldest smg release whose salt routes were measured
# What sglang-router 0.3.2 does with cache_salt, per route (True: reaches the worker).
SGLANG_ROUTER_SALT = {"/generate": False, "/v1/completions": True, "/v1/chat/completions": False}
TENANT_KEYS_ADVICE = (
    "give each tenant its own API key (the workers' --tenant-keys-file); both routers pass it on as "
    "Authorization, and the worker keys the cache by tenant"
)


@dataclass(frozen=True)
class RouterIdentity:
    """``kind``: "smg" | "sglang-router"; ``version``: e.g. "1.13.0", "" when the router does not report it.
    ``salt_routes``: route -> True (carries ``cache_salt`` to the worker), False (drops it: tenants sharing
    a prompt share its cache), None (not verified for this release)."""

    kind: str
    version: str
    salt_routes: dict

    @property
    def label(self) -> str:
        """ "smg 1.13.0", or "sglang-router (version not reported)"."""
        return f"{self.kind} {self.version}" if self.version else f"{self.kind} (version not reported)"

    @property
    def salt_dropped(self) -> list[str]:
        """The routes on which a ``cache_salt`` does not reach the worker (known to, or not verified to)."""
        return [route for route, carried in self.salt_routes.items() if carried is not True]

    def salt_warning(self) -> str:
        """'' when every route carries the salt, else one sentence for the operator: the routes, what it
        means, and the supported way."""
        dropped = self.salt_dropped
        if not dropped:
            return ""
        known = [r for r in dropped if self.salt_routes[r] is False]
        unverified = [r for r in dropped if self.salt_routes[r] is None]
        parts = []
        if known:
            parts.append(f"drops cache_salt on {', '.join(known)}")
        if unverified:
            parts.append(f"is not verified to pass cache_salt on {', '.join(unverified)}")
        return (
            f"{self.label} {' and '.join(parts)}: requests there share cached prompts across salts, and "
            f"the request still succeeds. To isolate tenants, {TENANT_KEYS_ADVICE}."
        )


def _version_tuple(version: str) -> tuple[int, ...] | None:
    try:
        return tuple(int(p) for p in version.split(".")[:3])
    except ValueError:
        return None


def salt_routes(kind: str, version: str) -> dict:
    """route -> True / False / None for a router of ``kind`` and ``version`` (see the module docstring)."""
    if kind == "smg":
        parsed = _version_tuple(version)
        carried = True if parsed is not None and parsed >= SMG_MEASURED else None
        return dict.fromkeys(SALT_ROUTES, carried)
    if kind == "sglang-router":
        return dict(SGLANG_ROUTER_SALT)
    return dict.fromkeys(SALT_ROUTES)


def identify_router(body: object) -> RouterIdentity:
    """The router whose ``GET /get_loads`` answered ``body`` (parsed JSON). Raises ValueError when the body
    is neither router's shape (e.g. an engine worker, which does not serve /get_loads)."""
    if isinstance(body, dict) and isinstance(body.get("version"), str) and "loads" in body:
        kind, _, version = body["version"].partition("-")
        if kind == "smg" and version:
            return RouterIdentity("smg", version, salt_routes("smg", version))
    if isinstance(body, dict) and isinstance(body.get("workers"), list) and "version" not in body:
        return RouterIdentity("sglang-router", "", salt_routes("sglang-router", ""))
    raise ValueError(f"not a router's /get_loads answer: {str(body)[:200]}")


# gRPC workers (``--grpc-mode``): the router speaks the SGLang gRPC proto to them, which has no field for a
# cache salt or an API key, so smg 1.13.0 sends neither (tests/server/test_server_grpc_router.py pins that
# the salt is dropped). Whatever the router does with salts over HTTP, tenants reaching a gRPC worker share
# its cache; the worker refuses --tenant-keys-file with --grpc-mode for that reason.
GRPC_MODE_OPTIONS = ("--grpc-mode", "--smg-grpc-mode")  # the flag and its alias (engine/server/args.py)
GRPC_ISOLATION_ADVICE = (
    "serve them from HTTP workers with tenant API keys (the workers' --tenant-keys-file) and keep "
    "gRPC workers for traffic that needs no isolation"
)


def serves_grpc(command_line: list) -> bool:
    """Whether a worker launched with ``command_line`` (argv items, ``--flag`` or ``--flag=value``, as its
    agent reports them) serves gRPC: ``--grpc-mode`` / ``--smg-grpc-mode`` present, bare or with a true
    value. ``[]`` (no command line reported) -> False: not known to."""
    for item in command_line:
        option, eq, value = str(item).partition("=")
        if option in GRPC_MODE_OPTIONS:
            return not eq or value.strip().lower() not in ("false", "0", "no", "off", "")
    return False


def grpc_url(url: str, command_line: list) -> str | None:
    """``grpc://host:port``, what a router lists a --grpc-mode worker by: the host of its HTTP ``url`` (its
    sidecar's) and the ``--port`` of ``command_line`` (SGLang's default 30000 when none is given); None when
    the command line does not say it serves gRPC."""
    if not serves_grpc(command_line):
        return None
    port = next((str(x).partition("=")[2] for x in command_line if str(x).startswith("--port=")), "30000")
    return f"grpc://{urlsplit(url).hostname}:{port}"


def grpc_isolation_problem(names: list[str]) -> str:
    """One sentence for the operator: the gRPC workers ``names`` cannot keep tenants apart, why, and the
    supported way. ``names`` must not be empty."""
    several = len(names) > 1
    return (
        f"gRPC worker{'s' if several else ''} {', '.join(names)} (--grpc-mode) "
        f"{'get' if several else 'gets'} no cache_salt and no tenant API key from the router: the SGLang "
        "gRPC proto has no field for either, so tenants sharing a prompt share its cache there. To isolate "
        f"tenants, {GRPC_ISOLATION_ADVICE}."
    )
