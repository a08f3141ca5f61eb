"""KVFleet's C++ extension for the CPU: the fused decode step, the VNNI weight-only matmuls, KV page copies.

``fused/decode_step.cpp`` (a decode-only batch through every layer in one call, ``fused_decode.py``) with
``fused/glue.cpp`` (its float32 row kernels), ``fused/quant_gemv.cpp`` (int4 / int8 weight-only matmuls
for a few activation rows with AVX512-VNNI, ``linear.py``) and ``fused/page_copy.cpp`` (the KV cache's
whole-page copies, ``engine/cache/io_backends/direct.py``) are one module, compiled with
``torch.utils.cpp_extension`` (g++ and ninja) into ``<venv>/kvfleet-ext/`` once per venv and source version
(``make venv`` builds it, ``python -m engine.model.extension`` by hand, 25-60 s here; a first use builds it
otherwise); later processes only load it. ``load_extension`` raises ``ExtensionUnavailable`` when it cannot
be built.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import sys
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

FUSED = Path(__file__).with_name("fused")
SOURCES = (FUSED / "decode_step.cpp", FUSED / "glue.cpp", FUSED / "quant_gemv.cpp", FUSED / "page_copy.cpp")
HEADERS = (FUSED / "glue.h", FUSED / "quant_gemv.h", FUSED / "page_copy.h")
EXTENSION_NAME = "kvfleet_fused_decode"
_loaded: ModuleType | None = None


class ExtensionUnavailable(RuntimeError):
    """The C++ extension could not be built or loaded here (the message says why)."""


def build_directory() -> Path:
    """``$KVFLEET_EXTENSIONS_DIR`` or ``<sys.prefix>/kvfleet-ext`` (the venv's), then
    ``torch-<version>-<hash>`` of the sources, of their folder and of the path torch is imported from (both
    paths are in the build file, so checkouts that reach one venv through different paths, or hold different
    sources, each build once instead of rebuilding over each other)."""
    root = os.environ.get("KVFLEET_EXTENSIONS_DIR") or Path(sys.prefix) / "kvfleet-ext"
    paths = f"{Path(torch.__file__).parent}\0{FUSED.resolve()}"
    key = b"".join(p.read_bytes() for p in (*SOURCES, *HEADERS)) + paths.encode()
    digest = hashlib.sha256(key).hexdigest()[:12]
    return Path(root) / f"torch-{torch.__version__}-{digest}"


def load_extension() -> ModuleType:
    """The compiled extension, built on first use (``ExtensionUnavailable`` when it cannot be)."""
    global _loaded
    if _loaded is None:
        from torch.utils import cpp_extension

        directory = build_directory()
        try:
            directory.mkdir(parents=True, exist_ok=True)
            # cpp_extension's own lock file outlives a build that is killed and then blocks every later
            # load for ever; an flock dies with its process, so whoever holds it may drop a stale one
            with open(directory / "build.flock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                (directory / "lock").unlink(missing_ok=True)
                _loaded = cpp_extension.load(
                    EXTENSION_NAME,
                    [str(s) for s in SOURCES],
                    extra_cflags=["-O3", "-fopenmp-simd"],
                    build_directory=str(directory),
                )
        except Exception as exc:  # no compiler / ninja, read-only venv, compile error
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            names = " + ".join(s.name for s in SOURCES)
            raise ExtensionUnavailable(f"cannot build {names} in {directory}: {first}") from exc
    return _loaded


def main() -> None:
    """``python -m engine.model.extension``: build (or load) the extension now, print where it lives."""
    logging.basicConfig(level=logging.INFO)
    try:
        ext = load_extension()
    except ExtensionUnavailable as exc:
        print(f"C++ extension not built: {exc}", file=sys.stderr)
        sys.exit(1)
    vnni = "runs" if ext.gemv_supported() else "does not run (no AVX512-VNNI on this CPU)"
    print(f"C++ extension built in {build_directory()}; its VNNI matmul {vnni}")


if __name__ == "__main__":
    main()
