"""The cache's L3 attachment (docs/upstream.md H7): :class:`StorageAttachment`, an object
:class:`~engine.cache.hiradix_cache.HiRadixCache` owns as ``cache.storage``.

Its state: the attached backend and its name, the extra config it was attached with, the backend while a
clear pauses it, and the L2 -> L3 backups in flight; the breaker (``storage/health.py``) is the
controller's, created here at each attach. Its operations: attach, detach (idempotent), pause / resume for a
clear, the status the server reports, and the L3 side of the cache's data movement (page keys, backups).
Every refusal is a :class:`CacheAdminError` and changes nothing; the attachment refuses while the cache's
own I/O is in flight (the scheduler checks request idleness before calling). No store call runs on the
scheduler thread when the server drives these: a runtime attach builds the backend (which may talk to a
remote store) with :meth:`StorageAttachment.prepare` off that thread, then installs it there; a detach takes
the backend out there (:meth:`StorageAttachment.take`) and closes it off it; a clear pauses L3 I/O there
(:meth:`StorageAttachment.pause`), wipes the store off it and resumes there. An unresponsive store then
stalls only the admin request, never serving (SGLang runs these store calls on its scheduler).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.cache.config import (
    PREFETCH_POLICIES,
    WRITE_POLICIES,
    parse_extra_config,
    split_extra_config,
)
from engine.cache.controller import BackupOperation
from engine.cache.keys import page_hashes, salted_namespace
from engine.cache.radix_tree import TreeNode
from engine.cache.storage.autodetach import AutoDetach, AutoDetachSettings, Prober
from engine.cache.storage.base import HiCacheStorage, HiCacheStorageConfig
from engine.cache.storage.health import BreakerSettings, StorageHealth
from engine.cache.storage.registry import create_storage_backend
from engine.cache.storage.shards import ShardedStorage, ShardMap, shard_map

if TYPE_CHECKING:
    from engine.cache.protocols import CacheParts

logger = logging.getLogger(__name__)

POLICY_FIELDS = (
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
    namespace: bytes

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


class StorageAttachment:
    """The L3 backend attached to ``cache`` (uses its controller, host pool, tree, config and rank identity).

    ``name`` / ``backend``: the attached backend (None when detached; ``backend`` is also None while a clear
    pauses it, ``paused`` then holds it); ``extra``: the extra config it was attached with (None when
    detached); ``backups_inflight``: L2 -> L3 backups not yet acknowledged.
    """

    def __init__(self, cache: CacheParts) -> None:
        self.cache = cache
        self.name: str | None = None
        self.backend: HiCacheStorage | None = None
        self.paused: PreparedBackend | None = None
        self.extra: dict | None = None
        self.backups_inflight = 0
        self.auto: AutoDetach | None = None  # with ``auto_detach_after_s`` (storage/autodetach.py)
        self._prober: Prober | None = None

    # -- admin -----------------------------------------------------------------------------------------------
    def check_idle(self, action: str, storage_only: bool = False) -> None:
        """Raise ``CacheAdminError`` naming ``action`` without a hierarchical cache, while a clear runs or
        while cache I/O is in flight (``storage_only``: L3 I/O only, prefetches and backups; L1 <-> L2
        copies never touch the store)."""
        if self.cache.controller is None:
            raise CacheAdminError(f"Reject {action}: hierarchical cache is not enabled")
        if self.paused is not None:
            raise CacheAdminError(f"Reject {action}: a clear of storage backend {self.name!r} is running")
        kinds = ("prefetches", "backups") if storage_only else None
        io = {k: v for k, v in self.cache.inflight_io().items() if v and (kinds is None or k in kinds)}
        if io:
            named = ", ".join(f"{k}={v}" for k, v in io.items())
            raise CacheAdminError(f"Reject {action}: cache I/O in flight ({named}): not idle")

    def attach(
        self,
        backend: str | HiCacheStorage | PreparedBackend,
        extra_config_json: str | None = None,
        prefetch_policy: str | None = None,
        write_policy: str | None = None,
    ) -> str:
        """Attach an L3 backend by registry name, a ready instance or a :class:`PreparedBackend` (built
        with :meth:`prepare`; its extra config is used) at runtime; returns a message.

        The extra config is always parsed and checked. Same backend already attached: only the given
        policies change (upstream) and the message says when the extra config differs from the live one.
        Raises ``CacheAdminError`` (and changes nothing; a prepared backend is then the caller's to close)
        for a bad policy or extra config, another backend attached ("Detach first"), cache I/O in flight,
        or a backend that fails to start.
        """
        cache = self.cache
        _check_policies(prefetch_policy, write_policy)
        name = _backend_label(backend)
        try:
            _, backend_extra = split_extra_config(cache.config, parse_extra_config(extra_config_json))
        except ValueError as exc:
            raise CacheAdminError(str(exc)) from exc
        policies = {
            k: v for k, v in (("prefetch_policy", prefetch_policy), ("write_policy", write_policy)) if v
        }
        if self.name is not None:
            if name != self.name:
                raise CacheAdminError(f"storage backend {self.name!r} is attached; Detach first.")
            self.check_idle("attach")
            cache.config = cache.config.updated(**policies)
            message = f"storage backend {name!r} already enabled; policies updated"
            if extra_config_json is not None and backend_extra != dict(cache.config.extra_config):
                message += "; the extra config was not changed (detach first to change it)"
            return message
        self.check_idle("attach")
        if not isinstance(backend, PreparedBackend):
            backend = self.prepare(backend, extra_config_json)
        self._end_auto_episode("an operator's attach")
        self.install(backend, policies)
        return f"Attached storage backend {name!r}"

    def prepare(self, backend: str | HiCacheStorage, extra: str | dict | None = None) -> PreparedBackend:
        """Build and start backend ``backend`` (a registry name or an instance) with ``extra`` (JSON text or
        a dict) and register the host pool with it, without attaching it. Safe on any thread (it reads only
        the cache's fixed layout and identity). Raises ``CacheAdminError`` naming what failed."""
        cache = self.cache
        if cache.controller is None or cache.host_pool is None:
            raise CacheAdminError("Reject attach: hierarchical cache is not enabled")
        name = _backend_label(backend)
        try:
            extra = extra if isinstance(extra, dict) else parse_extra_config(extra)
            config, backend_extra = split_extra_config(cache.config, extra)
            shards = self._shards(config.tp_lcm_size)
        except ValueError as exc:
            raise CacheAdminError(str(exc)) from exc
        layout = cache.host_pool.layout
        if name == "mooncake" and layout == "layer_first":
            raise CacheAdminError("mooncake storage needs hicache_mem_layout page_first or page_first_direct")
        storage_config = HiCacheStorageConfig(
            tp_rank=cache.kv_shard[0],
            tp_size=cache.kv_shard[1],
            is_mla_model=cache.replicated_kv,
            model_name=cache.model_name,
            page_size=cache.page_size,
            kv_dtype=str(cache.device_pool.dtype),
            kv_format=cache.device_pool.kv_format.layout_name,
            layout=layout,
            extra_config=backend_extra,
            producer=cache.kv_producer,
            tp_lcm_size=shards.lcm if shards is not None else None,
        )
        try:
            if isinstance(backend, str):
                instance = create_storage_backend(backend, storage_config, cache.host_pool)
            else:
                instance = backend
                instance.register_mem_pool_host(cache.host_pool)
            if shards is not None:  # every backend stores this rank's heads as lcm-granular shards
                instance = ShardedStorage(instance, shards, cache.host_pool)
        except Exception as exc:
            raise CacheAdminError(f"storage backend {name!r} failed to start: {exc}") from exc
        return PreparedBackend(name, instance, extra, storage_config.namespace)

    def _shards(self, tp_lcm_size: int | None) -> ShardMap | None:
        """This rank's storage shards for ``tp_lcm_size`` (None without it, and for replicated MLA-style KV,
        whose keys every rank and TP size shares already). Raises ``ValueError`` naming ``tp_lcm_size``."""
        cache = self.cache
        if tp_lcm_size is not None and cache.replicated_kv:
            logger.info(
                "tp_lcm_size %d: no-op for replicated (MLA) KV, whose L3 keys name no rank", tp_lcm_size
            )
        if tp_lcm_size is None or cache.replicated_kv:
            return None
        assert cache.host_pool is not None
        return shard_map(tp_lcm_size, cache.tp_size, cache.kv_shard, cache.host_pool.num_kv_heads)

    def install(self, prepared: PreparedBackend, policies: dict, health: StorageHealth | None = None) -> None:
        """Start using ``prepared`` (scheduler thread): config, controller, page keys for the whole tree,
        then a backup of every L2 page. ``health``: the breaker to keep (an automatic re-attach's); else a
        new one. The config's ``auto_detach_after_s`` (None: never) arms the automatic detach."""
        cache = self.cache
        config, _ = split_extra_config(cache.config.updated(**policies), prepared.extra)
        cache.config = config.updated(storage_backend=prepared.name)
        self.backend, self.name = prepared.instance, prepared.name
        self.extra = dict(prepared.extra)
        self._arm_auto()
        self._start_io(prepared, health)
        for node in cache.tree.nodes():
            if node.hash_value is None:
                self.ensure_hashes(node)
        self._backup_host_pages()

    def _backup_host_pages(self) -> None:
        """Back up to the new L3 every node already in L2, parents before children (prefix order), so the
        L3 chain of a conversation cached before the attach starts at page 0. Attach runs with no cache I/O
        in flight, so every host copy is complete; a chain stops at a node without one."""
        stack = list(self.cache.tree.root.children.values())
        while stack:
            node = stack.pop()
            # a tenant over its L3 cap (charge_l3 refuses): none of its chain below either
            if node.host_value is not None and self.cache.policy.charge_l3(node):
                self.backup(node)
                stack.extend(node.children.values())

    def _arm_auto(self) -> None:
        """Set up (or keep, counters and all) the automatic detach for the config just installed."""
        c = self.cache.config
        if c.auto_detach_after_s is None:
            self.auto = None
            return
        settings = AutoDetachSettings(c.auto_detach_after_s, c.breaker_open_s, c.breaker_latency_s)
        if self.auto is None:
            self.auto = AutoDetach(settings)
        else:
            self.auto.settings = settings

    def _start_io(self, backend: PreparedBackend, health: StorageHealth | None = None) -> None:
        cache = self.cache
        assert cache.controller is not None
        backup_skip = (cache.replicated_kv and cache.tp_rank != 0) or not cache.kv_writer
        c = cache.config
        health = health or StorageHealth(
            BreakerSettings(
                c.breaker_failures, c.breaker_latency_s, c.breaker_open_s, ramp_s=c.breaker_ramp_s
            )
        )
        cache.policy.caps.reset_l3()  # a new or cleared store: no tenant has pages in it yet
        cache.controller.attach_storage(
            backend.instance, backend.namespace, c.prefetch_threshold, backup_skip, backend.name, health
        )

    def _stop_io(self, action: str, storage_only: bool = False) -> PreparedBackend:
        """Stop the L3 threads (no store call) and unset ``backend``; the attached backend, as a
        :class:`PreparedBackend`. Raises ``CacheAdminError`` while cache I/O is in flight (``check_idle``)."""
        self.check_idle(action, storage_only)
        controller = self.cache.controller
        assert controller is not None and self.name is not None
        namespace = controller.namespace
        try:
            instance = controller.detach_storage()
        except RuntimeError as exc:
            raise CacheAdminError(str(exc)) from exc
        assert instance is not None and namespace is not None, "a named backend is attached"
        self.cache.apply_storage_events(lambda op, values: values)
        self.backend = None
        return PreparedBackend(self.name, instance, dict(self.extra or {}), namespace)

    def take(self) -> PreparedBackend | None:
        """Stop using L3 without closing the backend (no store call, so fit for the scheduler thread): the
        detached backend, for the caller to ``close()`` (which may wait on its store), or None when none is
        attached. L3 data, L1/L2 contents and page keys stay. Raises ``CacheAdminError`` while cache I/O is
        in flight or a clear runs."""
        if self.backend is None and self.paused is None:
            return self._end_auto_episode("an operator's detach")
        taken = self._stop_io("detach")
        self.name = self.extra = None
        self.cache.config = self.cache.config.updated(storage_backend=None)
        return taken

    # -- automatic detach / re-attach (storage/autodetach.py) ------------------------------------------------
    def auto_step(self) -> None:
        """Once per scheduler iteration, on every rank (``cache.reduce`` makes them agree): take the backend
        out when its breaker has not been closed for ``auto_detach_after_s`` and no L3 I/O is in flight;
        re-install it once a background probe found the store answering and no cache I/O is in flight.
        Without the key: nothing (no cross-rank call either). Never waits on the store."""
        auto = self.auto
        if auto is None or self.paused is not None:
            return
        try:
            self._auto_step(auto)
        except CacheAdminError as exc:  # a storage thread that did not stop: state kept, next step retries
            logger.warning("automatic L3 detach/re-attach deferred: %s", exc)

    def _auto_step(self, auto: AutoDetach) -> None:
        controller = self.cache.controller
        assert controller is not None
        if self.backend is not None:
            want = auto.due(controller.health)
            io = self.cache.inflight_io()
            idle = not io["prefetches"] and not io["backups"]
            not_wanted, all_idle = self.cache.reduce("min", [0 if want else 1, int(idle)])
            if not not_wanted and all_idle:
                self._auto_detach(auto)
        elif auto.kept is not None:
            ready, all_idle = self.cache.reduce("min", [int(auto.answered()), int(self.cache.is_io_idle())])
            if ready and all_idle:
                self._auto_attach(auto)

    def _auto_detach(self, auto: AutoDetach) -> None:
        assert self.cache.controller is not None, "auto-detach runs only with an attached backend"
        health = self.cache.controller.health
        down = health.down_for() if health is not None else None
        taken = self._stop_io("auto-detach", storage_only=True)
        self.name = self.extra = None
        self.cache.config = self.cache.config.updated(storage_backend=None)
        auto.detached(taken)
        self._prober = Prober(auto)
        logger.warning(
            "L3 backend %r detached automatically: its breaker has not closed for %.1f s "
            "(auto_detach_after_s=%g); probing it in the background to re-attach",
            taken.name,
            down or 0.0,
            auto.settings.after_s,
        )

    def _auto_attach(self, auto: AutoDetach) -> None:
        kept = auto.kept
        assert self.cache.controller is not None, "a detached backend was attached to this controller"
        health = self.cache.controller.health
        self.check_idle("auto re-attach")
        self.install(kept, {}, health)
        auto.reattached()
        self._prober = None
        if health is not None:
            health.recovered()  # closed as by a successful probe: the backup ramp starts
        logger.warning(
            "L3 backend %r re-attached automatically after %d probe(s); backups ramp up over %g s",
            kept.name,
            auto.probes,
            self.cache.config.breaker_ramp_s,
        )

    def _end_auto_episode(self, why: str) -> PreparedBackend | None:
        """Stop probing and forget a backend taken out automatically: returns it (the caller's to close)."""
        if self._prober is not None:
            self._prober.stop()
            self._prober = None
        kept = self.auto.cancel() if self.auto is not None else None
        if kept is not None:
            logger.warning("automatic re-attach of L3 backend %r cancelled by %s", kept.name, why)
        return kept

    def detach(self) -> str:
        """:meth:`take` and close it on this thread (idempotent); returns a message."""
        taken = self.take()
        if taken is None:
            return "no storage backend attached"
        taken.close()
        return f"Detached storage backend {taken.name!r}"

    def pause(self) -> PreparedBackend:
        """Stop L3 I/O for a clear (no store call, so fit for the scheduler thread): the backend stays
        attached (name, config and reported status unchanged), nothing prefetches from or backs up to it,
        and other admin operations are refused until :meth:`resume`. Returns it, for the caller to
        ``clear()``. Raises ``CacheAdminError`` without a backend or while cache I/O is in flight."""
        if self.backend is None and self.paused is None:
            raise CacheAdminError("no storage backend attached")
        self.paused = self._stop_io("clear")
        return self.paused

    def resume(self, paused: PreparedBackend) -> None:
        """Use ``paused`` again after its clear (pages backed up before the clear are not sent again)."""
        self.paused = None
        self.backend = paused.instance
        self._start_io(paused)

    def clear(self) -> str:
        """Delete every page in the attached L3 backend (pause, clear, resume on this thread). Raises
        ``CacheAdminError``."""
        paused = self.pause()
        try:
            return paused.clear()
        finally:
            self.resume(paused)

    def close(self) -> None:
        """Close the attached backend, or one taken out automatically (after the controller's threads
        stopped), and forget it."""
        kept = self._end_auto_episode("shutdown")
        for backend in (self.backend, kept.instance if kept is not None else None):
            if backend is not None:
                backend.close()
        self.backend = self.name = None

    # -- status ----------------------------------------------------------------------------------------------
    def backend_status(self) -> dict:
        """The live attached backend under SGLang's ``GET /hicache/storage-backend`` names: the extra config
        it was attached with as JSON text (at start-up: the backend's part), None when detached."""
        cfg = self.cache.config
        extra = self.extra
        return {
            "hicache_storage_backend": self.name,
            "hicache_storage_backend_extra_config": (
                json.dumps(extra if extra is not None else dict(cfg.extra_config)) if self.name else None
            ),
            "hicache_storage_prefetch_policy": cfg.prefetch_policy,
            "hicache_write_policy": cfg.write_policy,
        }

    def health(self) -> dict | None:
        """The attached L3 backend's breaker (``storage/health.py``): ``storage_backend``, ``state``
        (closed / half_open / open), ``transitions`` per state entered, ``calls``, ``failed_calls``,
        ``short_circuited``, ``dropped_backup_pages``, ``last_failure`` and its age in seconds, and with
        ``auto_detach_after_s`` ``auto_detach`` (:meth:`AutoDetach.status`); None when no backend is
        attached and none was taken out automatically (while one is, it is reported under its name)."""
        controller = self.cache.controller
        health = controller.health if controller is not None else None
        auto = self.auto
        name = self.name or (auto.kept.name if auto is not None and auto.kept is not None else None)
        if health is None or name is None:
            return None
        return {
            "storage_backend": name,
            **vars(health.snapshot()),
            "auto_detach": auto.status() if auto is not None else None,
        }

    # -- L2 -> L3 --------------------------------------------------------------------------------------------
    def ensure_hashes(self, node: TreeNode) -> None:
        """Fill in missing page keys of ``node`` and its ancestors (chained from the root, whose children
        seed the chain with their salt's namespace)."""
        controller = self.cache.controller
        assert controller is not None and controller.namespace is not None, "a backend is attached"
        missing = []
        while node.hash_value is None:
            missing.append(node)
            assert node.parent is not None, f"{node}: the root has page keys (empty), so this is below it"
            node = node.parent
        for part in reversed(missing):
            assert part.parent is not None, f"{part} is below the root, so it has a parent"
            prior = part.parent.get_last_hash_value()
            seed = salted_namespace(controller.namespace, part.salt)
            part.hash_value = page_hashes(part.key, self.cache.page_size, prior, seed)

    def prefix_keys(self, node: TreeNode) -> list[str] | None:
        """The page keys from the root down to ``node`` when ``pass_prefix_keys`` is on, else None."""
        if not self.cache.config.pass_prefix_keys:
            return None
        keys: list[str] = []
        for part in reversed(self.cache.tree.path_to_root(node)):
            keys.extend(part.hash_value or [])
        return keys

    def backup(self, node: TreeNode) -> None:
        """Queue the L2 -> L3 backup of ``node``'s host copy (pinned until its ``BackupDone``)."""
        cache = self.cache
        assert cache.controller is not None
        self.ensure_hashes(node)
        cache.tree.protect_host(node)
        self.backups_inflight += 1
        assert node.parent is not None and node.host_value is not None and node.hash_value is not None, (
            f"{node}: an attached host copy with page keys (ensure_hashes above)"
        )
        prefix = self.prefix_keys(node.parent)
        cache.controller.backup_storage(BackupOperation(node.host_value, list(node.hash_value), node, prefix))


def _backend_label(backend: str | HiCacheStorage | PreparedBackend) -> str:
    if isinstance(backend, PreparedBackend):
        return backend.name
    return backend if isinstance(backend, str) else type(backend).__name__


def _check_policies(prefetch_policy: str | None, write_policy: str | None) -> None:
    if prefetch_policy is not None and prefetch_policy not in PREFETCH_POLICIES:
        raise CacheAdminError(
            f"hicache_storage_prefetch_policy: {prefetch_policy!r} is not one of {PREFETCH_POLICIES}"
        )
    if write_policy is not None and write_policy not in WRITE_POLICIES:
        raise CacheAdminError(f"hicache_write_policy: {write_policy!r} is not one of {WRITE_POLICIES}")
