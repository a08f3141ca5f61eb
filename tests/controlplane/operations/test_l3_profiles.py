"""``aibrix`` and ``lmcache`` storage profiles attached and detached by control-plane operations on a real
(tiny-model) engine, one per module: the worker reads back AIBrix KVCache with the profile's extra config, or
talks to the profile's real ``lmcache_server``, then has no backend; a profile the backend refuses (a key
AIBrix does not take, a URL where no LMCache server answers) fails the attach naming the key and leaves the
worker as it was."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from cp_factories import EngineWorkerFactory, StorageProfileFactory

from controlplane.operations.services import operation_create
from engine.model.runner import ModelRunner
from engine.ports import free_port
from engine.server.args import parse_args
from engine.server.builder import build_engine
from tests.support.operations import drive

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "server"))
from server_testlib import ThreadedServer  # noqa: E402

pytestmark = pytest.mark.django_db
KEY = "l3-profiles-admin-key"


@pytest.fixture(scope="module")
def engine_server(tiny_model_dir):
    """One tiny engine behind HTTP for the module; every test leaves it without a backend."""
    args = parse_args(["--model-path", str(tiny_model_dir), "--enable-hierarchical-cache",
                       "--page-size", "16", "--hicache-ratio", "4", "--admin-api-key", KEY])  # fmt: skip
    engine = build_engine(args, runner=ModelRunner(tiny_model_dir, dtype="float32", device="cpu"))
    with ThreadedServer(engine) as server:
        yield server
    engine.scheduler.stop()


@pytest.fixture
def worker(engine_server):
    assert engine_server.engine.scheduler.cache.storage.backend is None
    return engine_server, EngineWorkerFactory(url=engine_server.url, admin_key=KEY)


def test_an_aibrix_profile_attaches_and_detaches_like_the_others(worker, tmp_path):
    pytest.importorskip("aibrix_kvcache")
    server, registered = worker
    extra = {"l2_cache_backend": "ROCKSDB", "rocksdb_root": str(tmp_path / "rocksdb")}
    profile = StorageProfileFactory(backend="aibrix", extra_config=extra)
    op = drive(operation_create(kind="attach", workers=[registered], storage_profile=profile, actor=None))
    target = op.targets.get()
    assert op.state == "succeeded", target.explanation
    assert target.after["hicache_storage_backend"] == "aibrix"
    registered.refresh_from_db()
    assert (registered.storage_backend, registered.storage_profile_id) == ("aibrix", profile.pk)
    assert server.engine.scheduler.cache.storage.backend.settings["ROCKSDB_ROOT"] == extra["rocksdb_root"]

    op = drive(operation_create(kind="detach", workers=[registered], actor=None))
    assert op.state == "succeeded", op.targets.get().explanation
    assert server.engine.scheduler.cache.storage.backend is None

    bad = StorageProfileFactory(name="bad", backend="aibrix", extra_config={"l2_cache_backend": "REDIS"})
    op = drive(operation_create(kind="attach", workers=[registered], storage_profile=bad, actor=None))
    assert op.state != "succeeded"
    assert "l2_cache_backend: unknown AIBrix L2 backend 'REDIS'" in op.targets.get().explanation
    assert server.engine.scheduler.cache.storage.backend is None


def test_an_lmcache_profile_attaches_and_detaches_like_the_others(worker, lmcache_server):
    server, registered = worker
    profile = StorageProfileFactory(backend="lmcache", extra_config={"lmcache_url": lmcache_server.url})
    op = drive(operation_create(kind="attach", workers=[registered], storage_profile=profile, actor=None))
    target = op.targets.get()
    assert op.state == "succeeded", target.explanation
    assert target.after["hicache_storage_backend"] == "lmcache"
    registered.refresh_from_db()
    assert (registered.storage_backend, registered.storage_profile_id) == ("lmcache", profile.pk)
    backend = server.engine.scheduler.cache.storage.backend
    assert f"lm://{backend.connections.address}" == lmcache_server.url

    op = drive(operation_create(kind="detach", workers=[registered], actor=None))
    assert op.state == "succeeded", op.targets.get().explanation
    assert server.engine.scheduler.cache.storage.backend is None

    gone = {"lmcache_url": f"lm://127.0.0.1:{free_port()}"}
    bad = StorageProfileFactory(name="bad", backend="lmcache", extra_config=gone)
    op = drive(operation_create(kind="attach", workers=[registered], storage_profile=bad, actor=None))
    assert op.state != "succeeded"
    assert "lmcache_url: no LMCache server answers at" in op.targets.get().explanation
    assert server.engine.scheduler.cache.storage.backend is None
