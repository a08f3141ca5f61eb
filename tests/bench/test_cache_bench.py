"""``python -m engine.bench.cache``: its flags are checked before anything is measured, and a small
load-back run prints one row per layout and page size."""

from __future__ import annotations

import pytest

from engine.bench.cache import bench_load_back, main


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--trials", "0"], "--trials: 0 is below 1"),
        (["--page-sizes", "16,0"], "has a page size below 1"),
        (["--layouts", "page_first"], "is not layer_first or page_first_direct"),
    ],
)
def test_bad_flags_are_refused_naming_the_flag(capsys, flags, message):
    with pytest.raises(SystemExit):
        main(["--load-back-only", *flags])
    assert message in capsys.readouterr().err


def test_a_load_back_row_pairs_each_load_with_a_copy():
    row = bench_load_back(page_size=16, tokens=1024, trials=2, layout="page_first_direct")
    assert row["page_size"] == 16 and row["mib"] == 1024 * 8 * 2 * 8 * 64 * 2 / 2**20
    assert row["load"] > 0 and row["copy"] > 0 and row["paired"] > 0
