"""The bytes load-back, prefetch and the PD transfer move per token, measured on the transfers
(engine.bench.kv_transfers), equal the pool's bytes_per_token for every KV dtype: a quantized cache moves
its smaller pages (int8's scales included) on every path, not the compute dtype's."""

from __future__ import annotations

import pytest

from engine.bench.kv_transfers import (
    DTYPES,
    device_pool,
    measure_load_back,
    measure_pd,
    measure_prefetch,
)
from engine.cache.storage.page_file import HEADER_SIZE

SHAPE = (3, 2, 8)  # layers, KV heads, head_dim
TOKENS, PAGE = 32, 4
FLOAT32_BYTES = 2 * 3 * 2 * 8 * 4


def test_pool_bytes_per_token_shrink_with_the_dtype():
    per = {kv: device_pool(SHAPE, kv, PAGE, PAGE).bytes_per_token for kv in DTYPES}
    assert per["float32"] == FLOAT32_BYTES
    assert per["bfloat16"] == FLOAT32_BYTES // 2
    assert per["fp8_e4m3"] == FLOAT32_BYTES // 4
    assert FLOAT32_BYTES // 4 < per["int8"] < FLOAT32_BYTES // 2  # 1 byte a value plus each row's scale


@pytest.mark.parametrize("kv", DTYPES)
def test_load_back_moves_the_pools_bytes_per_token(kv):
    r = measure_load_back(SHAPE, kv, TOKENS, PAGE)
    assert r["landed"] == TOKENS * r["pool"]


@pytest.mark.parametrize("kv", DTYPES)
def test_prefetch_moves_the_pools_bytes_per_token(kv):
    r = measure_prefetch(SHAPE, kv, TOKENS, PAGE)
    assert r["landed"] == r["counted"] == TOKENS * r["pool"]
    # the files' reads: the payload plus the page file's header (and a 1-byte sentinel) per page
    pages = TOKENS // PAGE
    assert pages * HEADER_SIZE <= r["file_read"] - r["landed"] < pages * (HEADER_SIZE + 64) + 1024


@pytest.mark.parametrize("kv", DTYPES)
def test_pd_transfer_moves_the_pools_bytes_per_token(kv):
    r = measure_pd(SHAPE, kv, TOKENS, PAGE, "fake")
    assert r["landed"] == r["sent"] == TOKENS * r["pool"]


@pytest.mark.slow
@pytest.mark.parametrize("kv", ["float32", "int8"])
def test_pd_transfer_over_mooncake_moves_the_pools_bytes_per_token(kv):
    r = measure_pd(SHAPE, kv, TOKENS, PAGE, "mooncake")
    assert r["landed"] == r["sent"] == TOKENS * r["pool"]
