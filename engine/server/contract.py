"""The worker contract for HiCache runtime administration: request and response models of the admin routes.

One definition shared by the engine (``engine/server/admin.py`` validates with it and answers with it), the
control plane (``controlplane/operations/actions.py`` reads worker state through it) and the test fake
(``tests/controlplane/fakes.py``, checked against it). Field names are SGLang's (docs/upstream.md H7).

- ``PUT /hicache/storage-backend``: :class:`AttachRequest` -> 200 text, or 400 ``"Failed to attach ..."``.
- ``GET /hicache/storage-backend``: :class:`StorageBackendStatus`, read from the live cache.
- ``GET /hicache/config``, ``PUT /hicache/config`` (:class:`ConfigUpdate`): :class:`HiCacheConfigStatus`.
- ``GET /hicache/costs``: :class:`KVCosts`, load and recompute costs by size (``engine/cache/costs.py``).
- ``POST /hicache/costs/probe`` (:class:`CostProbeRequest`, body optional): :class:`CostProbeResult`.
- ``POST /pd_role_switch`` (:class:`PdRoleSwitchRequest`): :class:`PdRoleSwitchResponse`; the role reads back
  as ``/server_info``'s ``disaggregation_mode``.

Imports only pydantic and the eviction policy names (no torch), so the control plane can use it.
"""

from __future__ import annotations

import json
from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, StrictInt

# EVICTION_POLICIES: the console's and the what-if API's choices, from the one list of names (typing only).
from engine.cache.eviction_names import EVICTION_POLICIES, EvictionPolicy  # noqa: F401

PrefetchPolicy = Literal["best_effort", "wait_complete", "timeout"]
WritePolicy = Literal["write_through", "write_through_selective", "write_back"]
Admission = Literal["none", "tinylfu"]
ADMISSIONS: tuple[str, ...] = get_args(Admission)
PdRole = Literal["prefill", "decode"]

# Keys an extra config may carry that are HiCache settings (applied to the cache's config, reported by
# GET /hicache/config) rather than part of the backend's own extra config (upstream pops them the same way).
HICACHE_EXTRA_KEYS = (
    "prefetch_threshold",
    "prefetch_timeout_base",
    "prefetch_timeout_per_ki_token",
    "prefetch_timeout_max",
    "hicache_storage_pass_prefix_keys",
)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class AttachRequest(_Strict):
    """Body of ``PUT /hicache/storage-backend``. The extra config is JSON text (or ``@file``), upstream."""

    hicache_storage_backend: str = Field(min_length=1)
    hicache_storage_backend_extra_config_json: str | None = None
    hicache_storage_prefetch_policy: PrefetchPolicy | None = None
    hicache_write_policy: WritePolicy | None = None


class StorageBackendStatus(_Strict):
    """``GET /hicache/storage-backend``: the live cache's attached backend (None when detached) and the
    extra config that backend took (JSON text, HiCache keys left out; None when detached)."""

    hicache_storage_backend: str | None
    hicache_storage_backend_extra_config: str | None
    hicache_storage_prefetch_policy: PrefetchPolicy
    hicache_write_policy: WritePolicy


class ConfigUpdate(_Strict):
    """Body of ``PUT /hicache/config``: at least one field. Timeouts in seconds, threshold in tokens."""

    hicache_storage_prefetch_policy: PrefetchPolicy | None = None
    hicache_write_policy: WritePolicy | None = None
    prefetch_threshold: int | None = Field(default=None, ge=0, strict=True)
    prefetch_timeout_base: float | None = Field(default=None, ge=0)
    prefetch_timeout_per_ki_token: float | None = Field(default=None, ge=0)
    prefetch_timeout_max: float | None = Field(default=None, ge=0)
    radix_eviction_policy: EvictionPolicy | None = None
    l2_admission: Admission | None = None
    l3_admission: Admission | None = None


class HiCacheConfigStatus(_Strict):
    """``GET /hicache/config`` and the ``PUT`` answer: the live HiCache storage settings."""

    hicache_storage_backend: str | None
    hicache_storage_backend_extra_config: dict | None
    hicache_storage_prefetch_policy: PrefetchPolicy
    hicache_write_policy: WritePolicy
    hicache_mem_layout: str
    hicache_io_backend: str
    prefetch_threshold: int
    prefetch_timeout_base: float
    prefetch_timeout_per_ki_token: float
    prefetch_timeout_max: float
    radix_eviction_policy: EvictionPolicy = "lru"
    l2_admission: Admission = "none"
    l3_admission: Admission = "none"
    auto_detach_after_s: float | None = None  # extra-config key; None: never detached automatically
    auto_detach: dict | None = None  # AutoDetach.status() (engine/cache/storage/autodetach.py) or None


class KVCostBucket(_Strict):
    """One size bucket of one operation: ``size`` its upper bound in tokens (``"+Inf"``), then the sums over
    its ``count`` operations of their ``tokens`` and wall ``seconds``."""

    size: str
    count: int
    tokens: int
    seconds: float


class KVCosts(_Strict):
    """``GET /hicache/costs``: per operation (``load_back`` L2 -> L1, ``prefetch`` L3 -> L2, ``prefill``)
    the size buckets observed since start (the same sums as ``sglang:kv_cost_*_total``), the worker's
    ``page_size`` and its live ``prefetch_threshold`` (tokens)."""

    page_size: int
    prefetch_threshold: int
    operations: dict[str, list[KVCostBucket]]


class CostProbeRequest(_Strict):
    """Body of ``POST /hicache/costs/probe`` (optional): ``sizes`` in tokens (1 to 8, each rounded up to
    whole pages; None: 16, 256, 1024, 4096 capped by the free slots and one prefill pass)."""

    sizes: list[StrictInt] | None = Field(default=None, min_length=1, max_length=8)  # not true, not "16"


class CostProbeMeasure(_Strict):
    """One probed operation (``load_back``, ``prefetch`` or ``prefill``): ``tokens`` moved or computed in
    wall ``seconds``."""

    operation: str
    tokens: int
    seconds: float


class CostProbeSkip(_Strict):
    """An operation the probe did not measure at ``tokens``, and ``why``."""

    operation: str
    tokens: int
    why: str


class CostProbeResult(_Strict):
    """``POST /hicache/costs/probe`` answer: what the probe measured (also added to ``GET /hicache/costs``
    and ``sglang:kv_cost_*_total``) and what it skipped."""

    page_size: int
    measured: list[CostProbeMeasure]
    skipped: list[CostProbeSkip]


class PdRoleSwitchRequest(_Strict):
    """Body of ``POST /pd_role_switch`` (``--enable-pd-role-switch``): the role to become."""

    new_role: PdRole


class PdRoleSwitchResponse(_Strict):
    """``POST /pd_role_switch`` answer (upstream's ``PdRoleSwitchReqOutput``), on success and on refusal.

    ``safe_to_restore`` is false only when the worker was left unhealthy (restart required)."""

    success: bool
    message: str
    old_role: str
    new_role: str
    safe_to_restore: bool


def backend_extra_config(status: dict) -> dict:
    """The backend's own extra config from a :class:`StorageBackendStatus` body (JSON text, or a dict from an
    older reader), HiCache keys left out; ``{}`` when detached or empty."""
    extra = status.get("hicache_storage_backend_extra_config")
    if isinstance(extra, str):
        try:
            extra = json.loads(extra) if extra.strip() else {}
        except ValueError:
            return {"<unparsable>": extra}
    return {k: v for k, v in (extra or {}).items() if k not in HICACHE_EXTRA_KEYS}


CONFIG_FIELDS = tuple(ConfigUpdate.model_fields)
ATTACH_FIELDS = tuple(AttachRequest.model_fields)
HICACHE_STATUS_FIELDS = tuple(HiCacheConfigStatus.model_fields)

# HiCacheConfigStatus fields an upstream SGLang worker's /server_info carries as launch args of the same name.
_UPSTREAM_LAUNCH_FIELDS = (
    "hicache_storage_backend",
    "hicache_storage_prefetch_policy",
    "hicache_write_policy",
    "hicache_mem_layout",
    "hicache_io_backend",
    "radix_eviction_policy",
)
# The HiCache settings an extra config carries (HICACHE_EXTRA_KEYS less the one no status reports).
_EXTRA_SETTINGS = tuple(k for k in HICACHE_EXTRA_KEYS if k in HiCacheConfigStatus.model_fields)


def _upstream_extra(raw, name: str) -> tuple[dict, str]:
    """The settings an upstream worker's reported extra config ``raw`` holds (JSON text, or a table) and why
    a setting it leaves out is not reported."""
    why = (
        f"not reported: {name} reports only the extra config it was given, which does not set it (the engine "
        "runs its built-in default)"
    )
    if isinstance(raw, dict):
        return raw, why
    text = raw.strip() if isinstance(raw, str) else ""
    if text.startswith("@"):
        return {}, f"not reported: its extra config is a file ({text[1:]}) {name} read at start"
    try:
        parsed = json.loads(text) if text else {}
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict):
        return {}, f"not reported: its extra config is not a JSON object ({text[:80]!r})"
    return parsed, why


def reported_hicache_config(info: dict, storage: dict | None = None) -> tuple[dict, dict[str, str]]:
    """The live HiCache settings a worker's ``/server_info`` body ``info`` reports, under ``GET
    /hicache/config``'s names (:class:`HiCacheConfigStatus` fields), and ``{field: why}`` for each field it
    does not report. ``/server_info`` needs no key, so every worker can be read this way.

    - KVFleet: its ``hicache`` object, the live cache's settings (the same values ``GET /hicache/config``
      answers, runtime changes included); nothing unreported.
    - Upstream SGLang (no ``hicache`` object): its launch args of those names, and the HiCache settings its
      ``hicache_storage_backend_extra_config`` (JSON text) sets (``prefetch_threshold``, the timeout terms).
      Upstream's ``/server_info`` is its startup configuration: a runtime attach changes only what its
      ``GET /hicache/storage-backend`` answers (an admin route), so ``storage``, that answer when it could
      be read, wins for its four fields (the backend, its extra config, both policies). A setting the extra
      config leaves out is unreported (the engine then runs its own built-in default, which differs between
      SGLang releases, so none is assumed here); so are KVFleet's own settings (admission filters,
      automatic detach) and anything the release's ``/server_info`` lacks.
    - Either without ``--enable-hierarchical-cache``: ``({}, {})``, no HiCache settings to report.
    """
    if "hicache" in info:
        return dict(info["hicache"] or {}), {}
    if not info.get("enable_hierarchical_cache"):
        return {}, {}
    name = f"SGLang {info.get('version') or '(version not reported)'}"
    live = {k: v for k, v in (storage or {}).items() if k in StorageBackendStatus.model_fields}
    args = {**info, **live}
    config = {k: args[k] for k in _UPSTREAM_LAUNCH_FIELDS if k in args}
    unreported = {k: f"{name}'s /server_info has no {k}" for k in _UPSTREAM_LAUNCH_FIELDS if k not in args}
    extra, why = _upstream_extra(args.get("hicache_storage_backend_extra_config"), name)
    backend_own = {k: v for k, v in extra.items() if k not in HICACHE_EXTRA_KEYS}
    config["hicache_storage_backend_extra_config"] = backend_own or None  # as KVFleet's: the backend's part
    for key in _EXTRA_SETTINGS:
        if key in extra:
            config[key] = extra[key]
        else:
            unreported[key] = why
    for key in HICACHE_STATUS_FIELDS:
        if key not in config and key not in unreported:
            unreported[key] = f"no such setting on {name} (KVFleet's)"
    return config, unreported


# Engines a fleet member can run and what each worker was found able to do (probed by its agent,
# ``engine/agent/probe.py``; recorded by the control plane, which offers only the operations a worker
# supports).
ENGINE_KINDS = ("kvfleet", "sglang")
CAPABILITIES: dict[str, str] = {
    "storage_attach": "attach and detach an L3 backend at runtime (PUT/DELETE /hicache/storage-backend)",
    "runtime_config": "change HiCache settings at runtime (GET/PUT /hicache/config)",
    "role_switch": "switch its PD role in place (POST /pd_role_switch)",
    "exact_idle": "/server_info is_idle, counting HTTP requests and cache I/O in flight",
    "load_report": "GET /v1/loads: running and queued requests per DP rank",
    "recorded_trace": "GET /recorded_trace: the traffic the capacity what-if replays",
}
WORKER_SECRET_FIELDS = (
    "admin_api_key",
    "api_key",
    "ssl_keyfile_password",
    "watermark_key",
    "watermark_key_b",
)
"""``/server_info`` fields that hold a secret: KVFleet masks them; upstream SGLang (0.5.23) answers
``admin_api_key`` and ``api_key`` in clear text to anyone, so readers drop them (:func:`without_secrets`)."""


def without_secrets(info: dict) -> dict:
    """``info`` (a ``/server_info`` body) without :data:`WORKER_SECRET_FIELDS`, at the top level and in
    upstream's ``internal_states`` entries."""
    clean = {k: v for k, v in info.items() if k not in WORKER_SECRET_FIELDS}
    if isinstance(clean.get("internal_states"), list):
        clean["internal_states"] = [
            {k: v for k, v in s.items() if k not in WORKER_SECRET_FIELDS} if isinstance(s, dict) else s
            for s in clean["internal_states"]
        ]
    return clean


def missing_capability(capability: str, engine: str, version: str) -> str:
    """Why a worker lacks ``capability``, for the console and API errors: what to do instead."""
    name = f"SGLang {version}" if engine == "sglang" else f"this {engine} worker"
    if engine == "kvfleet" and capability in ("runtime_config", "storage_attach"):
        return (
            f"{name} did not answer its HiCache admin routes: it needs --enable-hierarchical-cache and "
            "--admin-api-key, and the inventory its admin key"
        )
    if capability == "runtime_config":
        return f"needs a restart on {name}: it has no PUT /hicache/config (change its launch flags instead)"
    if capability == "storage_attach":
        return (
            f"{name} cannot attach L3 at runtime: it needs --enable-hierarchical-cache and --admin-api-key "
            "(and its admin key in the inventory)"
        )
    if capability == "role_switch":
        return f"{name} switches role by a restart in the other --disaggregation-mode"
    if capability == "exact_idle":
        return (
            f"{name}: idle is read from /v1/loads (requests running and queued); requests its HTTP server "
            "has not queued yet and cache I/O in flight are not visible (its own check refuses then)"
        )
    if capability == "load_report":
        return f"{name} answers no GET /v1/loads (its /server_info is_idle is used)"
    if capability == "recorded_trace":
        return f"{name} records no traffic: calibration needs a KVFleet worker started with --record-trace"
    return f"not available on {name}"
