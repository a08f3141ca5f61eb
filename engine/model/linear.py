"""Linear layers of the decoder: dense (``F.linear``), int8 or int4 weight-only (``--torchao-config``).

``int8wo`` follows torchao's ``int8_weight_only``: each output row of a weight is quantized symmetrically to
int8 with one scale per row (about ``max|w_row| / 127``, rounded up to a bfloat16); activations stay in
floating point. The matmul is torch's built-in ``torch._weight_int8pack_mm`` (CPU/CUDA), fast only with
bfloat16 activations (float32 ones take a dequantizing path there, measured 5-20x slower), so activations are
cast to bfloat16 for the matmul and the result back to the model dtype. No torchao dependency.

``int4wo-<group_size>`` (upstream SGLang's values: 32, 64, 128, 256) follows torchao's ``int4_weight_only``
with its CPU layout (``Int4CPULayout``): asymmetric groupwise quantization along the input dim, one bfloat16
scale and zero per ``group_size`` input columns of an output row, ``w ~ (q - 8) * scale + zero``, ``q`` in
0..15 (a group's min and max map to 0 and 15). Torch's maintained CPU kernels pack
(``aten._convert_weight_to_int4pack_for_cpu``) and multiply (``aten._weight_int4pack_mm_for_cpu``). They need
``out_features % 16 == 0`` and ``in_features % group_size == 0`` (SmolLM2's 576 takes 32 and 64, not 128 or
256), and are fast only with bfloat16 activations (their float32 path measured 50-100x slower here), so
int4wo needs ``--dtype bfloat16``. A GGUF Q4_1 block (32 weights, ``d * q + m``, its min at q=0 and max at
q=15 by construction) lands on the same 16-level grid under ``int4wo-32``; only the bfloat16 rounding of
scale and zero (fp16 in the GGUF) moves the weights (docs/model.md).

On the CPU ``use_cpu_kernels`` (``ModelRunner``'s default; ``--disable-cpu-quant-kernels`` keeps torch's
kernels) gives an int8 or int4 layer KVFleet's kernels by the rows of a call: up to ``ext.INT8_MAX_ROWS`` /
``ext.INT4_MAX_ROWS`` (a decode batch) integer weights through ``vpdpbusd`` (``fused/quant_gemv.cpp``,
AVX512-VNNI; activations quantized per group to 16 bits, closer to float32 than torch's bfloat16 cast), and
from ``DENSE_MIN_ROWS`` on (a prefill chunk) a dense bfloat16 matmul over the dequantized weight
(AVX512-BF16); in between, torch's kernel.
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F

from engine.model.config import QUANTIZATIONS


class QuantizationError(ValueError):
    """A ``--torchao-config`` value this model or dtype cannot use (the message names the flag)."""


class DenseLinear:
    """``y = x @ weight.T + bias`` with the weight in the model dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight, self.bias = weight, bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class _WeightOnlyLinear:
    """What int8wo and int4wo share: the kernel each call takes by its number of rows.

    By default torch's weight-only kernel (bfloat16 activations). After ``use_cpu_kernels`` (the runner's
    default on the CPU): up to ``vnni_max_rows`` rows (a decode batch) KVFleet's VNNI kernel on integer
    blocks of the weight, and from ``DENSE_MIN_ROWS`` rows on (a prefill chunk) a dense bfloat16 matmul
    (oneDNN) where the CPU has AVX512-BF16: at 12 rows it matches torch's int4 kernel (8 for int8), at 32 it
    takes 0.4x its time, at 64 0.3x (docs/benchmarks.md). Its weight is a bfloat16 copy, 2 bytes per weight
    on top of the quantized ones: int4's dequantized weight rounded to bfloat16, int8's codes (exact in
    bfloat16) with the row scales applied to the float32 output. Activations of any float dtype. The fused
    decode step (``fused/decode_step.cpp``) dispatches the same way."""

    act_dtype = torch.bfloat16
    DENSE_MIN_ROWS = 12

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.vnni_blocks: torch.Tensor | None = None  # the VNNI kernel's blocks, once taken
        self.vnni_max_rows = 0
        self.dense_weight: torch.Tensor | None = None  # (N, K) bfloat16, once taken
        self.dense_scales: torch.Tensor | None = None  # (N,) float32 output scales of dense_weight, or None
        self._ext: ModuleType | None = None

    def use_cpu_kernels(self, ext: ModuleType) -> bool:
        """Take the extension's kernels where this CPU runs them (AVX512-VNNI for the few-row kernel,
        AVX512-BF16 for the dense one); False (nothing changed) where neither applies."""
        packed = self._vnni_pack(ext) if ext.gemv_supported() else None
        if packed is not None:
            (self.vnni_blocks, self.vnni_max_rows), self._ext = packed, ext
        if ext.bf16_matmul_supported():
            self.dense_weight, self.dense_scales = self._dense_pack()
        return self._ext is not None or self.dense_weight is not None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).contiguous()  # kernels read dense rows (MLA's c_kv: a view)
        rows = flat.size(0)
        if self.vnni_blocks is not None and rows <= self.vnni_max_rows:
            out = self.vnni_mm(flat)
        elif self.dense_weight is not None and rows >= self.DENSE_MIN_ROWS:
            out = F.linear(flat.to(torch.bfloat16), self.dense_weight)
            if self.dense_scales is not None:
                out = out.float() * self.dense_scales
        else:
            out = self.torch_mm(flat.to(self.act_dtype))
        out = out.to(x.dtype).view(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias


class Int8WeightOnlyLinear(_WeightOnlyLinear):
    """Per-output-row symmetric int8 weight; bfloat16 activations in torch's kernel; bias in the model
    dtype."""

    DENSE_MIN_ROWS = 8

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__(weight, bias)
        if self.in_features % 16:  # torch's _weight_int8pack_mm crashes otherwise
            raise QuantizationError(
                f"--torchao-config int8wo: a {self.out_features}x{self.in_features} weight needs in_features "
                "divisible by 16"
            )
        w = weight.float()
        # the kernel takes scales in the activation dtype: round each one up to a bfloat16 first, so the
        # weight is rounded to multiples of exactly the scale the kernel uses (error <= scale / 2)
        scale = (w.abs().amax(dim=1).clamp(min=1e-30) / 127.0 * (1 + 2**-7)).to(self.act_dtype)
        self.qweight = torch.round(w / scale.float()[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
        self.scales = scale

    def dequantized(self) -> torch.Tensor:
        """The float32 weight this layer computes with (``qweight * scale``)."""
        return self.qweight.float() * self.scales.float()[:, None]

    def _dense_pack(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The codes as bfloat16 (|q| <= 127: exact) and the float32 row scales for the output."""
        return self.qweight.to(torch.bfloat16), self.scales.float()

    def _vnni_pack(self, ext: ModuleType) -> tuple[torch.Tensor, int] | None:
        """The VNNI blocks and the most rows they take; None for a shape they cannot hold."""
        if self.out_features % 16 or self.in_features % 32:
            return None
        return ext.int8_pack(self.qweight), ext.INT8_MAX_ROWS

    def vnni_mm(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat`` ``(rows, in_features)`` bfloat16 through the VNNI gemv (rows <= ``vnni_max_rows``; the
        blocks must exist): ``(rows, out_features)``."""
        return self._ext.int8_gemv(flat, self.vnni_blocks, self.scales)

    def torch_mm(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat`` ``(rows, in_features)`` in ``act_dtype`` through torch's int8 matmul: ``(rows,
        out_features)``."""
        return torch._weight_int8pack_mm(flat, self.qweight, self.scales)


class Int4WeightOnlyLinear(_WeightOnlyLinear):
    """Groupwise asymmetric int4 weight (torchao ``Int4CPULayout``); bfloat16 activations in torch's matmul;
    bias in the model dtype. ``QuantizationError`` when the kernel cannot take the weight's shape."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group_size: int) -> None:
        super().__init__(weight, bias)
        if self.in_features % group_size or self.out_features % 16:
            raise QuantizationError(
                f"--torchao-config int4wo-{group_size}: a {self.out_features}x{self.in_features} weight "
                f"needs in_features divisible by {group_size} and out_features by 16"
            )
        self.group_size = group_size
        groups = weight.float().reshape(self.out_features, -1, group_size)
        lo, hi = groups.amin(dim=-1), groups.amax(dim=-1)
        # scale and zero as the kernel reads them (bfloat16), then each weight to its nearest level of that
        # grid
        scale = ((hi - lo) / 15).clamp(min=1e-30).to(self.act_dtype)
        zero = (lo + 8 * scale.float()).to(self.act_dtype)
        q = torch.round((groups - zero.float()[..., None]) / scale.float()[..., None] + 8).clamp(0, 15)
        self.qweight = q.to(torch.uint8).reshape(self.out_features, self.in_features)  # (N, K), 0..15
        # (N, K / 2) uint8, torch's layout
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(self.qweight.to(torch.int32), 1)
        # (K / group_size, N, 2): scale and zero per group, the kernel's layout
        self.scales_and_zeros = torch.stack([scale.t(), zero.t()], dim=-1).contiguous()

    def dequantized(self) -> torch.Tensor:
        """The float32 weight this layer computes with (``(q - 8) * scale + zero`` per group)."""
        sz = self.scales_and_zeros.float().transpose(0, 1)  # (N, groups, 2)
        q = self.qweight.float().reshape(self.out_features, -1, self.group_size)
        return ((q - 8) * sz[..., :1] + sz[..., 1:]).reshape(self.out_features, self.in_features)

    def _dense_pack(self) -> tuple[torch.Tensor, None]:
        """The dequantized weight rounded to bfloat16 (no output scales)."""
        return self.dequantized().to(torch.bfloat16), None

    def _vnni_pack(self, ext: ModuleType) -> tuple[torch.Tensor, int]:
        """The VNNI blocks (every shape this layer accepts fits them) and the most rows they take."""
        return ext.int4_pack(self.qweight, self.scales_and_zeros, self.group_size), ext.INT4_MAX_ROWS

    def vnni_mm(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat`` ``(rows, in_features)`` bfloat16 through the VNNI gemv: ``(rows, out_features)``."""
        return self._ext.int4_gemv(flat, self.vnni_blocks, self.out_features, self.group_size)

    def torch_mm(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat`` ``(rows, in_features)`` bfloat16 through torch's int4 matmul: ``(rows, out_features)``."""
        mm = torch.ops.aten._weight_int4pack_mm_for_cpu
        return mm(flat, self.packed, self.group_size, self.scales_and_zeros)


def check_quantization(quantization: str | None, dtype: torch.dtype | None = None) -> None:
    """``QuantizationError`` (a ``ValueError`` naming ``--torchao-config``) unless ``quantization`` is None or
    one of ``QUANTIZATIONS``, or for ``int4wo-*`` with a ``dtype`` other than bfloat16 (when given)."""
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise QuantizationError(
            f"--torchao-config: unknown quantization {quantization!r}; choose one of {list(QUANTIZATIONS)}"
        )
    if quantization and quantization.startswith("int4wo") and dtype not in (None, torch.bfloat16):
        raise QuantizationError(
            f"--torchao-config {quantization} needs --dtype bfloat16 (torch's int4 CPU kernel is fast only "
            f"with bfloat16 activations), got {dtype}"
        )


def lm_head_quantization(quantization: str | None) -> str | None:
    """The LM head's quantization under ``quantization``: int8 for ``int4wo-*`` (a GGUF keeps its token
    embedding, which SmolLM2 ties to the head, in Q8_0: re-quantizing it to int4 cost 9 points of top-1
    agreement, docs/model.md), else ``quantization`` itself."""
    return "int8wo" if quantization and quantization.startswith("int4wo") else quantization


def make_linear(
    weight: torch.Tensor, bias: torch.Tensor | None, quantization: str | None
) -> DenseLinear | Int8WeightOnlyLinear | Int4WeightOnlyLinear:
    """A dense layer, an int8 weight-only one for ``"int8wo"``, an int4 one for ``"int4wo-<group_size>"``
    (``QuantizationError`` for anything else or a shape the int4 kernel cannot take)."""
    check_quantization(quantization)
    if quantization == "int8wo":
        return Int8WeightOnlyLinear(weight, bias)
    if quantization:
        return Int4WeightOnlyLinear(weight, bias, int(quantization.removeprefix("int4wo-")))
    return DenseLinear(weight, bias)
