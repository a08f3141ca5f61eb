"""How the kernels launch: compiled for CUDA or through Triton's interpreter.

With ``TRITON_INTERPRET=1`` Triton runs a kernel's programs one after another in numpy on the CPU (slow, for
tests). ``triton.jit`` makes that choice once, when the module is imported; :func:`jit` makes it at each
launch from the environment, so one process (a test session) can run the interpreted kernels without every
other part of it, or every child process, inheriting the variable. The interpreter keeps global state per
launch (the grid index, patched ``tl`` functions), so two threads launching at once (the load-back thread
and the forward pass) would corrupt each other: interpreted launches take one process-wide lock. Compiled
launches need none.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

from kernels import interpreting

_INTERPRETER_LOCK = threading.Lock()


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
    """Decorator: ``fn`` (a Triton kernel body; it may call :func:`helper` functions) as a :class:`Kernel`."""
    return Kernel(fn)


class _Helper(JITFunction):
    """A Triton device function a :class:`Kernel` calls: compiled into the caller when the kernel is
    compiled, called as plain Python (on the interpreter's patched ``tl``) when it is interpreted, where a
    ``triton.jit`` function refuses to be called."""

    def __call__(self, *args, **kwargs):
        if interpreting():
            return self.fn(*args, **kwargs)
        return super().__call__(*args, **kwargs)


def helper(fn: Callable) -> JITFunction:
    """Decorator: ``fn`` (a Triton device function) callable from :func:`jit` kernels in both modes."""
    return _Helper(fn)
