"""The worker contract for HiCache runtime administration: request and response models of the admin routes.

One definition shared by the engine (``engine/server/admin.py`` validates with it and answers with it), the
control plane (``controlplane/operations/actions.py`` reads worker state through it) and the test fake
(``tests/controlplane/fakes.py``, checked against it). Field names are SGLang's (docs/upstream.md H7).

- ``PUT /hicache/storage-backend``: :class:`AttachRequest` -> 200 text, or 400 ``"Failed to attach ..."``.
- ``GET /hicache/storage-backend``: :class:`StorageBackendStatus`, read from the live cache.
- ``GET /hicache/config``, ``PUT /hicache/config`` (:class:`ConfigUpdate`): :class:`HiCacheConfigStatus`.
- ``POST /pd_role_switch`` (:class:`PdRoleSwitchRequest`): :class:`PdRoleSwitchResponse`; the role reads back
  as ``/server_info``'s ``disaggregation_mode``.

Imports only pydantic and the eviction policy names (no torch), so the control plane can use it.
"""

from __future__ import annotations

import json
from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, Field

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
