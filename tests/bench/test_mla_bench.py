"""``python -m engine.bench.mla`` runs end to end: the sizing's KV table, two decode paths that agree."""

from __future__ import annotations

from engine.bench.mla import decode_attention, main


def test_the_benchmark_prints_the_kv_table_and_equal_decode_paths(capsys):
    assert main(["--heads", "2", "--context", "63", "--batch", "2", "--steps", "1", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "DeepSeek-V3 MLA (61 layers, latent 512 + 64)" in out and "70,272 B/token" in out
    assert "GQA / MLA bytes: 3.56x" in out and "max relative difference" in out
    _, _, diff = decode_attention(heads=2, context=31, batch=1, steps=1, device="cpu")
    assert diff <= 1e-5
