"""Storage profiles name the L3 backends a worker can attach: the engine's registered ones (aibrix, file,
lmcache, mooncake, nixl, dynamic); any other name is refused naming the field and changes nothing."""

import importlib.util

import pytest

from controlplane.inventory.models import StorageProfile

URL = "/api/v1/inventory/storage-profiles/"


@pytest.mark.django_db
def test_a_nixl_profile_is_kept_and_an_unbuilt_backend_is_refused(api_as):
    from engine.cache.storage.registry import registered_backends

    offered = sorted(v for v, _ in StorageProfile._meta.get_field("backend").choices)
    assert offered == registered_backends()  # the control plane offers exactly what the engine builds
    ops = api_as("operator")
    made = ops.post(
        URL, {"name": "nvme", "backend": "nixl", "extra_config": {"file_path": "/l3"}}, format="json"
    )
    assert made.status_code == 201, made.content
    aibrix = {"l2_cache_backend": "ROCKSDB", "rocksdb_root": "/l3/rocksdb"}
    made = ops.post(URL, {"name": "rocksdb", "backend": "aibrix", "extra_config": aibrix}, format="json")
    assert made.status_code == 201, made.content
    lmcache = {"lmcache_url": "lm://lmcache:65432"}
    made = ops.post(URL, {"name": "lm", "backend": "lmcache", "extra_config": lmcache}, format="json")
    assert made.status_code == 201, made.content
    refused = ops.post(URL, {"name": "3fs", "backend": "hf3fs", "extra_config": {}}, format="json")
    assert refused.status_code == 400 and "backend" in refused.json()["error"]["detail"]
    assert list(StorageProfile.objects.values_list("name", flat=True)) == ["lm", "nvme", "rocksdb"]


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("backend", "extra", "says"),
    [
        ("lmcache", {"lmcache_urll": "lm://h:1"}, "lmcache_urll: not an lmcache backend key"),
        ("lmcache", {"lmcache_urll": "lm://h:1"}, "did you mean 'lmcache_url'?"),
        ("aibrix", {"rocksdb_rot": "/l3"}, "rocksdb_rot: not an AIBrix KVCache setting"),
        ("lmcache", {"lmcache_timeout_s": "ten"}, "lmcache_timeout_s: must be a number of seconds > 0"),
        ("mooncake", {"master_server_address": "m"}, "master_server_address: expected 'host:port'"),
        ("file", {"prefetch_timeout_max": -5}, "prefetch_timeout_max: must be >= 0, got -5"),
        ("file", {"prefetch_thresold": 3}, "prefetch_thresold: not a key of the file backend"),
        ("file", {"prefetch_thresold": 3}, "did you mean 'prefetch_threshold'?"),
        ("mooncake", {"global_segment_size": "lots"}, "global_segment_size: read only when this extra"),
    ],
)
def test_a_key_the_backend_does_not_take_is_refused_naming_it(api_as, backend, extra, says):
    """The worker's own flag check (keys and values), run when the profile is saved: before, any key or
    value was kept and an attach found it on the workers. Nothing is saved."""
    if backend == "aibrix" and importlib.util.find_spec("aibrix_kvcache") is None:
        pytest.skip("aibrix-kvcache not installed: its keys are checked where it is")
    refused = api_as("operator").post(
        URL, {"name": "bad", "backend": backend, "extra_config": extra}, format="json"
    )
    assert refused.status_code == 400, refused.content
    assert says in refused.json()["error"]["detail"]["extra_config"][0]
    assert not StorageProfile.objects.exists()
