"""Backend registry and the ``dynamic`` loader (docs/upstream.md H6)."""

import textwrap

import pytest
import torch

from engine.cache.storage.base import HiCacheStorage, StorageConfigError, StorageError
from engine.cache.storage.file import HiCacheFile
from engine.cache.storage.registry import create_storage_backend, register_backend, registered_backends

USER_MODULE = textwrap.dedent(
    """
    from engine.cache.storage.file import HiCacheFile

    class UserStore(HiCacheFile):
        def __init__(self, storage_config, kwargs):
            super().__init__(storage_config)
            self.kwargs = kwargs

    class NotAStore:
        def __init__(self, storage_config, kwargs):
            pass
    """
)


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    name = f"kvfleet_user_store_{tmp_path.name}"
    (tmp_path / f"{name}.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def dynamic_extra(tmp_path, module, **over):
    extra = {"backend_name": "mine", "module_path": module, "class_name": "UserStore"}
    extra.update(file_path=str(tmp_path / "l3"), **over)
    return {k: v for k, v in extra.items() if v is not None}


def test_unknown_backend_lists_registered_names(storage_config_factory):
    names = "aibrix, dynamic, file, lmcache, mooncake, nixl"
    with pytest.raises(ValueError, match=f"registered backends: {names}"):
        create_storage_backend("nope", storage_config_factory(), None)


def test_an_upstream_backend_kvfleet_lacks_says_why_at_start_and_at_attach(storage_config_factory):
    """hf3fs's client cannot be installed here: the flag and the runtime attach both name what it needs."""
    from engine.server.args import ArgumentError, parse_args

    with pytest.raises(ValueError, match=r"'hf3fs' is not available: DeepSeek 3FS needs its usrbio client"):
        create_storage_backend("hf3fs", storage_config_factory(), None)
    with pytest.raises(ArgumentError, match=r"--hicache-storage-backend: hf3fs: .*hf3fs-py-usrbio.*FUSE"):
        parse_args(["--model-path", "m", "--enable-hierarchical-cache", "--hicache-storage-backend", "hf3fs"])


@pytest.mark.parametrize("name", ["file", "nixl"])
def test_page_file_backends_register_host_pool(tmp_path, storage_config_factory, page_pool_factory, name):
    """Built as upstream builds file and nixl: ``cls(storage_config)``, then ``register_mem_pool_host``."""
    pool = page_pool_factory()
    backend = create_storage_backend(name, storage_config_factory(extra={"file_path": str(tmp_path)}), pool)
    assert isinstance(backend, HiCacheFile) and backend.mem_pool_host is pool and backend.supports_v1
    assert type(backend).__name__ == {"file": "HiCacheFile", "nixl": "HiCacheNixl"}[name]


def test_dynamic_loads_user_class_with_kwargs_and_interface_v1(tmp_path, user_module, storage_config_factory):
    pool_free = create_storage_backend(
        "dynamic", storage_config_factory(extra=dynamic_extra(tmp_path, user_module, interface_v1=0)), None
    )
    assert type(pool_free).__name__ == "UserStore"
    assert pool_free.kwargs == {"file_path": str(tmp_path / "l3")}
    assert pool_free.supports_v1 is False
    v1 = create_storage_backend(
        "dynamic", storage_config_factory(extra=dynamic_extra(tmp_path, user_module, interface_v1=1)), None
    )
    assert v1.supports_v1 is True
    page = torch.arange(8, dtype=torch.float16)
    key = "ab" * 32
    assert v1.set(key, page) and torch.equal(v1.get(key), page)


@pytest.mark.parametrize("missing", ["backend_name", "module_path", "class_name"])
def test_dynamic_missing_field_is_named(tmp_path, user_module, storage_config_factory, missing):
    extra = dynamic_extra(tmp_path, user_module, **{missing: None})
    with pytest.raises(StorageConfigError, match=f"extra_config.{missing} is required"):
        create_storage_backend("dynamic", storage_config_factory(extra=extra), None)


def test_dynamic_import_failure_is_clear(tmp_path, storage_config_factory):
    extra = dynamic_extra(tmp_path, "no_such_module_kvfleet")
    with pytest.raises(ImportError, match="cannot import storage backend module 'no_such_module_kvfleet'"):
        create_storage_backend("dynamic", storage_config_factory(extra=extra), None)


def test_dynamic_missing_class_is_clear(tmp_path, user_module, storage_config_factory):
    extra = dynamic_extra(tmp_path, user_module, class_name="Nope")
    with pytest.raises(ImportError, match="has no class 'Nope'"):
        create_storage_backend("dynamic", storage_config_factory(extra=extra), None)


def test_dynamic_wrong_type_is_type_error_naming_class(tmp_path, user_module, storage_config_factory):
    extra = dynamic_extra(tmp_path, user_module, class_name="NotAStore")
    with pytest.raises(TypeError, match=f"{user_module}.NotAStore is not a subclass of HiCacheStorage"):
        create_storage_backend("dynamic", storage_config_factory(extra=extra), None)


def test_register_backend_adds_a_name(tmp_path, user_module, storage_config_factory, monkeypatch):
    from engine.cache.storage import registry

    monkeypatch.setattr(registry, "_BACKENDS", dict(registry._BACKENDS))
    register_backend("plain", "engine.cache.storage.file", "HiCacheFile")
    assert "plain" in registered_backends()
    backend = create_storage_backend(
        "plain", storage_config_factory(extra={"file_path": str(tmp_path)}), None
    )
    assert isinstance(backend, HiCacheFile)
    with pytest.raises(ValueError, match="reserved"):
        register_backend("dynamic", "x", "y")


class MinimalStore(HiCacheStorage):
    """A dict-backed backend using only the base-class defaults for batch_exists and v1."""

    def __init__(self, storage_config):
        super().__init__(storage_config)
        self.pages = {}

    def get(self, key, target_location=None, target_sizes=None):
        return self.pages.get(key)

    def batch_get(self, keys, target_locations=None, target_sizes=None):
        return [self.get(k) for k in keys]

    def set(self, key, value=None, target_location=None, target_sizes=None):
        self.pages.setdefault(key, value.clone())
        return True

    def batch_set(self, keys, values=None, target_locations=None, target_sizes=None):
        return all(self.set(k, v) for k, v in zip(keys, values, strict=True))

    def exists(self, key):
        return key in self.pages


def test_base_defaults_generic_v1_and_clear(storage_config_factory, page_pool_factory):
    store = MinimalStore(storage_config_factory(layout="layer_first"))
    src, dst = page_pool_factory(layout="layer_first", seed=5), page_pool_factory(layout="layer_first")
    store.register_mem_pool_host(src)
    assert store.batch_set_v1(["a", "b"], torch.arange(8, 16)) == [True, True]
    assert store.batch_exists(["a", "x", "b"]) == 1
    store.register_mem_pool_host(dst)
    assert store.batch_get_v1(["b", "x"], torch.arange(0, 8)) == [True, False]
    assert torch.equal(dst.get_flat_data_page(0), src.get_flat_data_page(12))
    with pytest.raises(ValueError, match="expected 2 keys x page_size 4"):
        store.batch_get_v1(["a", "b"], torch.arange(0, 4))
    with pytest.raises(StorageError, match="does not support clear"):
        store.clear()


def test_config_rejects_unknown_layout(storage_config_factory):
    with pytest.raises(StorageConfigError, match="layout: 'page_head'"):
        storage_config_factory(layout="page_head")
