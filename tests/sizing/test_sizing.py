"""KV sizing: bytes per token, per-tier capacity and warnings, and the answer for a real SmolLM2 worker."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from engine.bench.launcher import ServerProcess
from engine.cache.host_pool import GIB, host_pool_tokens
from engine.sizing.__main__ import main
from engine.sizing.kv import KVShape
from engine.sizing.tiers import size_tiers


def test_bytes_per_token_of_the_tuning_guide_example(capsys):
    assert KVShape(28, 8, 128, 2).bytes_per_token == 114_688
    argv = ["--num-layers", "28", "--num-kv-heads", "8", "--head-dim", "128", "--dtype", "float16", "--json"]
    assert main([*argv, "--max-total-tokens", "1000"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["bytes_per_token"] == 114_688 and out["l1_bytes"] == 1000 * 114_688


@pytest.mark.parametrize(
    ("flags", "bytes_per_token"),
    [([], 23_040), (["--dtype", "float32"], 46_080), (["--torchao-config", "int8wo"], 46_080),
     (["--torchao-config", "int4wo-64"], 23_040)],
)  # fmt: skip
def test_smollm2_is_sized_in_the_dtype_its_worker_resolves(capsys, flags, bytes_per_token):
    """--dtype auto as the worker resolves it: the Q4_1 GGUF in bfloat16, but float32 with an int8wo
    --torchao-config (what a worker started with those flags reports at /get_model_info)."""
    assert main(["--model-path", "smollm2", *flags, "--max-total-tokens", "100", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["bytes_per_token"] == bytes_per_token


def test_gpu_fraction_page_rounding_and_host_pool():
    # 80 GB free x 0.85 / 114,688 B = 592,912.9 tokens -> 592,896 in 64-token pages; L2 = 2 x L1 + 1 page.
    s = size_tiers(114_688, 64, mem_fraction_static=0.85, free_gpu_bytes=80 * 10**9,
                   enable_hierarchical_cache=True, hicache_ratio=2.0, host_available_bytes=2000 * GIB,
                   l3_bytes=10**12)  # fmt: skip
    assert s.l1_tokens == 592_896
    assert s.l2_tokens == 2 * 592_896 + 64
    assert s.l2_tokens == host_pool_tokens(592_896, 64, 114_688, 2.0, 0, available_bytes=2000 * GIB)
    assert s.host_ram_left_bytes == 2000 * GIB - s.l2_tokens * 114_688
    assert s.l3_tokens == 10**12 // (64 * 114_688) * 64
    assert s.warnings == []


def test_hicache_size_overrides_ratio_like_the_engine():
    s = size_tiers(23_040, 16, max_total_tokens=4096, enable_hierarchical_cache=True, hicache_size=2)
    assert s.l2_tokens == host_pool_tokens(4096, 16, 23_040, 2.0, 2, available_bytes=1000 * GIB)
    assert s.l2_tokens == (int(2e9 / 23_040) // 16 + 1) * 16


@pytest.mark.parametrize(
    ("kwargs", "warning"),
    [
        ({"mem_fraction_static": 0.97, "free_gpu_bytes": 10**10}, "--mem-fraction-static 0.97"),
        (
            {
                "max_total_tokens": 4096,
                "enable_hierarchical_cache": True,
                "host_available_bytes": 8 * GIB,
                "hicache_size": 20,
            },
            "would swap",
        ),  # fmt: skip
        (
            {"max_total_tokens": 4096, "enable_hierarchical_cache": True, "hicache_ratio": 0.5},
            "not larger than L1",
        ),
        ({"max_total_tokens": 4096, "enable_hierarchical_cache": True, "l3_bytes": 10**6}, "smaller than L2"),
        ({"max_total_tokens": 4100}, "not a multiple of --page-size"),
    ],
)
def test_warnings(kwargs, warning):
    s = size_tiers(23_040, 16, **kwargs)
    assert any(warning in w for w in s.warnings), s.warnings


def test_bad_flags_exit_2_naming_the_flag(capsys):
    for argv, flag in [
        (["--num-layers", "2"], "--num-layers"),
        (["--dtype", "int3", "--num-layers", "1", "--num-kv-heads", "1", "--head-dim", "1"], "--dtype"),
        (
            ["--device", "cuda", "--num-layers", "1", "--num-kv-heads", "1", "--head-dim", "1"],
            "--free-gpu-memory-gb",
        ),
        (["--page-size", "0", "--num-layers", "1", "--num-kv-heads", "1", "--head-dim", "1"], "--page-size"),
        (["--model-path", "/nope"], "--model-path"),
    ]:
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2 and flag in capsys.readouterr().err


@pytest.mark.slow
def test_sizing_equals_what_a_real_smollm2_worker_allocated():
    flags = ["--page-size", "16", "--max-total-tokens", "2048", "--enable-hierarchical-cache",
             "--hicache-ratio", "2.5"]  # fmt: skip
    cmd = [sys.executable, "-m", "engine.sizing", "--model-path", "smollm2", *flags, "--json"]
    sizing = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=300).stdout)
    with ServerProcess(["--model-path", "smollm2", *flags]) as server:
        info = httpx.get(f"{server.url}/server_info", timeout=30).json()
        model = httpx.get(f"{server.url}/get_model_info", timeout=30).json()
    assert sizing["bytes_per_token"] == model["kv_bytes_per_token"] == 2 * 30 * 3 * 64 * 2  # bfloat16 KV
    assert sizing["l1_tokens"] == info["max_total_num_tokens"] == 2048
    assert sizing["l2_tokens"] == info["host_total_num_tokens"] == (5120 // 16 + 1) * 16


def test_tp_sizes_l1_and_l2_per_rank_with_the_kv_heads_split_or_replicated(capsys):
    """Each rank stores its share of the KV heads: 8 heads at tp 2 -> 4 per rank (half the bytes), at tp
    16 -> one replicated head (an eighth); the tiers' token counts are the same at every tp."""
    shape = KVShape(28, 8, 128, 2)
    assert shape.per_rank(2).bytes_per_token == 114_688 // 2
    assert shape.per_rank(16).num_kv_heads == 1 and shape.per_rank(16).bytes_per_token == 114_688 // 8
    argv = ["--num-layers", "28", "--num-kv-heads", "8", "--head-dim", "128", "--dtype", "float16"]
    tiers = ["--max-total-tokens", "1000", "--enable-hierarchical-cache", "--json"]
    assert main([*argv, *tiers, "--tp", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["tp_size"], out["num_kv_heads"], out["bytes_per_token"]) == (2, 4, 57_344)
    assert out["l1_tokens"] == 1000 and out["l1_bytes"] == 1000 * 57_344
    assert main([*argv, "--max-total-tokens", "1000", "--tp-size", "4"]) == 0
    assert "KV bytes per token per rank of 4 (8 KV heads split): 28,672" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("tp", "words"), [(3, "8 KV heads are not divisible by it"), (12, "a multiple of them")]
)
def test_a_tp_the_kv_heads_do_not_take_exits_2_naming_tp_size(capsys, tp, words):
    with pytest.raises(SystemExit) as exc:
        main(["--num-layers", "2", "--num-kv-heads", "8", "--head-dim", "64", "--tp", str(tp)])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"--tp-size {tp}" in err and words in err


@pytest.mark.slow
def test_per_rank_sizing_equals_what_a_real_tp3_smollm2_worker_reports():
    """SmolLM2-135M (3 KV heads) at --tp 3: one KV head per rank, a third of tp 1's bytes per token."""
    flags = ["--page-size", "16", "--max-total-tokens", "1024", "--tp", "3"]
    cmd = [sys.executable, "-m", "engine.sizing", "--model-path", "smollm2", *flags, "--json"]
    sizing = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=300).stdout)
    with ServerProcess(["--model-path", "smollm2", *flags]) as server:
        info = httpx.get(f"{server.url}/server_info", timeout=30).json()
        model = httpx.get(f"{server.url}/get_model_info", timeout=30).json()
    assert sizing["bytes_per_token"] == model["kv_bytes_per_token"] == 2 * 30 * 1 * 64 * 2
    assert sizing["l1_tokens"] == info["max_total_num_tokens"] == 1024 and info["tp_size"] == 3


def test_an_mla_model_is_sized_by_its_latent_replicated_on_every_rank(tiny_mla_model_dir, capsys):
    """A DeepSeek-V3 checkpoint: layers x (kv_lora_rank + qk_rope_head_dim) values per token, the whole
    latent on every tensor-parallel rank; int8 adds a bfloat16 scale per half row."""
    argv = ["--model-path", str(tiny_mla_model_dir), "--max-total-tokens", "1000"]  # 2 layers, 32 + 16
    assert main([*argv, "--kv-cache-dtype", "bfloat16"]) == 0
    assert "KV bytes per token: 192 (2 layers x MLA latent 48 x 2 B)" in capsys.readouterr().out
    assert main([*argv, "--kv-cache-dtype", "int8", "--tp-size", "4"]) == 0
    out = capsys.readouterr().out
    assert (
        "per rank of 4 (the latent replicated): 104 (2 layers x MLA latent 48 x 1 B + 2 x 2 B scales)" in out
    )
