"""Triton kernels for the engine's GPU path: KV page transfer (``transfer``), paged attention (``attention``).

Imported only by ``engine`` (its ``kernel`` io backend and ``triton`` attention backend); ``launch`` picks
compiled CUDA or, with ``TRITON_INTERPRET=1``, Triton's interpreter on the CPU. This module itself does not
import Triton, so the engine can ask where the kernels run without paying for the import.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def interpreting() -> bool:
    """True when ``TRITON_INTERPRET=1`` in the environment now."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def unavailable_reason(device: torch.device | str) -> str | None:
    """Why the kernels cannot run on ``device`` (None when they can): CUDA, or any device under the
    interpreter. Reads only the device's type, so it does not import torch (``launch_server`` validates
    ``--attention-backend`` with it before the model stack loads)."""
    device_type = str(device).split(":", 1)[0]
    if device_type == "cuda" or interpreting():
        return None
    return f"Triton kernels need a CUDA device or TRITON_INTERPRET=1 (the KV pool is on {device_type})"
