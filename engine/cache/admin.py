"""Runtime L3 administration (docs/upstream.md H7), mixed into :class:`HiRadixCache`.

Attach, detach (idempotent), clear, policy updates and the status the server reports. Every refusal is a
:class:`CacheAdminError` and changes nothing; the cache refuses while its own I/O is in flight (the
scheduler checks request idleness before calling). No store call runs on the scheduler thread when the
server drives these: a runtime attach builds the backend (which may talk to a remote store) with
:meth:`prepare_storage_backend` off that thread, then installs it there; a detach takes the backend out
there (:meth:`take_storage_backend`) and closes it off it; a clear pauses L3 I/O there
(:meth:`pause_storage_backend`), wipes the store off it and resumes there. An unresponsive store then stalls
only the admin request, never serving (SGLang runs these store calls on its scheduler).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from engine.cache.config import (
    PREFETCH_POLICIES,
    WRITE_POLICIES,
    parse_extra_config,
    split_extra_config,
)
from engine.cache.storage.base import HiCacheStorage, HiCacheStorageConfig
from engine.cache.storage.health import BreakerSettings, StorageHealth
from engine.cache.storage.registry import create_storage_backend
from engine.cache.storage.shards import ShardedStorage, ShardMap, shard_map

_POLICY_FIELDS = (
    "prefetch_policy",
    "write_policy",
    "prefetch_threshold",
    "prefetch_timeout_base",
    "prefetch_timeout_per_ki_token",
    "prefetch_timeout_max",
    "eviction_policy",
    "l2_admission",
    "l3_admission",
)


class CacheAdminError(ValueError):
    """A refused admin operation (attach/detach/clear/update); nothing was changed."""


@dataclass
class PreparedBackend:
    """A started L3 backend the cache is not using: prepared for an attach, taken out by a detach or paused
    for a clear. ``extra`` is the parsed extra config (cache-level keys are applied when it is installed).
    ``close()`` it when it is not installed again."""

    name: str
    instance: HiCacheStorage
    extra: dict
    namespace: str

    def close(self) -> None:
        self.instance.close()

    def clear(self) -> str:
        """Delete every page in the store (any thread; it may wait on a remote store); raises
        ``CacheAdminError`` when the store refuses."""
        try:
            self.instance.clear()
        except Exception as exc:
            raise CacheAdminError(f"clear failed: {exc}") from exc
        return f"Cleared storage backend {self.name!r}"


class StorageAdminMixin:
    """Storage admin methods of :class:`~engine.cache.hiradix_cache.HiRadixCache` (uses its controller,
    host pool, tree, config and rank identity)."""

    def _check_admin(self, action: str) -> None:
        if self.controller is None:
            raise CacheAdminError(f"Reject {action}: hierarchical cache is not enabled")
        if self.storage_paused is not None:
            raise CacheAdminError(
                f"Reject {action}: a clear of storage backend {self.backend_name!r} is running"
            )
        io = {k: v for k, v in self.inflight_io().items() if v}
        if io:
            named = ", ".join(f"{k}={v}" for k, v in io.items())
            raise CacheAdminError(f"Reject {action}: cache I/O in flight ({named}): not idle")

    def attach_storage_backend(
        self,
        backend: str | HiCacheStorage | PreparedBackend,
        extra_config_json: str | None = None,
        prefetch_policy: str | None = None,
        write_policy: str | None = None,
    ) -> str:
        """Attach an L3 backend by registry name, a ready instance or a :class:`PreparedBackend` (built
        with ``prepare_storage_backend``; its extra config is used) at runtime; returns a message.

        The extra config is always parsed and checked. Same backend already attached: only the given
        policies change (upstream) and the message says when the extra config differs from the live one.
        Raises ``CacheAdminError`` (and changes nothing; a prepared backend is then the caller's to close)
        for a bad policy or extra config, another backend attached ("Detach first"), cache I/O in flight,
        or a backend that fails to start.
        """
        self._check_policies(prefetch_policy, write_policy)
        name = self._backend_label(backend)
        try:
            _, backend_extra = split_extra_config(self.config, parse_extra_config(extra_config_json))
        except ValueError as exc:
            raise CacheAdminError(str(exc)) from exc
        policies = {
            k: v for k, v in (("prefetch_policy", prefetch_policy), ("write_policy", write_policy)) if v
        }
        if self.backend_name is not None:
            if name != self.backend_name:
                raise CacheAdminError(f"storage backend {self.backend_name!r} is attached; Detach first.")
            self._check_admin("attach")
            self.config = self.config.updated(**policies)
            message = f"storage backend {name!r} already enabled; policies updated"
            if extra_config_json is not None and backend_extra != dict(self.config.extra_config):
                message += "; the extra config was not changed (detach first to change it)"
            return message
        self._check_admin("attach")
        if not isinstance(backend, PreparedBackend):
            backend = self.prepare_storage_backend(backend, extra_config_json)
        self._install(backend, policies)
        return f"Attached storage backend {name!r}"

    @staticmethod
    def _backend_label(backend: str | HiCacheStorage | PreparedBackend) -> str:
        if isinstance(backend, PreparedBackend):
            return backend.name
        return backend if isinstance(backend, str) else type(backend).__name__

    def _check_policies(self, prefetch_policy: str | None, write_policy: str | None) -> None:
        if prefetch_policy is not None and prefetch_policy not in PREFETCH_POLICIES:
            raise CacheAdminError(
                f"hicache_storage_prefetch_policy: {prefetch_policy!r} is not one of {PREFETCH_POLICIES}"
            )
        if write_policy is not None and write_policy not in WRITE_POLICIES:
            raise CacheAdminError(f"hicache_write_policy: {write_policy!r} is not one of {WRITE_POLICIES}")

    def prepare_storage_backend(
        self, backend: str | HiCacheStorage, extra: str | dict | None = None
    ) -> PreparedBackend:
        """Build and start backend ``backend`` (a registry name or an instance) with ``extra`` (JSON text or
        a dict) and register the host pool with it, without attaching it. Safe on any thread (it reads only
        the cache's fixed layout and identity). Raises ``CacheAdminError`` naming what failed."""
        if self.controller is None:
            raise CacheAdminError("Reject attach: hierarchical cache is not enabled")
        name = self._backend_label(backend)
        try:
            extra = extra if isinstance(extra, dict) else parse_extra_config(extra)
            config, backend_extra = split_extra_config(self.config, extra)
            shards = self._storage_shards(config.tp_lcm_size)
        except ValueError as exc:
            raise CacheAdminError(str(exc)) from exc
        layout = self.host_pool.layout
        if name == "mooncake" and layout == "layer_first":
            raise CacheAdminError("mooncake storage needs hicache_mem_layout page_first or page_first_direct")
        storage_config = HiCacheStorageConfig(
            tp_rank=self.kv_shard[0],
            tp_size=self.kv_shard[1],
            is_mla_model=self.replicated_kv,
            model_name=self.model_name,
            page_size=self.page_size,
            kv_dtype=str(self.device_pool.dtype),
            kv_format=self.device_pool.kv_format.layout_name,
            layout=layout,
            extra_config=backend_extra,
            producer=self.kv_producer,
            tp_lcm_size=shards.lcm if shards is not None else None,
        )
        try:
            if isinstance(backend, str):
                instance = create_storage_backend(backend, storage_config, self.host_pool)
            else:
                instance = backend
                instance.register_mem_pool_host(self.host_pool)
            if shards is not None:  # every backend stores this rank's heads as lcm-granular shards
                instance = ShardedStorage(instance, shards, self.host_pool)
        except Exception as exc:
            raise CacheAdminError(f"storage backend {name!r} failed to start: {exc}") from exc
        return PreparedBackend(name, instance, extra, storage_config.namespace)

    def _storage_shards(self, tp_lcm_size: int | None) -> ShardMap | None:
        """This rank's storage shards for ``tp_lcm_size`` (None without it, and for replicated MLA-style KV,
        whose keys every rank and TP size shares already). Raises ``ValueError`` naming ``tp_lcm_size``."""
        if tp_lcm_size is None or self.replicated_kv:
            return None
        return shard_map(tp_lcm_size, self.tp_size, self.kv_shard, self.host_pool.num_kv_heads)

    def _install(self, prepared: PreparedBackend, policies: dict) -> None:
        """Start using ``prepared`` (scheduler thread): config, controller, page keys for the whole tree."""
        config, _ = split_extra_config(self.config.updated(**policies), prepared.extra)
        self.config = config.updated(storage_backend=prepared.name)
        self.backend, self.backend_name = prepared.instance, prepared.name
        self.backend_attached_extra = dict(prepared.extra)
        self._start_storage_io(prepared)
        for node in self.tree.nodes():
            if node.hash_value is None:
                self._ensure_hashes(node)
        self._backup_host_pages()

    def _backup_host_pages(self) -> None:
        """Back up to the new L3 every node already in L2, parents before children (prefix order), so the
        L3 chain of a conversation cached before the attach starts at page 0. Attach runs with no cache I/O
        in flight, so every host copy is complete; a chain stops at a node without one."""
        stack = list(self.tree.root.children.values())
        while stack:
            node = stack.pop()
            # a tenant over its L3 cap (charge_l3 refuses): none of its chain below either
            if node.host_value is not None and self.policy.charge_l3(node):
                self._backup_to_storage(node)
                stack.extend(node.children.values())

    def _start_storage_io(self, backend: PreparedBackend) -> None:
        backup_skip = (self.replicated_kv and self.tp_rank != 0) or not self.kv_writer
        c = self.config
        health = StorageHealth(BreakerSettings(c.breaker_failures, c.breaker_latency_s, c.breaker_open_s))
        self.policy.caps.reset_l3()  # a new or cleared store: no tenant has pages in it yet
        self.controller.attach_storage(
            backend.instance, backend.namespace, c.prefetch_threshold, backup_skip, backend.name, health
        )

    def _stop_storage_io(self, action: str) -> PreparedBackend:
        """Stop the L3 threads (no store call) and unset ``backend``; the attached backend, as a
        :class:`PreparedBackend`. Raises ``CacheAdminError`` while cache I/O is in flight."""
        self._check_admin(action)
        namespace = self.controller.namespace
        try:
            instance = self.controller.detach_storage()
        except RuntimeError as exc:
            raise CacheAdminError(str(exc)) from exc
        self._apply_storage_events(lambda op, values: values)
        self.backend = None
        return PreparedBackend(
            self.backend_name, instance, dict(self.backend_attached_extra or {}), namespace
        )

    def take_storage_backend(self) -> PreparedBackend | None:
        """Stop using L3 without closing the backend (no store call, so fit for the scheduler thread): the
        detached backend, for the caller to ``close()`` (which may wait on its store), or None when none is
        attached. L3 data, L1/L2 contents and page keys stay. Raises ``CacheAdminError`` while cache I/O is
        in flight or a clear runs."""
        if self.backend is None and self.storage_paused is None:
            return None
        taken = self._stop_storage_io("detach")
        self.backend_name = self.backend_attached_extra = None
        self.config = self.config.updated(storage_backend=None)
        return taken

    def detach_storage_backend(self) -> str:
        """``take_storage_backend`` and close it on this thread (idempotent); returns a message."""
        taken = self.take_storage_backend()
        if taken is None:
            return "no storage backend attached"
        taken.close()
        return f"Detached storage backend {taken.name!r}"

    def pause_storage_backend(self) -> PreparedBackend:
        """Stop L3 I/O for a clear (no store call, so fit for the scheduler thread): the backend stays
        attached (name, config and reported status unchanged), nothing prefetches from or backs up to it,
        and other admin operations are refused until :meth:`resume_storage_backend`. Returns it, for the
        caller to ``clear()``. Raises ``CacheAdminError`` without a backend or while cache I/O is in
        flight."""
        if self.backend is None and self.storage_paused is None:
            raise CacheAdminError("no storage backend attached")
        self.storage_paused = self._stop_storage_io("clear")
        return self.storage_paused

    def resume_storage_backend(self, paused: PreparedBackend) -> None:
        """Use ``paused`` again after its clear (pages backed up before the clear are not sent again)."""
        self.storage_paused = None
        self.backend = paused.instance
        self._start_storage_io(paused)

    def clear_storage_backend(self) -> str:
        """Delete every page in the attached L3 backend (pause, clear, resume on this thread). Raises
        ``CacheAdminError``."""
        paused = self.pause_storage_backend()
        try:
            return paused.clear()
        finally:
            self.resume_storage_backend(paused)

    def update_policies(self, **fields) -> dict:
        """Change prefetch/write policies, threshold or timeouts at runtime; returns ``storage_status()``.

        Raises ``CacheAdminError`` naming a bad field or value, or while cache I/O is in flight.
        """
        unknown = [k for k in fields if k not in _POLICY_FIELDS]
        if unknown:
            raise CacheAdminError(
                f"{unknown[0]}: not a runtime HiCache setting (use {', '.join(_POLICY_FIELDS)})"
            )
        try:
            config = self.config.updated(**fields)
        except ValueError as exc:
            raise CacheAdminError(str(exc)) from exc
        self._check_admin("update")
        self.config = config
        self.controller.set_prefetch_threshold(config.prefetch_threshold)
        return self.storage_status()

    def storage_backend_status(self) -> dict:
        """The live attached backend under SGLang's ``GET /hicache/storage-backend`` names: the extra config
        it was attached with as JSON text (at start-up: the backend's part), None when detached."""
        cfg = self.config
        extra = self.backend_attached_extra
        return {
            "hicache_storage_backend": self.backend_name,
            "hicache_storage_backend_extra_config": (
                json.dumps(extra if extra is not None else dict(cfg.extra_config))
                if self.backend_name
                else None
            ),
            "hicache_storage_prefetch_policy": cfg.prefetch_policy,
            "hicache_write_policy": cfg.write_policy,
        }

    def storage_health(self) -> dict | None:
        """The attached L3 backend's breaker (``storage/health.py``): ``storage_backend``, ``state``
        (closed / half_open / open), ``transitions`` per state entered, ``calls``, ``failed_calls``,
        ``short_circuited``, ``dropped_backup_pages``, ``last_failure`` and its age in seconds; None when
        no backend is attached."""
        health = self.controller.health if self.controller is not None else None
        if health is None or self.backend_name is None:
            return None
        return {"storage_backend": self.backend_name, **vars(health.snapshot())}

    def storage_status(self) -> dict:
        """Live HiCache storage settings under SGLang's names."""
        cfg = self.config
        return {
            "hicache_storage_backend": self.backend_name,
            "hicache_storage_backend_extra_config": dict(cfg.extra_config) if self.backend_name else None,
            "hicache_storage_prefetch_policy": cfg.prefetch_policy,
            "hicache_write_policy": cfg.write_policy,
            "hicache_mem_layout": cfg.mem_layout,
            "hicache_io_backend": cfg.io_backend,
            "prefetch_threshold": cfg.prefetch_threshold,
            "prefetch_timeout_base": cfg.prefetch_timeout_base,
            "prefetch_timeout_per_ki_token": cfg.prefetch_timeout_per_ki_token,
            "prefetch_timeout_max": cfg.prefetch_timeout_max,
            "radix_eviction_policy": cfg.eviction_policy,
            "l2_admission": cfg.l2_admission,
            "l3_admission": cfg.l3_admission,
        }
