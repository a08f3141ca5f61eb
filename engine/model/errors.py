"""Errors raised while loading a model."""

from __future__ import annotations


class ModelLoadError(Exception):
    """A model path that does not exist or cannot be parsed; the message names the path and the reason."""

    def __init__(self, path: object, reason: str) -> None:
        self.path = str(path)
        self.reason = reason
        super().__init__(f"cannot load model {self.path!r}: {reason}")
