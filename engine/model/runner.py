"""ModelRunner: loads a model and its tokenizer and runs forward passes over the L1 KV pool.

The scheduler builds a ``ForwardBatch`` per step, a ``DeviceKVPool`` from ``kv_pool_spec()`` once, and calls
``forward``; sampling is the scheduler's job.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.cache.device_pool import DeviceKVPool
from engine.distributed import TPGroup, TPShard, single_rank
from engine.model.attention import AttentionBackend, get_attention_backend
from engine.model.attention.mla import MLAAttention
from engine.model.compute_mode import resolve_compute
from engine.model.config import ModelConfig
from engine.model.deepseek import DeepseekForCausalLM, mla_softmax_scale, mla_unsupported
from engine.model.extension import ExtensionUnavailable, load_extension
from engine.model.forward_batch import ForwardBatch
from engine.model.fused_decode import FusedDecodeStep
from engine.model.fused_decode import supports as fused_decode_supports
from engine.model.linear import check_quantization
from engine.model.llama import LlamaForCausalLM
from engine.model.loader import Checkpoint, load_checkpoint
from engine.model.tokenizer import Tokenizer
from engine.model.vlm.config import VLMConfig
from engine.model.vlm.towers import VisionTower, make_vision_encoder

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {sorted(DTYPES)}")
    return DTYPES[dtype]


@dataclass(frozen=True)
class KVPoolSpec:
    """Arguments of ``DeviceKVPool`` fixed by the model: ``DeviceKVPool(size, page_size, **vars(spec))``."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device


class ModelRunner:
    """Loaded model + tokenizer on one device.

    ``dtype``: "float32" | "bfloat16" | "float16" or a ``torch.dtype``, or "auto": chosen with the
    quantization from what the checkpoint stores (``engine/model/compute_mode.py``: on a CPU a Q4_1 GGUF
    computes in bfloat16 on int4wo-32 weights, other models in float32); ``device``: "cpu" | "cuda[:n]";
    ``attention_backend``: a name registered in engine/model/attention; ``quantization``: None,
    ``"int8wo"`` or ``"int4wo-<group_size>"`` (weight-only linear layers, ``engine/model/linear.py``; int4
    needs bfloat16); ``fused_decode``: run decode-only batches through the C++ decode step
    (``engine/model/fused_decode.py``; float32 activations between the matmuls) where it applies (torch
    backend on the CPU, float32 or bfloat16) and builds; where it cannot be built a warning says why and the
    Python path decodes; ``cpu_quant_kernels``: int8 / int4 weight-only layers on the CPU take KVFleet's
    kernels by rows (``linear.py``: VNNI for decode batches, dense bfloat16 for prefill chunks) where the CPU
    runs them, torch's weight-only kernels otherwise. A LLaVA checkpoint also gets its vision tower and
    projector (``vision``, ``engine/model/vlm``) unless ``language_only`` (embeddings come from an encoder
    worker); ``vlm`` holds its vision settings (None for a text model). ``tp``: this rank's tensor-parallel
    group (default one rank): the model keeps this rank's shard, the KV pool holds its KV heads, and decode
    runs on the Python path (the fused C++ step has no all-reduce between its layers).
    Raises ``ModelLoadError`` for a bad model path and ``ValueError`` for an unknown dtype, backend or
    quantization (``QuantizationError`` for a quantization this dtype or model cannot use).
    """

    def __init__(
        self,
        model_path: str | Path,
        dtype: str | torch.dtype = "float32",
        device: str | torch.device = "cpu",
        attention_backend: str = "torch",
        quantization: str | None = None,
        fused_decode: bool = True,
        cpu_quant_kernels: bool = True,
        language_only: bool = False,
        tp: TPGroup | None = None,
    ) -> None:
        self.language_only = language_only
        backend_cls = get_attention_backend(attention_backend)  # bad names fail before the slow load
        self.attention_backend = attention_backend
        self.device = torch.device(device)
        self.tp = tp or single_rank()
        check_quantization(quantization, None if dtype == "auto" else _parse_dtype(dtype))
        checkpoint = load_checkpoint(model_path)
        self._set_compute(checkpoint, dtype, quantization)
        self._build(checkpoint, backend_cls, fused_decode, cpu_quant_kernels)

    @classmethod
    def from_checkpoint(
        cls,
        checkpoint: Checkpoint,
        dtype: str | torch.dtype = "float32",
        device: str | torch.device = "cpu",
        attention_backend: str = "torch",
        quantization: str | None = None,
        fused_decode: bool = True,
        cpu_quant_kernels: bool = True,
        language_only: bool = False,
        tp: TPGroup | None = None,
    ) -> ModelRunner:
        """A runner over an already loaded ``Checkpoint`` (e.g. one load, several dtypes)."""
        runner = cls.__new__(cls)
        runner.language_only = language_only
        runner.device = torch.device(device)
        runner._set_compute(checkpoint, dtype, quantization)
        runner.tp = tp or single_rank()
        runner.attention_backend = attention_backend
        runner._build(checkpoint, get_attention_backend(attention_backend), fused_decode, cpu_quant_kernels)
        return runner

    def _set_compute(
        self, checkpoint: Checkpoint, dtype: str | torch.dtype, quantization: str | None
    ) -> None:
        """``dtype`` and ``quantization``, "auto" resolved from what ``checkpoint`` stores
        (``engine/model/compute_mode.py``; a log line says the choice); raises as the constructor says."""
        if dtype == "auto":
            dtype, quantization = resolve_compute("auto", quantization, self.device.type, checkpoint)
            logger.info("--dtype auto: %s%s", dtype, f" with {quantization} weights" if quantization else "")
        self.dtype = _parse_dtype(dtype)
        check_quantization(quantization, self.dtype)
        self.quantization = quantization

    def _build(
        self,
        checkpoint: Checkpoint,
        backend_cls: type[AttentionBackend],
        fused_decode: bool,
        cpu_quant_kernels: bool,
    ) -> None:
        self.model_path = checkpoint.path
        self.config: ModelConfig = checkpoint.config
        self.tokenizer: Tokenizer = checkpoint.tokenizer
        self.vlm: VLMConfig | None = checkpoint.vlm
        self.vision: VisionTower | None = None
        if self.vlm is not None and not self.language_only:
            self.vision = make_vision_encoder(checkpoint, self.dtype, self.device)
        cfg = self.config
        why = mla_unsupported(cfg, self.attention_backend)
        if why:
            raise ValueError(why)
        self.shard = TPShard(cfg, self.tp.rank, self.tp.size)  # TPConfigError when the heads do not divide
        heads, kv_heads = self.shard.num_heads, self.shard.num_kv_heads
        attn: AttentionBackend | MLAAttention
        if cfg.mla:
            dims = (cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.head_dim, cfg.v_head_dim)
            attn = MLAAttention(heads, *dims, mla_softmax_scale(cfg))
        else:
            attn = backend_cls(heads, kv_heads, cfg.head_dim, cfg.head_dim**-0.5)
        model_cls = DeepseekForCausalLM if cfg.mla else LlamaForCausalLM
        self.model = model_cls(
            cfg,
            checkpoint.tensors,
            self.dtype,
            self.device,
            attn,
            checkpoint.path,
            self.quantization,
            self.tp,
        )
        self.cpu_quant_kernels = False
        if cpu_quant_kernels and self.device.type == "cpu" and self.quantization is not None:
            self.cpu_quant_kernels = self._use_cpu_quant_kernels()
        if fused_decode and self.tp.size > 1:
            logger.info(
                "tp %d: decoding on the Python path (the fused decode step is one rank's)", self.tp.size
            )
        elif fused_decode and (cfg.mla or cfg.moe):
            logger.info(
                "%s: decoding on the Python path (the fused decode step is dense GQA's)", cfg.architecture
            )
        elif fused_decode and fused_decode_supports(attn, self.device, self.dtype):
            try:
                self.model.fused_step = FusedDecodeStep(self.model)
            except ExtensionUnavailable as exc:
                logger.warning("%s; decoding on the Python path (--disable-fused-decode: no attempt)", exc)

    def _use_cpu_quant_kernels(self) -> bool:
        """Give every int8 / int4 layer the extension's kernels; False (torch's kernels, and a warning or an
        info line saying why) where the extension cannot be built or the CPU runs none of them."""
        try:
            ext = load_extension()
        except ExtensionUnavailable as exc:
            logger.warning("%s; torch's weight-only kernels (--disable-cpu-quant-kernels: no attempt)", exc)
            return False
        if not (ext.gemv_supported() or ext.bf16_matmul_supported()):
            logger.info("neither AVX512-VNNI nor AVX512-BF16 on this CPU: torch's weight-only kernels")
            return False
        linears = [self.model.lm_head]
        for layer in self.model.layers:
            linears += layer.linears()
        return any([x.use_cpu_kernels(ext) for x in linears])

    @property
    def fused_decode(self) -> bool:
        """Decode-only batches run through the C++ decode step."""
        return self.model.fused_step is not None

    def kv_pool_spec(self) -> KVPoolSpec:
        """Layers, KV heads (this rank's), head dim, dtype and device of the KV pool this model writes.

        MLA: one head whose K and V rows are the two halves of the latent (``ModelConfig.kv_cache_head_dim``).
        """
        cfg = self.config
        heads = cfg.kv_cache_heads if cfg.mla else self.shard.num_kv_heads
        return KVPoolSpec(cfg.num_hidden_layers, heads, cfg.kv_cache_head_dim, self.dtype, self.device)

    def forward(
        self, batch: ForwardBatch, kv_pool: DeviceKVPool, return_all_logits: bool = False
    ) -> torch.Tensor:
        """Float32 logits ``(num_seqs, vocab)`` for each sequence's last new token (``(T, vocab)`` if
        ``return_all_logits``); writes the K/V of every new token to ``batch.out_cache_loc``."""
        with torch.inference_mode():
            return self.model.forward(batch, kv_pool, return_all_logits)
