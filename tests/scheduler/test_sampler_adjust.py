"""The logit adjustments before sampling (penalties, ``min_new_tokens``, ``logit_bias``), the distribution an
output logprob is read from, and upstream's resolution of ``logprob_start_len``."""

from __future__ import annotations

import math

import pytest
import torch

from engine.scheduler.logprobs import LogprobRequest
from engine.scheduler.sampler import adjust, logprobs
from engine.scheduler.sampling_params import SamplingParams


def test_penalties_count_the_output_only():
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.0]])
    p = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25, repetition_penalty=2.0)
    out = adjust(logits.clone(), [p], [[0, 0, 1]], eos_ids=())
    # token 0: seen twice, positive -> 2/2 - 0.5*2 - 0.25; token 1: once, negative -> -1*2 - 0.5 - 0.25
    assert out[0].tolist() == pytest.approx([2.0 / 2 - 1.0 - 0.25, -2.0 - 0.5 - 0.25, 0.5, 1.0])


def test_min_new_tokens_bans_eos_and_stop_ids_until_reached_and_bias_adds():
    p = SamplingParams(min_new_tokens=2, stop_token_ids=[2], logit_bias={3: 5.0})
    early = adjust(torch.zeros(1, 4), [p], [[1]], eos_ids=(0,))
    assert early[0].tolist() == [-math.inf, 0.0, -math.inf, 5.0]
    late = adjust(torch.zeros(1, 4), [p], [[1, 1]], eos_ids=(0,))
    assert late[0].tolist() == [0.0, 0.0, 0.0, 5.0]


def test_rows_without_adjustments_are_untouched():
    logits = torch.randn(2, 5)
    out = adjust(logits.clone(), [SamplingParams(), SamplingParams(logit_bias={1: 1.0})], [[0], [0]], ())
    assert torch.equal(out[0], logits[0]) and out[1, 1] == logits[1, 1] + 1.0


def test_output_logprobs_use_the_temperature_unless_greedy():
    row = torch.tensor([1.0, 2.0, 3.0])
    assert torch.allclose(logprobs(row, SamplingParams(temperature=0)), torch.log_softmax(row, -1))
    assert torch.allclose(logprobs(row, SamplingParams(temperature=0.5)), torch.log_softmax(row / 0.5, -1))


@pytest.mark.parametrize(("start", "expected"), [(None, 9), (-1, 9), (0, 0), (4, 4), (50, 9)])
def test_logprob_start_len_resolves_as_upstream(start, expected):
    assert LogprobRequest.resolve(10, start, None, None).start == expected


@pytest.mark.parametrize(
    ("args", "named"),
    [
        ((-2, None, None), "logprob_start_len"),
        ((0, -1, None), "top_logprobs_num"),
        ((0, 0, [1, -3]), "token_ids"),
    ],
)
def test_bad_logprob_fields_name_the_field(args, named):
    with pytest.raises(ValueError, match=named):
        LogprobRequest.resolve(10, *args)
