"""``python -m engine.bench.mla`` runs end to end: the sizing's KV table, two decode paths that agree."""

from __future__ import annotations

import pytest

from engine.bench.mla import decode_attention, main


def test_the_benchmark_prints_the_kv_table_and_equal_decode_paths(capsys):
    assert main(["--heads", "2", "--context", "63", "--batch", "2", "--steps", "1", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "DeepSeek-V3 MLA (61 layers, latent 512 + 64)" in out and "70,272 B/token" in out
    assert "GQA / MLA bytes: 3.56x" in out and "max relative difference" in out
    _, _, diff = decode_attention(heads=2, context=31, batch=1, steps=1, device="cpu")
    assert diff <= 1e-5


def test_the_l3_part_refuses_an_empty_run_naming_the_flag(capsys):
    """``--part l3`` starts two workers (about 40 s here: run by hand, docs/benchmarks.md); its flags are
    checked before anything starts."""
    with pytest.raises(SystemExit):
        main(["--part", "l3", "--prompts", "0"])
    assert "--prompts must be >= 1" in capsys.readouterr().err
