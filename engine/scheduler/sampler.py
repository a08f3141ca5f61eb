"""Token selection from last-position logits (greedy, temperature, top-k, top-p, min-p).

Follows SGLang's sampler semantics: temperature 0 (or top_k 1) is argmax; otherwise logits are divided by
the temperature, filtered by top-k, then top-p (keep the smallest set whose probability reaches ``top_p``),
then min-p (drop tokens below ``min_p`` times the top probability), and one token is drawn.

Before that, ``adjust`` changes the logits as upstream's penalizers and logit bias do: frequency penalty
(minus ``frequency_penalty`` x the token's count in the output so far), presence penalty (minus
``presence_penalty`` for a token in the output), repetition penalty (an output token's positive logit divided
by ``repetition_penalty``, a negative one multiplied), ``min_new_tokens`` (EOS and stop token ids get -inf
until that many tokens were generated), then ``logit_bias`` added. ``logprobs`` gives the distribution a
token was drawn from, the one its reported log-probability comes from.
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


def adjust(
    logits: torch.Tensor, params: list[SamplingParams], outputs: list[list[int]], eos_ids: tuple[int, ...]
) -> torch.Tensor:
    """``logits`` ``(B, vocab)`` float32 with each row's penalties, ``min_new_tokens`` mask and logit bias
    applied (in place; rows of requests that ask for none are unchanged). ``outputs``: each row's generated
    ids so far."""
    vocab = logits.shape[1]
    for i, p in enumerate(params):
        if not p.adjusts_logits:
            continue
        row, out = logits[i], outputs[i]
        if out and (p.frequency_penalty or p.presence_penalty or p.repetition_penalty != 1.0):
            ids = torch.tensor(out, dtype=torch.long, device=row.device)
            counts = torch.bincount(ids, minlength=vocab)[:vocab]
            seen = counts > 0
            if p.repetition_penalty != 1.0:
                rep = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
                row.copy_(torch.where(seen, rep, row))
            row -= p.frequency_penalty * counts.to(row.dtype) + p.presence_penalty * seen.to(row.dtype)
        if len(out) < p.min_new_tokens:
            banned = [t for t in (*eos_ids, *p.stop_token_ids) if 0 <= t < vocab]
            if banned:
                row[banned] = float("-inf")
        if p.logit_bias:
            biased = [t for t in p.logit_bias if t < vocab]
            row[biased] += torch.tensor([p.logit_bias[t] for t in biased], dtype=row.dtype, device=row.device)
    return logits


def logprobs(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Log-probabilities ``(vocab,)`` of the distribution a token of ``p`` is drawn from: the adjusted
    logits ``row`` divided by the temperature (greedy: by 1), log-softmaxed, before top-k / top-p / min-p."""
    row = row.float()
    if not p.greedy:
        row = row / p.temperature
    return torch.log_softmax(row, dim=-1)


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
