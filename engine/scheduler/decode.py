"""The decode set: the requests that generate one token per decode step, and when each one stops.

After mini-sglang's ``DecodeManager``: every running request joins every decode batch (admission reserved its
KV for prompt + ``max_new_tokens``, so none runs out mid-way and none is ever retracted). ``finish_reason``
is the stop rule, upstream's order: EOS (unless ``ignore_eos``), a stop token id, a stop string in the
detokenized tail, then ``max_new_tokens``. Runs on the scheduler thread; it runs no model and sends no event.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

from engine.scheduler.req import Req


class DecodeManager:
    """The running requests, in the order they started decoding.

    ``eos_token_ids``: the model's end-of-sequence ids. ``detokenize(ids) -> str`` is used only for stop
    strings.
    """

    def __init__(self, eos_token_ids: tuple[int, ...], detokenize: Callable[[list[int]], str]) -> None:
        self.eos_token_ids = eos_token_ids
        self.detokenize = detokenize
        self.running: list[Req] = []

    def __len__(self) -> int:
        return len(self.running)

    def __iter__(self) -> Iterator[Req]:
        return iter(self.running)

    def __contains__(self, req: Req) -> bool:
        return req in self.running

    def add(self, req: Req) -> None:
        """``req`` decodes from the next step on."""
        self.running.append(req)

    def remove(self, req: Req) -> None:
        """``req`` ended; a request not running is ignored."""
        if req in self.running:
            self.running.remove(req)

    def batch(self) -> list[Req]:
        """The next decode batch: every running request (a copy; requests may end while it runs)."""
        return list(self.running)

    def finish_reason(self, req: Req, tok: int) -> dict | None:
        """SGLang's finish reason once ``tok`` (already appended to ``req.output_ids``) ends ``req``, else
        None: ``{"type": "stop", "matched": id | str}`` (for ``stop_regex``: the text it matched) or
        ``{"type": "length", "length": n}``."""
        p = req.params
        if not p.ignore_eos and tok in self.eos_token_ids:
            return {"type": "stop", "matched": tok}
        if tok in p.stop_token_ids:
            return {"type": "stop", "matched": tok}
        if p.stop:
            tail = self.detokenize(req.output_ids[-(max(len(s) for s in p.stop) + 8) :])
            for s in p.stop:
                if s in tail:
                    return {"type": "stop", "matched": s}
        if p.stop_regex:
            text = self.detokenize(req.output_ids)
            for pattern in p.stop_regex:
                found = next((m.group(0) for m in re.finditer(pattern, text) if m.group(0)), None)
                if found is not None:
                    return {"type": "stop", "matched": found}
        if len(req.output_ids) >= p.max_new_tokens:
            return {"type": "length", "length": len(req.output_ids)}
        return None
