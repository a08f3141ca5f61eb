"""The fused decode step: a batch of decodes through every layer in one C++ call (``fused/decode_step.cpp``).

A batch-1 decode step of SmolLM2 on the Python path runs about 2,000 small eager torch ops (60-75 per layer x
30 layers), each paying Python, dispatch and an allocation on top of its kernel. ``FusedDecodeStep`` runs the
layers' own matmuls (``linear.py``'s kernels, chosen by rows as on the Python path) and everything between
them as float32 loops in C++ (``fused/glue.cpp``: RMSNorm, RoPE, the K/V write into the pool and the staged
buffers, GQA decode attention over the staged or gathered K/V, SiLU x up, residual adds), with activations
float32 from the embedding to the logits: in float32 the logits equal the Python path's to float32 rounding,
in bfloat16 they are closer to the float32 model's (``tests/model/test_fused_decode.py``). It takes only what
the torch attention backend runs as a decode-only batch (``for_decode``: every sequence one new token, a
prefix already cached) on a float32 or bfloat16 model; prefill and mixed batches stay on the Python path.

The C++ side lives in KVFleet's extension (``engine/model/extension.py``, built once per venv);
``load_extension`` raises ``ExtensionUnavailable`` when it cannot be built, and ``ModelRunner`` then decodes
on the Python path and logs why (``--disable-fused-decode`` turns it off).

A fused step calls the batch's ``layer_hook`` for every layer before its first layer (a decode batch's K/V
is already in L1; this only waits for a load-back of another request still in flight).
"""

from __future__ import annotations

import torch

from engine.cache.device_pool import DeviceKVPool
from engine.model.attention.torch_backend import TorchAttentionBackend
from engine.model.extension import load_extension
from engine.model.forward_batch import ForwardBatch
from engine.model.linear import DenseLinear, Int4WeightOnlyLinear, Int8WeightOnlyLinear

_KINDS = {DenseLinear: 0, Int8WeightOnlyLinear: 1, Int4WeightOnlyLinear: 2}
FUSED_DTYPES = (torch.float32, torch.bfloat16)  # the model dtypes it runs
# quantized pools (glue.h KVQuant); any other pool: 0, rows in its dtype
KV_FORMATS = {"fp8_e4m3": 1, "fp8_e5m2": 2, "int8": 3}


def _linear(layer: DenseLinear | Int8WeightOnlyLinear | Int4WeightOnlyLinear) -> tuple[int, object]:
    """(kind, layer): the C++ side reads the layer's weights and kernel choices from its attributes."""
    return _KINDS[type(layer)], layer


def supports(attn, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a model with this attention backend, device and dtype can take the fused step."""
    return isinstance(attn, TorchAttentionBackend) and device.type == "cpu" and dtype in FUSED_DTYPES


class FusedDecodeStep:
    """The decode-only forward of a ``LlamaForCausalLM`` (its weights shared, not copied) as one C++ call.

    ``ExtensionUnavailable`` when the extension cannot be built; ``ValueError`` for a model this cannot
    run (an attention backend other than ``torch``, a device other than the CPU, float16)."""

    def __init__(self, model) -> None:
        if not supports(model.attn, model.device, model.dtype):
            raise ValueError(
                "the fused decode step needs the torch attention backend on the CPU in float32 or bfloat16"
            )
        ext = load_extension()
        cfg, attn = model.cfg, model.attn
        self.model = model
        self.decoder = ext.FusedDecoder(
            model.embed,
            model.norm,
            model.rope_inv_freq,
            cfg.rms_norm_eps,
            attn.num_heads,
            attn.num_kv_heads,
            attn.head_dim,
            attn.scale,
        )
        for layer in model.layers:
            linears = [_linear(x) for x in (layer.qkv, layer.o_proj, layer.mlp.gate_up, layer.mlp.down)]
            self.decoder.add_layer(layer.input_norm, layer.post_norm, layer.q_norm, layer.k_norm, linears)
        self.decoder.set_lm_head(*_linear(model.lm_head))
        self._empty = torch.empty(0, dtype=torch.long)

    def __call__(self, batch: ForwardBatch, kv_pool: DeviceKVPool) -> torch.Tensor | None:
        """Float32 logits ``(B, vocab)`` of a decode-only batch whose ``init_forward_metadata`` just ran;
        None (nothing done) for any other batch. A quantized pool (fp8 / int8 rows, ``kv_format.py``) is
        written and read in its format: each K/V row widened to float32 in registers, an int8 row's scale
        applied to its dot product and its probability, never dequantized into a buffer."""
        plan = self.model.attn.decode_step_plan(kv_pool)
        if plan is None:
            return None
        if batch.layer_hook is not None:
            for layer in range(len(self.model.layers)):
                batch.layer_hook(layer)
        mode, slots, smax, mask, keys, values, rows, pos = plan
        return self.decoder.step(
            batch.input_ids,
            batch.positions,
            batch.out_cache_loc,
            kv_pool.kv_buffer,
            mode,
            slots,
            smax,
            mask,
            keys,
            values,
            self._empty if rows is None else rows,
            self._empty if pos is None else pos,
            KV_FORMATS.get(kv_pool.kv_cache_dtype, 0),
        )
