"""Llama-family decoder (Llama 2/3, SmolLM2, Qwen2/2.5, Qwen3) over the paged L1 KV pool.

Follows transformers' ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` / ``Qwen3ForCausalLM`` numerics: RMSNorm in
float32 then cast and scale, rotate-half RoPE from absolute positions, Qwen2 q/k/v biases, Qwen3 per-head q/k
RMSNorm before RoPE, SiLU-gated MLP, tied embeddings. Weights are plain contiguous tensors; q/k/v and
gate/up projections are fused into one matmul each. ``quantization="int8wo"`` / ``"int4wo-<group_size>"``
makes every linear layer (q/k/v, o, gate/up, down and the LM head; not the embedding) int8 / int4 weight-only
(``engine/model/linear.py``), quantized from the checkpoint's float32 weights.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F

from engine.cache.device_pool import DeviceKVPool
from engine.model.attention import AttentionBackend
from engine.model.config import ModelConfig
from engine.model.errors import ModelLoadError
from engine.model.forward_batch import ForwardBatch
from engine.model.linear import check_quantization, lm_head_quantization, make_linear
from engine.model.rotary import apply_rotary, cos_sin, inv_freq

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF ``LlamaRMSNorm``: normalise the last dim in float32, cast to ``x.dtype``, scale by ``weight``."""
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


class DecoderLayer:
    """One pre-norm block: attention (fused qkv, optional biases and q/k norm) and a SiLU-gated MLP."""

    def __init__(
        self, cfg: ModelConfig, layer_id: int, w: dict[str, torch.Tensor | None], quantization: str | None
    ) -> None:
        self.cfg = cfg
        self.layer_id = layer_id
        self.input_norm = w["input_layernorm"]
        self.post_norm = w["post_attention_layernorm"]
        self.qkv = make_linear(w["qkv_w"], w["qkv_b"], quantization)
        self.o_proj = make_linear(w["o_w"], w["o_b"], quantization)
        self.q_norm, self.k_norm = w["q_norm"], w["k_norm"]
        self.gate_up = make_linear(w["gate_up_w"], w["gate_up_b"], quantization)
        self.down = make_linear(w["down_w"], w["down_b"], quantization)
        self.q_size = cfg.num_attention_heads * cfg.head_dim
        self.kv_size = cfg.num_key_value_heads * cfg.head_dim

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: AttentionBackend,
        batch: ForwardBatch,
        kv_pool: DeviceKVPool,
    ) -> torch.Tensor:
        """Hidden states ``(T, hidden)`` in and out; writes this layer's K/V of the new tokens."""
        cfg, tokens = self.cfg, x.shape[0]
        qkv = self.qkv(rms_norm(x, self.input_norm, cfg.rms_norm_eps))
        q, k, v = qkv.split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        q = q.view(tokens, cfg.num_attention_heads, cfg.head_dim)
        k = k.view(tokens, cfg.num_key_value_heads, cfg.head_dim)
        v = v.view(tokens, cfg.num_key_value_heads, cfg.head_dim)
        if self.q_norm is not None:
            q = rms_norm(q, self.q_norm, cfg.rms_norm_eps)
            k = rms_norm(k, self.k_norm, cfg.rms_norm_eps)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if batch.layer_hook is not None:
            batch.layer_hook(self.layer_id)
        out = attn.forward(q, k, v, self.layer_id, batch, kv_pool)
        x = x + self.o_proj(out.reshape(tokens, self.q_size))
        gate_up = self.gate_up(rms_norm(x, self.post_norm, cfg.rms_norm_eps))
        gate, up = gate_up.chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class LlamaForCausalLM:
    """Embedding, decoder layers, final norm and LM head over a ``ForwardBatch`` and a ``DeviceKVPool``."""

    def __init__(
        self,
        cfg: ModelConfig,
        tensors: Mapping[str, torch.Tensor],
        dtype: torch.dtype,
        device: torch.device,
        attn: AttentionBackend,
        source: str = "model",
        quantization: str | None = None,
    ) -> None:
        """``tensors`` uses HF checkpoint names (``model.layers.0.self_attn.q_proj.weight``, ...).

        Raises ``ModelLoadError`` naming ``source`` on a missing, unexpected or mis-shaped tensor, and
        ``QuantizationError`` (a ``ValueError``) for a ``quantization`` not in ``linear.QUANTIZATIONS``, int4
        with a dtype other than bfloat16, or a weight shape the int4 kernel cannot take.
        """
        self.cfg = cfg
        self.attn = attn
        self.dtype = dtype
        self.device = device
        self._inv_freq = inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling).to(device)
        check_quantization(quantization, dtype)
        # quantized layers are quantized from float32, dense ones use the model dtype
        weights = _Weights(cfg, tensors, dtype, device, source, torch.float32 if quantization else dtype)
        vocab_shape = (cfg.vocab_size, cfg.hidden_size)
        embed = weights.take("model.embed_tokens.weight", vocab_shape, weights.linear_dtype)
        self.embed = embed.to(dtype)
        self.layers = [
            DecoderLayer(cfg, i, weights.layer(i), quantization) for i in range(cfg.num_hidden_layers)
        ]
        self.norm = weights.take("model.norm.weight", (cfg.hidden_size,))
        if cfg.tie_word_embeddings:
            weights.discard("lm_head.weight")
            head = embed
        else:
            head = weights.take("lm_head.weight", vocab_shape, weights.linear_dtype)
        self.lm_head = make_linear(head, None, lm_head_quantization(quantization))
        weights.check_all_used()
        # set by ModelRunner: a decode-only batch's forward in one C++ call (engine/model/fused_decode.py)
        self.fused_step: Callable[[ForwardBatch, DeviceKVPool], torch.Tensor | None] | None = None

    def forward(
        self, batch: ForwardBatch, kv_pool: DeviceKVPool, return_all_logits: bool = False
    ) -> torch.Tensor:
        """Float32 logits ``(B, vocab)`` at each sequence's last new token, or ``(T, vocab)`` for all."""
        self.attn.init_forward_metadata(batch)
        if self.fused_step is not None and not return_all_logits and batch.mm_embeds is None:
            logits = self.fused_step(batch, kv_pool)
            if logits is not None:
                return logits
        x = self.embed_tokens(batch)
        cos, sin = cos_sin(batch.positions, self._inv_freq, self.dtype)
        for layer in self.layers:
            x = layer.forward(x, cos, sin, self.attn, batch, kv_pool)
        if not return_all_logits:
            x = x[batch.cu_seqlens[1:] - 1]
        return self.lm_head(rms_norm(x, self.norm, self.cfg.rms_norm_eps)).float()

    def embed_tokens(self, batch: ForwardBatch) -> torch.Tensor:
        """``(T, hidden)`` token embeddings; image rows (``batch.mm_embeds``) take their image embeddings."""
        if batch.mm_embeds is None:
            return F.embedding(batch.input_ids, self.embed)
        rows, embeds = batch.mm_embeds
        ids = batch.input_ids.clone()
        ids[rows.to(ids.device)] = 0  # pad values lie outside the vocabulary
        x = F.embedding(ids, self.embed)
        x[rows.to(x.device)] = embeds.to(device=x.device, dtype=x.dtype)
        return x


class _Weights:
    """Takes HF-named tensors one by one (shape-checked, cast, contiguous) and fuses per-layer projections."""

    def __init__(
        self,
        cfg: ModelConfig,
        tensors: Mapping[str, torch.Tensor],
        dtype: torch.dtype,
        device: torch.device,
        source: str,
        linear_dtype: torch.dtype,
    ) -> None:
        self.cfg, self.dtype, self.device, self.source = cfg, dtype, device, source
        self.linear_dtype = linear_dtype  # dtype of the weights of linear layers (not biases or norms)
        self.remaining = {k: v for k, v in tensors.items() if not k.endswith(_IGNORED_SUFFIXES)}

    def take(self, name: str, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> torch.Tensor:
        if name not in self.remaining:
            raise ModelLoadError(self.source, f"missing tensor {name!r}")
        t = self.remaining.pop(name)
        if tuple(t.shape) != shape:
            raise ModelLoadError(self.source, f"tensor {name!r} has shape {tuple(t.shape)}, expected {shape}")
        return t.to(device=self.device, dtype=dtype or self.dtype).contiguous()

    def discard(self, name: str) -> None:
        self.remaining.pop(name, None)

    def check_all_used(self) -> None:
        if self.remaining:
            names = sorted(self.remaining)
            raise ModelLoadError(
                self.source, f"unexpected tensors {names[:5]}{' ...' if len(names) > 5 else ''}"
            )

    def layer(self, i: int) -> dict[str, torch.Tensor | None]:
        cfg, p = self.cfg, f"model.layers.{i}."
        hidden, inter = cfg.hidden_size, cfg.intermediate_size
        q_out, kv_out = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        attn = p + "self_attn."
        qkv_w = [
            self.take(f"{attn}{n}_proj.weight", (o, hidden), self.linear_dtype)
            for n, o in (("q", q_out), ("k", kv_out), ("v", kv_out))
        ]
        qkv_b = None
        if cfg.attention_bias:
            qkv_b = torch.cat(
                [
                    self.take(f"{attn}{n}_proj.bias", (o,))
                    for n, o in (("q", q_out), ("k", kv_out), ("v", kv_out))
                ]
            )
        mlp = p + "mlp."
        gate_up = [
            self.take(f"{mlp}{n}_proj.weight", (inter, hidden), self.linear_dtype) for n in ("gate", "up")
        ]
        return {
            "input_layernorm": self.take(p + "input_layernorm.weight", (hidden,)),
            "post_attention_layernorm": self.take(p + "post_attention_layernorm.weight", (hidden,)),
            "qkv_w": torch.cat(qkv_w).contiguous(),
            "qkv_b": qkv_b,
            "o_w": self.take(attn + "o_proj.weight", (hidden, q_out), self.linear_dtype),
            "o_b": self.take(attn + "o_proj.bias", (hidden,)) if cfg.o_proj_bias else None,
            "q_norm": self.take(attn + "q_norm.weight", (cfg.head_dim,)) if cfg.qk_norm else None,
            "k_norm": self.take(attn + "k_norm.weight", (cfg.head_dim,)) if cfg.qk_norm else None,
            "gate_up_w": torch.cat(gate_up).contiguous(),
            "gate_up_b": torch.cat([self.take(f"{mlp}{n}_proj.bias", (inter,)) for n in ("gate", "up")])
            if cfg.mlp_bias
            else None,
            "down_w": self.take(mlp + "down_proj.weight", (hidden, inter), self.linear_dtype),
            "down_b": self.take(mlp + "down_proj.bias", (hidden,)) if cfg.mlp_bias else None,
        }
