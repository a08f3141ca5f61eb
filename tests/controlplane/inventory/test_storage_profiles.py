"""Storage profiles name the L3 backends a worker can attach: the engine's registered ones (aibrix, file,
lmcache, mooncake, nixl, dynamic); any other name is refused naming the field and changes nothing."""

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
