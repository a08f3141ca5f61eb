"""A model split over tensor-parallel ranks (one spawned process each, gloo) computes what one rank computes.

The tiny Llama has 8 query heads and 4 KV heads: tp 2 and 4 split the KV heads, tp 8 replicates each KV head
on two ranks. Logits equal tp 1's within float32 summation-order tolerance, and so does greedy output.
"""

from __future__ import annotations

import multiprocessing

import numpy as np
import pytest
from model_testlib import save_tiny_model, tp_rank_logits

from engine.distributed import TPConfigError, TPShard, check_tp_size
from engine.model.loader import load_config
from engine.ports import free_port


def run_group(folder, size: int, quantization=None, dtype="float32"):
    method = f"tcp://127.0.0.1:{free_port()}"
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [
        ctx.Process(target=tp_rank_logits, args=(r, size, str(folder), method, quantization, dtype, out))
        for r in range(size)
    ]
    for p in procs:
        p.start()
    try:
        return out.get(timeout=180)
    finally:
        for p in procs:
            p.join(120)
            assert p.exitcode == 0


@pytest.fixture(scope="module")
def gqa_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama-tp-shards")
    save_tiny_model(folder, "llama", seed=5, num_attention_heads=8, num_key_value_heads=4)
    return folder


@pytest.fixture(scope="module")
def tp1(gqa_folder):
    return run_group(gqa_folder, 1)


@pytest.mark.parametrize("tp", [2, 4, pytest.param(8, marks=pytest.mark.slow)])
def test_logits_and_greedy_tokens_at_tp_equal_tp1(gqa_folder, tp1, tp):
    logits, tokens = run_group(gqa_folder, tp)
    assert tokens == tp1[1]
    for got, want in zip(logits, tp1[0], strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)


def test_int8wo_works_per_shard(gqa_folder, tp1):
    """int8 weight-only layers are quantized from each rank's shard: same greedy tokens as dense tp 1."""
    logits, tokens = run_group(gqa_folder, 2, quantization="int8wo")
    assert tokens == tp1[1]


def test_each_rank_owns_its_heads_and_replicated_kv_has_one_writer(gqa_folder):
    cfg = load_config(gqa_folder)
    at4 = [TPShard(cfg, r, 4) for r in range(4)]
    assert [(s.num_heads, s.num_kv_heads, s.kv_shard, s.kv_writer) for s in at4] == [
        (2, 1, r, True) for r in range(4)
    ]
    at8 = [TPShard(cfg, r, 8) for r in range(8)]
    assert [s.kv_shard for s in at8] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [s.kv_writer for s in at8] == [True, False] * 4
    assert {s.num_kv_shards for s in at8} == {4}


@pytest.mark.parametrize(
    ("tp", "message"),
    [
        (3, "--tp-size 3: the model's 8 attention heads are not divisible by 3"),
        (16, "--tp-size 16: the model's 8 attention heads are not divisible by 16"),
    ],
)
def test_a_tp_the_heads_do_not_divide_is_refused(gqa_folder, tp, message):
    with pytest.raises(TPConfigError, match=message):
        check_tp_size(load_config(gqa_folder), tp)
