"""What ``--dtype auto`` computes with: the activation dtype and the weights' quantization.

- An explicit ``--dtype`` is kept as given, with the ``--torchao-config`` given (or none).
- CUDA: bfloat16.
- CPU, a GGUF whose every projection of a dense model is stored as Q4_1 and ``--torchao-config`` unset:
  bfloat16 activations on ``int4wo-32`` weights. Q4_1 stores ``d * q + m`` per block of 32 weights with the
  block's min at ``q = 0`` and max at ``q = 15``, which is ``int4wo-32``'s grid, so each weight keeps its
  GGUF code (only the fp16 ``d`` / ``m`` round to bfloat16): the model computes on the file's blocks as
  stored, as llama.cpp does (and as upstream SGLang does with a GGUF: it implies ``--quantization gguf``).
  docs/model.md has the drift against float32 and llama.cpp's own, docs/benchmarks.md the speed.
- CPU otherwise: float32 (equal to transformers within 1e-4); with an ``int4wo-*`` ``--torchao-config``:
  bfloat16, the only dtype the int4 kernels take.

``--dtype float32`` restores exact parity with transformers on a Q4_1 GGUF. The engine resolves from the
loaded checkpoint (``resolve_compute``), the sizing tool from the file's layout alone (``compute_for_path``):
the same rule on the same facts.
"""

from __future__ import annotations

from pathlib import Path

from engine.model.config import ModelConfig
from engine.model.loader.checkpoint import Checkpoint

# the torchao config whose grid equals a GGUF block type's (same codes, same scale/min per block)
SAME_GRID = {"Q4_1": "int4wo-32"}


def stored_grid(config: ModelConfig, layout: dict[str, tuple[str, tuple[int, ...]]]) -> str | None:
    """The ``--torchao-config`` equal to the GGUF blocks every projection weight is stored in (``layout``:
    HF name -> (GGUF type, shape); ``"int4wo-32"`` for Q4_1), or None: no layout (an HF folder), mixed or
    other block types, an MoE or MLA model (their expert and latent projections are not checked against
    the int4 kernels), or a shape the int4 kernel does not take (``in_features`` not a multiple of 32,
    ``out_features`` not of 16)."""
    if config.num_experts or config.mla:
        return None
    projections = [
        (kind, shape)
        for name, (kind, shape) in layout.items()
        if name.startswith("model.layers.") and name.endswith("_proj.weight") and len(shape) == 2
    ]
    grids = {SAME_GRID.get(kind) for kind, _ in projections}
    if len(grids) != 1 or None in grids:
        return None
    fits = all(shape[1] % 32 == 0 and shape[0] % 16 == 0 for _, shape in projections)
    return grids.pop() if fits else None


def _resolve(dtype: str, quantization: str | None, device: str, grid: str | None) -> tuple[str, str | None]:
    if dtype != "auto":
        return dtype, quantization
    if device != "cpu":
        return "bfloat16", quantization
    if quantization:
        return ("bfloat16" if quantization.startswith("int4wo") else "float32"), quantization
    return ("bfloat16", grid) if grid else ("float32", None)


def resolve_compute(
    dtype: str, quantization: str | None, device: str, checkpoint: Checkpoint
) -> tuple[str, str | None]:
    """``(dtype, quantization)`` to build ``checkpoint`` with, from the ``--dtype`` and ``--torchao-config``
    values (``quantization`` None when unset) on ``device`` (``"cpu"`` / ``"cuda"``), per the rules above."""
    layout = {
        name: (kind, tuple(checkpoint.tensors[name].shape))
        for name, kind in checkpoint.stored_types.items()
        if name in checkpoint.tensors
    }
    return _resolve(dtype, quantization, device, stored_grid(checkpoint.config, layout))


def compute_for_path(
    dtype: str, quantization: str | None, device: str, model_path: str | Path
) -> tuple[str, str | None]:
    """``resolve_compute`` for the model at ``model_path`` from its config and GGUF layout only (no tensor
    data read); raises ``ModelLoadError`` for a bad path."""
    from engine.model.loader import load_layout

    if dtype != "auto" or device != "cpu" or quantization:
        return _resolve(dtype, quantization, device, None)
    config, layout = load_layout(model_path)
    return _resolve(dtype, quantization, device, stored_grid(config, layout))
