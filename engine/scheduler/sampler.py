"""Token selection from last-position logits (greedy, temperature, top-k, top-p, min-p).

Follows SGLang's sampler semantics: temperature 0 (or top_k 1) is argmax; otherwise logits are divided by
the temperature, filtered by top-k, then top-p (keep the smallest set whose probability reaches ``top_p``),
then min-p (drop tokens below ``min_p`` times the top probability), and one token is drawn.
"""

from __future__ import annotations

import torch

from engine.scheduler.sampling_params import SamplingParams


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> list[int]:
    """Pick one token per row of ``logits`` (shape ``(B, vocab)``, any float dtype); returns B token ids."""
    logits = logits.float()
    out = logits.argmax(dim=-1).tolist()
    for i, p in enumerate(params):
        if not p.greedy:
            out[i] = _sample_row(logits[i], p, generators[i])
    return out


def _sample_row(row: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
    row = row / p.temperature
    if 0 < p.top_k < row.numel():
        kth = torch.topk(row, p.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    probs = torch.softmax(row, dim=-1)
    if p.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_p, dim=-1)
        drop = (cum - sorted_p) >= p.top_p  # keep tokens until the mass before them reaches top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
    if p.min_p > 0.0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    return int(torch.multinomial(probs, 1, generator=gen).item())
