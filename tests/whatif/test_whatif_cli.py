"""``python -m engine.whatif``: JSON per capacity point, the TTFT estimate, measured costs, flag errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from engine.whatif.__main__ import main

# The two-tier hand trace of test_replay: L1 3 pages, L2 8 pages of 8 tokens -> L2 serves r3 and r4 (16
# tokens each), L1 serves r5 (16 tokens).
LINES = [[1, 2, 91], [3, 4, 92], [1, 2, 93], [3, 4, 94], [3, 4, 95]]


@pytest.fixture
def trace(tmp_path):
    path = tmp_path / "t.jsonl"
    rows = [
        {"timestamp": i, "input_length": 17, "output_length": 3, "hash_ids": ids}
        for i, ids in enumerate(LINES)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_json_sweep_one_object_per_point_with_ttft(trace, capsys):
    argv = [str(trace), "--block-tokens", "8", "--page-size", "8", "--l1-tokens", "24", "--l2-tokens", "0,64"]
    argv += [
        "--kv-bytes-per-token",
        "1000",
        "--prefill-us-per-token",
        "100",
        "--l2-gbps",
        "1",
        "--l3-gbps",
        "1",
    ]
    assert main([*argv, "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["l1_tokens"], r["l2_tokens"], r["l3_tokens"]) for r in rows] == [(24, 0, 0), (24, 64, 0)]
    no_l2, with_l2 = rows
    assert (no_l2["l1"]["tokens_served"], no_l2["l2"]["tokens_served"]) == (16, 0)  # only r5 hits
    assert (with_l2["l1"]["tokens_served"], with_l2["l2"]["tokens_served"]) == (16, 32)
    assert with_l2["l2"]["share"] == pytest.approx(32 / 85)
    # r3-r5 repeat 16 tokens each: the unbounded cache's 48 of 85, reached with L2, not by L1 alone
    assert [r["ceiling_share"] for r in rows] == [pytest.approx(48 / 85)] * 2
    assert with_l2["share"] == pytest.approx(48 / 85) and no_l2["share"] < 48 / 85
    assert with_l2["l2"]["bytes_loaded_back"] == 4 * 8 * 1000
    # 48 cached tokens save 100 us each; the 32 from L2 cost 32 * 1000 B at 1 GB/s.
    saving = with_l2["ttft_saving"]
    assert saving["total_s"] == pytest.approx(48 * 100e-6 - 32 * 1000 / 1e9)
    assert saving["mean_ms_per_request"] == pytest.approx(1e3 * saving["total_s"] / 5)
    assert saving["measured"] == []


def test_text_output_and_measured_costs(trace):
    argv = [sys.executable, "-m", "engine.whatif", str(trace), "--block-tokens", "8", "--page-size", "8"]
    argv += ["--l1-tokens", "24", "--l2-tokens", "64", "--json"]
    out = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=300).stdout
    (row,) = [json.loads(line) for line in out.splitlines()]
    saving = row["ttft_saving"]
    assert saving["measured"] == ["prefill", "l2", "l3"]
    assert saving["prefill_s_per_token"] > 0 and saving["l2_bytes_per_s"] > 0 and saving["l3_bytes_per_s"] > 0
    assert row["bytes_per_token"] == 2 * 30 * 3 * 64 * 2  # SmolLM2-135M in bfloat16


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--l1-tokens", "12,x"], "--l1-tokens"),
        (["--l1-tokens", "24", "--l3-tokens", "64"], "--l3-tokens"),
        (["--page-size", "3"], "--page-size"),
        (["--l1-tokens", "0"], "--l1-tokens"),
        (["--block-tokens", "4"], "--block-tokens 4"),
    ],
)
def test_bad_flags_exit_2_naming_the_flag(trace, extra, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main([str(trace), "--block-tokens", "8", "--no-ttft", "--kv-bytes-per-token", "2", *extra])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_page_size_defaults_to_the_demo_fleets(tmp_path, capsys):
    """Two identical 1,010-token prompts: the second hits the whole pages of its first 1,009 tokens, 1,008
    at the demo's page size 16 (960 at 64, the old default)."""
    path = tmp_path / "repeat.jsonl"
    row = {"input_length": 1010, "output_length": 4, "hash_ids": [1, 2]}
    path.write_text("".join(json.dumps({"timestamp": i, **row}) + "\n" for i in range(2)))
    argv = [str(path), "--l1-tokens", "100000", "--kv-bytes-per-token", "1000", "--no-ttft", "--json"]
    assert main(argv) == 0
    (point,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert point["l1"]["tokens_served"] == 1008


def test_l2_follows_each_l1_point_by_the_hicache_ratio(trace, capsys):
    """``--hicache-ratio``: L2 = int(L1 x ratio) rounded up past whole pages, as the engine sizes its host
    pool, so a sweep has no point the engine refuses; a fixed L2 skips the points it is not larger than,
    one short line each."""
    base = [str(trace), "--block-tokens", "8", "--page-size", "8", "--no-ttft", "--kv-bytes-per-token", "2"]
    assert main([*base, "--l1-tokens", "24,64", "--hicache-ratio", "2", "--json"]) == 0
    out = capsys.readouterr()
    assert [(r["l1_tokens"], r["l2_tokens"]) for r in map(json.loads, out.out.splitlines())] == [
        (24, 56),
        (64, 136),
    ]
    assert out.err == ""
    assert main([*base, "--l1-tokens", "24,64", "--l2-tokens", "64", "--json"]) == 0
    assert (
        capsys.readouterr().err == "skipped sweep points: L1 64 / L2 64 / L3 0: L2 must be larger than L1\n"
    )
    with pytest.raises(SystemExit):
        main([*base, "--l2-tokens", "64", "--hicache-ratio", "2"])
    assert "--hicache-ratio: give it or --l2-tokens, not both" in capsys.readouterr().err
