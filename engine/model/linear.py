"""Linear layers of the decoder: dense (``F.linear``) or int8 weight-only (``--torchao-config int8wo``).

``int8wo`` follows torchao's ``int8_weight_only``: each output row of a weight is quantized symmetrically to
int8 with one scale per row (about ``max|w_row| / 127``, rounded up to a bfloat16); activations stay in
floating point. The matmul is torch's built-in ``torch._weight_int8pack_mm`` (CPU/CUDA), fast only with
bfloat16 activations (float32 ones take a dequantizing path there, measured 5-20x slower), so activations are
cast to bfloat16 for the matmul and the result back to the model dtype. No torchao dependency.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

QUANTIZATIONS = ("int8wo",)


class DenseLinear:
    """``y = x @ weight.T + bias`` with the weight in the model dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight, self.bias = weight, bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class Int8WeightOnlyLinear:
    """Per-output-row symmetric int8 weight; bfloat16 activations in the matmul; bias in the model dtype."""

    act_dtype = torch.bfloat16

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        w = weight.float()
        # the kernel takes scales in the activation dtype: round each one up to a bfloat16 first, so the
        # weight is rounded to multiples of exactly the scale the kernel uses (error <= scale / 2)
        scale = (w.abs().amax(dim=1).clamp(min=1e-30) / 127.0 * (1 + 2**-7)).to(self.act_dtype)
        self.qweight = torch.round(w / scale.float()[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
        self.scales = scale
        self.bias = bias
        self.out_features, self.in_features = weight.shape

    def dequantized(self) -> torch.Tensor:
        """The float32 weight this layer computes with (``qweight * scale``)."""
        return self.qweight.float() * self.scales.float()[:, None]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(self.act_dtype)
        out = torch._weight_int8pack_mm(flat, self.qweight, self.scales).to(x.dtype)
        out = out.view(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias


def check_quantization(quantization: str | None) -> None:
    """Raise ``ValueError`` naming the accepted values unless ``quantization`` is None or one of them."""
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {quantization!r}; choose one of {list(QUANTIZATIONS)}")


def make_linear(
    weight: torch.Tensor, bias: torch.Tensor | None, quantization: str | None
) -> DenseLinear | Int8WeightOnlyLinear:
    """A dense layer, or an int8 weight-only one for ``"int8wo"`` (``ValueError`` for anything else)."""
    check_quantization(quantization)
    if quantization == "int8wo":
        return Int8WeightOnlyLinear(weight, bias)
    return DenseLinear(weight, bias)
