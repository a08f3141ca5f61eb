"""Streamed output text that only ever grows: the text a client may be shown after each scheduler event.

Used by the ``/generate`` stream (cumulative text per frame) and the OpenAI streams (text deltas). Follows
SGLang's streaming rule: a chunk never shows text that a later chunk takes back, so an unfinished UTF-8
sequence and any tail that could still become a stop string (trimmed from the final text unless
``no_stop_trim``) are held back until the next event decides them.
"""

from __future__ import annotations

from engine.scheduler import SamplingParams
from engine.server.engine import Engine


def _stop_prefix_len(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of ``text`` that is a prefix of (or equals) one of ``stops``."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop), len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest


class StreamText:
    """Turns cumulative token ids into monotonic text: ``push`` returns the newly released characters and
    ``text`` is everything released so far (a prefix of the final, stop-trimmed output)."""

    def __init__(self, engine: Engine, params: SamplingParams):
        self.engine, self.params = engine, params
        self.ids: list[int] = []
        self.text = ""

    def push(self, new_ids: list[int], finish_reason: dict | None) -> str:
        """Add one event's ids (``finish_reason`` on the last); the text delta now safe to show."""
        self.ids.extend(new_ids)
        text = self.engine.output_text(self.ids, self.params, finish_reason)
        if finish_reason is None:
            text = text.rstrip("\ufffd")
            text = text[: len(text) - _stop_prefix_len(text, self.params.stop)]
        delta = text[len(self.text) :] if text.startswith(self.text) else ""
        self.text += delta
        return delta
