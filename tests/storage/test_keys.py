"""Page-key chain: pinned vectors, chaining, namespacing, validation (docs/upstream.md H5)."""

import hashlib
import struct

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.cache.keys import namespace_digest, page_hashes, salted_namespace
from engine.cache.kv_format import KVFormat
from engine.cache.storage.base import HiCacheStorageConfig

NS = namespace_digest("SmolLM2-135M", "bfloat16", "page_first", 4, 0, 1)


def test_pinned_vectors():
    # Pinned so that a change to the key scheme (which would orphan every stored page) fails loudly.
    # Version 2 (the KV producer in the namespace) orphaned version 1's pages on purpose.
    assert NS.hex() == "473056178a553576f839771553cc4f1139fe6bf2e28369d54b932b040a425845"
    assert page_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4, None, NS) == [
        "9577cff31eabf9af91b911855be0aaad1b3de35e754916b85dd5e64b6dca9678",
        "f807cdea5f1837ae8cf8d0c8f972dff09347a90a01fd0fa07122534017b4bc90",
    ]


def test_matches_independent_sha256_le32_chain():
    tokens = [0, 1, 2**32 - 1, 70000, 5, 6, 7, 8]
    h0 = hashlib.sha256(NS + struct.pack("<4I", *tokens[:4])).hexdigest()
    h1 = hashlib.sha256(bytes.fromhex(h0) + struct.pack("<4I", *tokens[4:])).hexdigest()
    assert page_hashes(tokens, 4, None, NS) == [h0, h1]
    assert page_hashes(tokens[4:], 4, h0, NS) == [h1]


def test_partial_page_ignored_and_empty():
    assert len(page_hashes(list(range(11)), 4, None, NS)) == 2
    assert page_hashes([1, 2, 3], 4, None, NS) == []
    assert page_hashes([], 4, None, NS) == []


def test_same_page_different_prefix_gives_different_key():
    a = page_hashes([1, 1, 1, 1, 9, 9, 9, 9], 4, None, NS)
    b = page_hashes([2, 2, 2, 2, 9, 9, 9, 9], 4, None, NS)
    assert a[1] != b[1]
    assert a[0] != page_hashes([9, 9, 9, 9], 4, None, NS)[0]


def test_tensor_numpy_and_list_inputs_agree():
    toks = list(range(100, 116))
    expected = page_hashes(toks, 4, None, NS)
    assert page_hashes(torch.tensor(toks), 4, None, NS) == expected
    assert page_hashes(np.array(toks, dtype=np.int32), 4, None, NS) == expected


@pytest.mark.parametrize(
    "change",
    [
        {"model_name": "other-model"},
        {"kv_dtype": "float16"},
        {"layout": "page_first_direct"},
        {"page_size": 8},
        {"tp_rank": 1, "tp_size": 2},
        {"tp_size": 2},
        {"producer": "weights=ab;quantization=int4wo-32;dtype=bfloat16"},
    ],
)
def test_namespace_separates_model_dtype_layout_page_size_shard_producer(change):
    base = dict(model_name="m", kv_dtype="bfloat16", layout="page_first", page_size=4, tp_rank=0, tp_size=1)
    other = namespace_digest(**{**base, **change})
    assert other != namespace_digest(**base)
    toks = list(range(8))
    assert set(page_hashes(toks, 4, None, other)).isdisjoint(
        page_hashes(toks, 4, None, namespace_digest(**base))
    )


def test_cache_salt_reseeds_the_chain_and_no_salt_keeps_the_namespace():
    toks = list(range(8))
    assert salted_namespace(NS, None) is NS
    a, b = salted_namespace(NS, "tenant-a"), salted_namespace(NS, "tenant-b")
    assert a == hashlib.sha256(NS + b"cache_salt=tenant-a").digest()
    assert len({NS, a, b}) == 3
    chains = [page_hashes(toks, 4, None, seed) for seed in (NS, a, b)]
    assert len({key for chain in chains for key in chain}) == 6  # no key shared across salts


def test_replicated_kv_shares_keys_across_ranks_and_dtype_spelling():
    r0 = namespace_digest("m", "bfloat16", "page_first", 4, 0, 2, replicated=True)
    r1 = namespace_digest("m", "bfloat16", "page_first", 4, 1, 2, replicated=True)
    assert r0 == r1
    assert r0 != namespace_digest("m", "bfloat16", "page_first", 4, 0, 2)
    assert namespace_digest("m", torch.bfloat16, "page_first", 4, 0, 1) == namespace_digest(
        "m", "torch.bfloat16", "page_first", 4, 0, 1
    )


@pytest.mark.parametrize("bad", [[-1, 0, 0, 0], [2**32, 0, 0, 0]])
def test_out_of_range_token_rejected(bad):
    with pytest.raises(ValueError, match="2\\*\\*32"):
        page_hashes(bad, 4, None, NS)


def test_bad_arguments_rejected():
    with pytest.raises(ValueError, match="namespace"):
        page_hashes([1, 2, 3, 4], 4, None, b"short")
    with pytest.raises(ValueError, match="prior"):
        page_hashes([1, 2, 3, 4], 4, "abc", NS)
    with pytest.raises(ValueError, match="page_size"):
        page_hashes([1, 2, 3, 4], 0, None, NS)
    with pytest.raises(ValueError, match="tp_rank"):
        namespace_digest("m", "float16", "page_first", 4, 2, 2)
    with pytest.raises(ValueError, match="model_name"):
        namespace_digest("", "float16", "page_first", 4, 0, 1)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), max_size=40), st.integers(1, 6), st.integers(0, 40))
def test_chain_resumes_from_any_page_boundary(tokens, page_size, cut_pages):
    """Hashing the tail from the last key of the head reproduces the full chain (prefetch path)."""
    full = page_hashes(tokens, page_size, None, NS)
    cut = min(cut_pages, len(full))
    head = page_hashes(tokens[: cut * page_size], page_size, None, NS)
    prior = head[-1] if head else None
    tail = page_hashes(tokens[cut * page_size :], page_size, prior, NS)
    assert head + tail == full
    assert len(full) == len(tokens) // page_size
    assert all(len(k) == 64 and k == k.lower() for k in full)


def test_kv_format_and_scale_layout_name_the_namespace():
    """fp8 and int8 pools both store uint8 elements; the namespace tells their formats (and int8's scale
    layout) apart, and a plain format names the namespace a pool of that dtype always had."""

    def ns(kv_dtype, kv_format):
        return HiCacheStorageConfig(
            0, 1, False, "m", 4, kv_dtype, "page_first", kv_format=kv_format
        ).namespace

    int8 = KVFormat("int8", torch.float32, 64).layout_name
    assert int8 == "int8/per-token-head-bf16"
    spaces = {ns("uint8", int8), ns("uint8", "fp8_e4m3"), ns("uint8", "fp8_e5m2"), ns("float32", "float32")}
    assert len(spaces) == 4
    assert ns("bfloat16", "bfloat16") == namespace_digest("m", "bfloat16", "page_first", 4, 0, 1)
