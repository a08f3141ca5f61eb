"""The weights digest names a checkpoint's bytes, is cached per file by (path, size, mtime), and the KV
producer line changes with the weights, the quantization and the compute dtype."""

from __future__ import annotations

import os

import pytest

from engine.model.loader import fingerprint
from engine.model.loader.fingerprint import kv_producer, weights_digest


@pytest.fixture
def digest_cache(tmp_path, monkeypatch):
    folder = tmp_path / "digests"
    monkeypatch.setenv(fingerprint.CACHE_ENV, str(folder))
    return folder


def _checkpoint(folder, *contents: bytes):
    folder.mkdir()
    for i, data in enumerate(contents):
        (folder / f"model-{i:05d}.safetensors").write_bytes(data)
    (folder / "config.json").write_text("{}")
    return folder


def test_digest_follows_the_weight_bytes_not_the_folder(tmp_path, digest_cache):
    a = _checkpoint(tmp_path / "a", b"weights-1", b"weights-2")
    b = _checkpoint(tmp_path / "b", b"weights-1", b"weights-2")
    c = _checkpoint(tmp_path / "c", b"weights-1", b"weights-X")
    assert weights_digest(a) == weights_digest(b)
    assert weights_digest(a) != weights_digest(c)


def test_digest_is_cached_per_file_and_redone_when_the_file_changes(tmp_path, digest_cache):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF-first")
    first = weights_digest(gguf)
    assert len(list(digest_cache.iterdir())) == 1
    entry = next(digest_cache.iterdir())
    entry.write_text("f" * 64)  # a cache hit is read, not recomputed
    assert weights_digest(gguf) != first
    gguf.write_bytes(b"GGUF-second, longer")  # new size and mtime: a new entry
    os.utime(gguf, ns=(1, 1))
    assert weights_digest(gguf) not in (first,)
    assert len(list(digest_cache.iterdir())) == 2


def test_a_folder_without_weights_is_an_error(tmp_path, digest_cache):
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no weight files"):
        weights_digest(tmp_path / "empty")


def test_producer_names_weights_quantization_and_dtype():
    base = kv_producer("ab" * 32, None, "torch.bfloat16")
    assert base == f"weights={'ab' * 32};quantization=none;dtype=bfloat16"
    assert kv_producer("ab" * 32, "int4wo-32", "bfloat16") != base
    assert kv_producer("ab" * 32, None, "float32") != base
    assert kv_producer("cd" * 32, None, "bfloat16") != base
