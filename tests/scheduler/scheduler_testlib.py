"""Helpers for the scheduler tests: a fake runner standing for the model, and request outcomes."""

from __future__ import annotations

import threading

import torch

from engine.scheduler import Req, ReqOutput, SamplingParams, Scheduler

VOCAB = 64


class FakeModelRunner:
    """Stands for the model, which the scheduling policy does not need: ``forward`` records each pass as
    ``(kind, [new tokens of each sequence])`` (``kind``: ``prefill`` or ``decode``) and returns logits whose
    argmax is the last new token of each sequence + 1 (mod ``VOCAB``). It writes no KV."""

    def __init__(self) -> None:
        self.passes: list[tuple[str, list[list[int]]]] = []

    def forward(self, batch, pool) -> torch.Tensor:
        ids = batch.input_ids.tolist()
        seqs, start = [], 0
        for n in batch.extend_lens_cpu:
            seqs.append(ids[start : start + n])
            start += n
        decode = all(n == 1 for n in batch.extend_lens_cpu) and batch.seq_lens_cpu != batch.extend_lens_cpu
        self.passes.append(("decode" if decode else "prefill", seqs))
        logits = torch.zeros(len(seqs), VOCAB)
        for i, seq in enumerate(seqs):
            logits[i, (seq[-1] + 1) % VOCAB] = 1.0
        return logits

    def prefills(self) -> list[list[list[int]]]:
        """The new tokens of each sequence of each prefill pass, in order."""
        return [seqs for kind, seqs in self.passes if kind == "prefill"]


class Outcome:
    """What one request's events said: its tokens and, once it ended, its finish reason."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.reason: dict | None = None
        self.done = threading.Event()

    def __call__(self, ev: ReqOutput) -> None:
        self.ids.extend(ev.new_ids)
        if ev.finished:
            self.reason = ev.finish_reason
            self.done.set()


def submit(sched: Scheduler, rid: str, prompt: list[int], max_new_tokens: int = 1, **kw) -> Outcome:
    """Submit a greedy request; its ``Outcome`` fills in as events arrive."""
    out = Outcome()
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
    sched.submit(Req(rid, prompt, params, out, **kw))
    return out
