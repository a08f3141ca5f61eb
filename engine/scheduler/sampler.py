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

:class:`BatchSampler` is what the scheduler calls after a forward pass: grammar masks, ``adjust``,
``sample`` and the output log-probabilities for a batch of requests, with a failure kept to the request
whose row raised, and under tensor parallelism rank 0's tokens on every rank.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from engine.grammar.state import apply_vocab_masks
from engine.scheduler.logprobs import read
from engine.scheduler.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.scheduler.req import Req
    from engine.scheduler.tp_sync import TPSync

logger = logging.getLogger(__name__)


class BatchSampler:
    """Picks one token per request from a batch's last-position logits.

    ``eos_token_ids``: what ``min_new_tokens`` bans besides each request's stop ids. ``tp``: the tensor
    parallel sync (None on one rank). ``abort(req, message)``: end ``req`` as an abort (called for a request
    whose sampling failed here or on rank 0; it must do nothing for a finished request).
    """

    def __init__(
        self, eos_token_ids: tuple[int, ...], tp: TPSync | None, abort: Callable[[Req, str], None]
    ) -> None:
        self.eos_token_ids = eos_token_ids
        self.tp = tp
        self.abort = abort

    def sample(self, logits: torch.Tensor, reqs: list[Req]) -> list[int | None]:
        """One token per request from ``logits`` ``(B, vocab)``. When the batch raises, rows are sampled one
        by one and a request whose row raises is aborted alone (``None`` in its place). Under tensor
        parallelism every rank takes rank 0's tokens."""
        tokens = self._sample_here(logits, reqs)
        if self.tp is None:
            return tokens
        agreed = self.tp.tokens(tokens)
        for req, tok in zip(reqs, agreed, strict=True):
            if tok is None:  # rank 0 aborted it
                self.abort(req, "sampling failed on rank 0")
        return agreed

    def _sample_here(self, logits: torch.Tensor, reqs: list[Req]) -> list[int | None]:
        try:
            return list(self.sample_rows(logits, reqs))  # list[int] as list[int | None]: a copy
        except Exception:
            logger.exception("batched sampling failed; sampling rows one by one")
        tokens: list[int | None] = []
        for i, req in enumerate(reqs):
            try:
                tokens.append(self.sample_rows(logits[i : i + 1], [req])[0])
            except Exception as exc:
                logger.exception("request %s failed in sampling", req.rid)
                self.abort(req, f"sampling failed: {exc}")
                tokens.append(None)
        return tokens

    def sample_rows(self, logits: torch.Tensor, reqs: list[Req]) -> list[int]:
        """Mask (grammars), adjust (penalties, ``min_new_tokens``, logit bias), sample, and record the output
        log-probability of each request that asked for it."""
        params = [r.params for r in reqs]
        logits = apply_vocab_masks(logits.float(), [r.grammar for r in reqs])  # constrained decoding
        if any(p.adjusts_logits for p in params):
            logits = adjust(logits.clone(), params, [r.output_ids for r in reqs], self.eos_token_ids)
        tokens = sample(logits, params, [r.generator for r in reqs])
        for i, req in enumerate(reqs):
            if req.logprob is not None:
                lp = logprobs(logits[i], req.params).unsqueeze(0)
                req.logprob.output.extend(read(lp, [tokens[i]], req.logprob.want))
        return tokens


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
