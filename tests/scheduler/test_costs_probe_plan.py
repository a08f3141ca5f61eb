"""The cost probe's sizes (``engine.scheduler.costs_probe.plan``): whole pages, capped, bad input names
``sizes``."""

from __future__ import annotations

import pytest

from engine.scheduler.costs_probe import plan


def test_default_sizes_are_capped_and_filled_up_to_three():
    assert plan(None, 16, 8192) == [16, 256, 1024, 4096]
    assert plan(None, 16, 1000) == [16, 256, 992]  # 1024 and 4096 capped to the free whole pages
    assert plan(None, 16, 64) == [16, 32, 64]  # filled up so the crossover can fit a line
    assert plan(None, 64, 64) == [64]  # one page is all there is


def test_given_sizes_round_up_to_pages_and_drop_duplicates():
    assert plan((20, 16, 17, 300), 16, 512) == [16, 32, 304]


@pytest.mark.parametrize(
    ("sizes", "page", "cap"),
    [((), 16, 512), ((0,), 16, 512), ((-3,), 16, 512), ((True,), 16, 512), ((513,), 16, 512),
     ((16,) * 9, 16, 512), (None, 16, 8)],
)  # fmt: skip
def test_bad_sizes_name_the_field(sizes, page, cap):
    with pytest.raises(ValueError, match="sizes"):
        plan(sizes, page, cap)
