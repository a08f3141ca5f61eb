"""What ``--dtype auto`` computes with: the activation dtype and the weights' quantization.

- An explicit ``--dtype`` is kept as given, with the ``--torchao-config`` given (or none).
- CUDA: bfloat16.
- CPU, a GGUF whose every projection of a dense model is stored as Q4_1 and ``--torchao-config`` unset:
  bfloat16 activations on ``int4wo-32`` weights. Q4_1 stores ``d * q + m`` per block of 32 weights with the
  block's min at ``q = 0`` and max at ``q = 15``, which is ``int4wo-32``'s grid, so each weight keeps its
  GGUF code (only the fp16 ``d`` / ``m`` round to bfloat16): the model computes on the file's blocks as
  stored, as llama.cpp does, and decodes faster than llama.cpp on the same file (docs/model.md has the
  drift against float32 and llama.cpp's own, docs/benchmarks.md the speed).
- CPU otherwise: float32 (equal to transformers within 1e-4); with an ``int4wo-*`` ``--torchao-config``:
  bfloat16, the only dtype the int4 kernels take.

``--dtype float32`` restores exact parity with transformers on a Q4_1 GGUF.
"""

from __future__ import annotations

from engine.model.loader.checkpoint import Checkpoint

# the torchao config whose grid equals a GGUF block type's (same codes, same scale/min per block)
SAME_GRID = {"Q4_1": "int4wo-32"}


def stored_grid(checkpoint: Checkpoint) -> str | None:
    """The ``--torchao-config`` equal to the GGUF blocks every projection weight of ``checkpoint`` is stored
    in (``"int4wo-32"`` for Q4_1), or None: not a GGUF, mixed or other block types, an MoE or MLA model
    (their expert and latent projections are not checked against the int4 kernels), or a shape the int4
    kernel does not take (``in_features`` not a multiple of 32, ``out_features`` not of 16)."""
    cfg = checkpoint.config
    if not checkpoint.stored_types or cfg.num_experts or cfg.mla:
        return None
    projections = [
        name
        for name, tensor in checkpoint.tensors.items()
        if name.startswith("model.layers.") and name.endswith("_proj.weight") and tensor.dim() == 2
    ]
    grids = {SAME_GRID.get(checkpoint.stored_types.get(name, "")) for name in projections}
    if len(grids) != 1 or None in grids:
        return None
    fits = all(
        checkpoint.tensors[name].shape[1] % 32 == 0 and checkpoint.tensors[name].shape[0] % 16 == 0
        for name in projections
    )
    return grids.pop() if fits else None


def resolve_compute(
    dtype: str, quantization: str | None, device: str, checkpoint: Checkpoint
) -> tuple[str, str | None]:
    """``(dtype, quantization)`` to build ``checkpoint`` with, from the ``--dtype`` and ``--torchao-config``
    values (``quantization`` None when unset) on ``device`` (``"cpu"`` / ``"cuda"``), per the rules above."""
    if dtype != "auto":
        return dtype, quantization
    if device != "cpu":
        return "bfloat16", quantization
    if quantization:
        return ("bfloat16" if quantization.startswith("int4wo") else "float32"), quantization
    grid = stored_grid(checkpoint)
    return ("bfloat16", grid) if grid else ("float32", None)
