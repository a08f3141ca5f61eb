"""Where the kernels can run, and how they launch: compiled for CUDA or through Triton's interpreter.

With ``TRITON_INTERPRET=1`` Triton runs a kernel's programs one after another in numpy on the CPU (slow, for
tests). ``triton.jit`` makes that choice once, when the module is imported; :func:`jit` makes it at each
launch from the environment, so one process (a test session) can run the interpreted kernels without every
other part of it, or every child process, inheriting the variable. The interpreter keeps global state per
launch (the grid index, patched ``tl`` functions), so two threads launching at once (the load-back thread
and the forward pass) would corrupt each other: interpreted launches take one process-wide lock. Compiled
launches need none.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

import torch
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

_INTERPRETER_LOCK = threading.Lock()


def interpreting() -> bool:
    """True when ``TRITON_INTERPRET=1`` in the environment now."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def unavailable_reason(device: torch.device) -> str | None:
    """Why the kernels cannot run on ``device`` (None when they can): CUDA, or any device under the
    interpreter."""
    if device.type == "cuda" or interpreting():
        return None
    return f"Triton kernels need a CUDA device or TRITON_INTERPRET=1 (the KV pool is on {device.type})"


class Kernel:
    """A Triton kernel function launched as ``kernel[grid](*args, **constexprs)``, compiled or interpreted
    per launch (each variant built on first use)."""

    def __init__(self, fn: Callable) -> None:
        self.fn = fn
        self._compiled: JITFunction | None = None
        self._interpreted: InterpretedFunction | None = None

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., None]:
        if not interpreting():
            if self._compiled is None:
                self._compiled = JITFunction(self.fn)
            return self._compiled[grid]
        if self._interpreted is None:
            self._interpreted = InterpretedFunction(self.fn)
        run = self._interpreted[grid]

        def locked(*args, **kwargs) -> None:
            with _INTERPRETER_LOCK:
                run(*args, **kwargs)

        return locked


def jit(fn: Callable) -> Kernel:
    """Decorator: ``fn`` (a Triton kernel body, no nested jit calls) as a :class:`Kernel`."""
    return Kernel(fn)
