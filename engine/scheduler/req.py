"""One generation request as the scheduler tracks it, and the events it sends back to the HTTP side."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.scheduler.sampling_params import SamplingParams


@dataclass
class ReqOutput:
    """What the scheduler reports after a step: the new token ids, and at the end the finish reason.

    ``finish_reason`` follows SGLang's meta_info: ``{"type": "length", "length": n}``,
    ``{"type": "stop", "matched": <token id or stop string>}`` or ``{"type": "abort", "message": str}``.
    ``meta`` is filled on the first event (cache hit counts) and the last one (latencies).
    """

    rid: str
    new_ids: list[int]
    finished: bool = False
    finish_reason: dict | None = None
    meta: dict = field(default_factory=dict)


@dataclass(eq=False)
class Req:
    """Scheduler-side state of one request.

    KV layout: ``kv_indices[i]`` is the L1 slot of position ``i`` (a 1-D int64 tensor reserved at admission
    for prompt + ``max_new_tokens``). Positions ``[0, prefix_len)`` belong to the radix tree and are protected
    by the lock on ``last_node``; the rest were allocated for this request. ``num_computed`` positions have
    their KV written. ``on_event`` is called on the scheduler thread and must only hand the event over.
    """

    rid: str
    input_ids: list[int]
    params: SamplingParams
    on_event: Callable[[ReqOutput], None]
    output_ids: list[int] = field(default_factory=list)
    kv_indices: torch.Tensor | None = None
    prefix_len: int = 0
    num_computed: int = 0
    last_node: object = None
    cached: dict = field(default_factory=lambda: {"device": 0, "host": 0, "storage": 0})
    finished: bool = False
    aborted: str | None = None
    arrival: float = field(default_factory=time.perf_counter)
    admitted_at: float | None = None
    first_token_at: float | None = None
    generator: torch.Generator | None = None

    @property
    def fill_ids(self) -> list[int]:
        """Prompt followed by the generated tokens."""
        return self.input_ids + self.output_ids

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens served from any cache tier."""
        return self.cached["device"] + self.cached["host"] + self.cached["storage"]
