"""Token log-probabilities a request asks for, and how they are read off the model's logits.

Upstream's fields (``/generate``: ``return_logprob``, ``logprob_start_len``, ``top_logprobs_num``,
``token_ids_logprob``). Prompt position ``p`` (``start <= p < len(prompt)``) gets the log-probability of
``prompt[p]`` given ``prompt[:p]``, read from the logits row of position ``p - 1``; as upstream, the first of
them (position ``start``) is always None, since no row before ``start`` is computed. Output token ``i`` gets
its log-probability under the distribution it was sampled from (after penalties and logit bias, divided by
the temperature unless greedy). Admission matches at most ``start`` prompt tokens from the cache
(``prefix_cap``), so the rows of every position that needs one are computed by this request's own forward
pass whatever tier held the prefix.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class LogprobRequest:
    """What one request asks for. ``start``: first prompt position reported (resolved: 0 <= start <
    prompt length; upstream's -1 means the last prompt token). ``top_n``: how many most likely tokens per
    position (0: none). ``token_ids``: ids whose log-probability is reported at every position (None:
    none)."""

    start: int
    top_n: int = 0
    token_ids: tuple[int, ...] | None = None

    @classmethod
    def resolve(
        cls, prompt_len: int, start_len: int | None, top_n: int | None, token_ids: list[int] | None
    ) -> LogprobRequest:
        """Upstream's resolution of ``logprob_start_len`` (-1 or None: the last prompt token); a start at or
        past the prompt's end is clamped to its last token. ``ValueError`` names a bad field."""
        start = -1 if start_len is None else start_len
        if isinstance(start, bool) or not isinstance(start, int) or start < -1:
            raise ValueError(f"logprob_start_len must be an integer >= -1, got {start_len!r}")
        if start == -1 or start >= prompt_len:
            start = prompt_len - 1
        top = 0 if top_n is None else top_n
        if isinstance(top, bool) or not isinstance(top, int) or top < 0:
            raise ValueError(f"top_logprobs_num must be an integer >= 0, got {top_n!r}")
        ids = None
        if token_ids is not None:
            if not isinstance(token_ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in token_ids
            ):
                raise ValueError("token_ids_logprob must be a list of token ids")
            ids = tuple(token_ids)
        return cls(start, top, ids)

    def prefix_cap(self) -> int:
        """At most this many prompt tokens may come from the cache (the rows from ``start`` on are needed)."""
        return self.start


@dataclass
class LogprobValues:
    """Log-probabilities at a run of positions (one entry per position, None where there is no row):
    ``token`` the chosen token's, ``top`` the ``top_n`` best ``(values, ids)``, ``ids`` those of the
    requested ``token_ids`` in their order."""

    token: list[float | None] = field(default_factory=list)
    top: list[tuple[list[float], list[int]] | None] = field(default_factory=list)
    ids: list[list[float] | None] = field(default_factory=list)

    def extend(self, other: LogprobValues) -> None:
        self.token += other.token
        self.top += other.top
        self.ids += other.ids

    def pad(self) -> None:
        """One position with no row (the first reported prompt position)."""
        self.token.append(None)
        self.top.append(None)
        self.ids.append(None)

    def __len__(self) -> int:
        return len(self.token)


def read(logprobs: torch.Tensor, chosen: list[int], want: LogprobRequest) -> LogprobValues:
    """Values of ``want`` from ``logprobs`` ``(R, vocab)`` (float32 log-softmax rows) for the ``chosen``
    token of each row (R ids)."""
    dev = logprobs.device
    rows = torch.arange(len(chosen), device=dev)
    out = LogprobValues(token=logprobs[rows, torch.tensor(chosen, dtype=torch.long, device=dev)].tolist())
    if want.top_n > 0:
        k = min(want.top_n, logprobs.shape[1])
        vals, idx = torch.topk(logprobs, k, dim=-1)
        out.top = list(zip(vals.tolist(), idx.tolist(), strict=True))
    else:
        out.top = [None] * len(chosen)
    if want.token_ids is not None:
        out.ids = logprobs[:, torch.tensor(want.token_ids, dtype=torch.long, device=dev)].tolist()
    else:
        out.ids = [None] * len(chosen)
    return out


@dataclass
class LogprobState:
    """A request's log-probabilities so far: ``input`` (complete once the prompt is done) and ``output``
    (one entry per generated token). ``sent_input`` / ``sent_output``: how much the events carried."""

    want: LogprobRequest
    input: LogprobValues = field(default_factory=LogprobValues)
    output: LogprobValues = field(default_factory=LogprobValues)
    sent_input: int = 0
    sent_output: int = 0

    def __post_init__(self) -> None:
        if not self.input:
            self.input.pad()  # position ``start`` has no row before it

    def take_new(self, num_output: int) -> dict:
        """What the next event carries: ``{"input": LogprobValues, "output": LogprobValues}`` of the entries
        not sent yet; output entries past ``num_output`` (a token sampled but not kept) are dropped."""
        del self.output.token[num_output:], self.output.top[num_output:], self.output.ids[num_output:]
        new = {"input": _slice(self.input, self.sent_input), "output": _slice(self.output, self.sent_output)}
        self.sent_input, self.sent_output = len(self.input), len(self.output)
        return new


def _slice(v: LogprobValues, start: int) -> LogprobValues:
    return LogprobValues(v.token[start:], v.top[start:], v.ids[start:])


def to_wire(values: LogprobValues, i: int) -> dict:
    """Entry ``i`` of ``values`` as plain JSON (P sends the first output token's to D)."""
    top = values.top[i]
    return {"token": values.token[i], "top": None if top is None else [top[0], top[1]], "ids": values.ids[i]}


def run_to_wire(values: LogprobValues) -> dict:
    """All of ``values`` as plain JSON (P sends the prompt's to D)."""
    top = [None if t is None else [t[0], t[1]] for t in values.top]
    return {"token": list(values.token), "top": top, "ids": list(values.ids)}


def run_from_wire(data: dict) -> LogprobValues:
    """A run sent by ``run_to_wire``."""
    top = [None if t is None else (t[0], t[1]) for t in data.get("top") or []]
    return LogprobValues(list(data.get("token") or []), top, list(data.get("ids") or []))


def from_wire(data: dict) -> LogprobValues:
    """One entry sent by ``to_wire``."""
    top = data.get("top")
    return LogprobValues([data.get("token")], [None if top is None else (top[0], top[1])], [data.get("ids")])
