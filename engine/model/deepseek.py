"""DeepSeek-V2/V3 decoder (multi-head latent attention) over the paged L1 KV pool.

Follows transformers' ``DeepseekV2ForCausalLM`` / ``DeepseekV3ForCausalLM`` numerics. Attention
(``DeepseekV3Attention``): q from ``q_proj`` or the low-rank ``q_a_proj -> q_a_layernorm -> q_b_proj``; the
latent from ``kv_a_proj_with_mqa``, split into ``c_kv`` (normalised by ``kv_a_layernorm``) and ``k_pe``; RoPE
on ``q_pe`` / ``k_pe`` (DeepSeek's interleaved pairs, or rotate-half when a V3 config sets
``rope_interleave: false``); keys and values expanded from the cached latent by ``kv_b_proj``
(``engine/model/attention/mla.py``); softmax scale ``qk_head_dim ** -0.5`` (yarn: see below). The latent
norms use eps 1e-6 as transformers does. Embedding, final norm, LM head and the SiLU-gated dense MLP are
the Llama family's (``engine/model/llama.py``, which this model extends); layers from
``first_k_dense_replace`` on replace the dense MLP by routed + shared experts (``engine/model/moe.py``: V2's
softmax greedy / group-limited top-k, V3's sigmoid + ``e_score_correction_bias`` grouped top-k).
Interleaved RoPE returns the rotated pairs de-interleaved (transformers V3's layout; V2 keeps them
interleaved): q and k get the same permutation, so
their dot products, hence the outputs, are unchanged.

Tensor parallelism splits the heads (``q_proj`` / ``q_b_proj`` and ``kv_b_proj`` rows, ``o_proj`` columns,
all-reduced) and the MLP as the Llama family does; the latent path is whole on every rank, so each rank
computes and caches the same latent (upstream's MLA TP). Yarn RoPE (the released checkpoints') scales the
frequencies, cos / sin (``attention_factor``) and the softmax scale (``mla_softmax_scale``) as transformers.
"""

from __future__ import annotations

import torch

from engine.cache.device_pool import DeviceKVPool
from engine.distributed import TPGroup, TPShard, single_rank
from engine.model.attention.mla import MLAAttention
from engine.model.config import ModelConfig
from engine.model.forward_batch import ForwardBatch
from engine.model.linear import make_linear
from engine.model.llama import MLP, LlamaForCausalLM, _Weights, rms_norm
from engine.model.rotary import apply_rotary, yarn_mscale

LATENT_NORM_EPS = 1e-6  # transformers' DeepseekV2/V3RMSNorm default, used for q_a_layernorm / kv_a_layernorm


def apply_rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs ``(x[2i], x[2i+1])`` of ``x`` ``(T, heads, d)`` by angle i; returns the rotated evens
    then the rotated odds (transformers' ``apply_rotary_pos_emb_interleave``). ``cos``/``sin`` are
    ``cos_sin``'s ``(T, 1, d)`` (the angles twice)."""
    half = x.shape[-1] // 2
    cos, sin = cos[..., :half], sin[..., :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def mla_unsupported(cfg: ModelConfig, attention_backend: str) -> str | None:
    """Why an MLA model cannot run with these flags (the message names the flag), or None."""
    if not cfg.mla:
        return None
    if attention_backend != "torch":
        return (
            f"--attention-backend {attention_backend}: {cfg.architecture} (MLA) runs its own latent "
            "attention in torch in this release; use --attention-backend torch"
        )
    return None


def mla_softmax_scale(cfg: ModelConfig) -> float:
    """``qk_head_dim ** -0.5``, times ``mscale(factor, mscale_all_dim) ** 2`` under yarn RoPE with
    ``mscale_all_dim`` (transformers' ``yarn_apply_mscale``)."""
    scale = cfg.qk_head_dim**-0.5
    scaling = cfg.rope_scaling or {}
    if scaling.get("rope_type", "default") != "default" and scaling.get("mscale_all_dim"):
        factor = (
            scaling.get("factor") or cfg.max_position_embeddings / scaling["original_max_position_embeddings"]
        )
        m = yarn_mscale(float(factor), float(scaling["mscale_all_dim"]))
        scale *= m * m
    return scale


class MLADecoderLayer:
    """One pre-norm block: MLA attention over the cached latent, then the dense SiLU-gated MLP."""

    def __init__(
        self,
        cfg: ModelConfig,
        layer_id: int,
        w: dict,
        quantization: str | None,
        tp: TPGroup | None = None,
    ) -> None:
        self.cfg, self.layer_id = cfg, layer_id
        self.tp = tp or single_rank()
        self.num_heads = cfg.num_attention_heads // self.tp.size  # this rank's heads (w is their shard)
        split = self.tp.size > 1  # row-parallel o: its bias added once, after the all-reduce
        self.o_bias = w["o_proj_b"] if split else None
        self.input_norm = w["input_layernorm"]
        self.post_norm = w["post_attention_layernorm"]
        if cfg.q_lora_rank is None:
            self.q_proj = make_linear(w["q_proj"], None, quantization)
        else:
            self.q_a = make_linear(w["q_a_proj"], w["q_a_proj_b"], quantization)
            self.q_a_norm = w["q_a_layernorm"]
            self.q_b = make_linear(w["q_b_proj"], None, quantization)
        self.kv_a = make_linear(w["kv_a_proj"], w["kv_a_proj_b"], quantization)
        self.kv_a_norm = w["kv_a_layernorm"]
        self.kv_b = make_linear(w["kv_b_proj"], None, quantization)
        self.o_proj = make_linear(w["o_proj"], None if split else w["o_proj_b"], quantization)
        self.mlp = MLP(cfg, w, quantization, self.tp)
        self.rotate = apply_rotary_interleaved if cfg.rope_interleave else apply_rotary
        # kv_b_proj per head for decode's weight absorption: W_UK (H, nope, rank), W_UV (H, v, rank)
        kv_b = w["kv_b_proj"].view(self.num_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
        if quantization:  # absorb what the quantized layer computes with, in the model's dtype
            kv_b = self.kv_b.dequantized().view(kv_b.shape).to(w["input_layernorm"].dtype)
        w_uk, w_uv = kv_b.split((cfg.qk_nope_head_dim, cfg.v_head_dim), dim=1)
        self.absorbed = (w_uk.contiguous(), w_uv.contiguous())

    def linears(self) -> list:
        """The layer's linear layers (``linear.py``'s), for a caller that picks their CPU kernels."""
        q = [self.q_proj] if self.cfg.q_lora_rank is None else [self.q_a, self.q_b]
        return [*q, self.kv_a, self.kv_b, self.o_proj, *self.mlp.linears()]

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: MLAAttention,
        batch: ForwardBatch,
        kv_pool: DeviceKVPool,
    ) -> torch.Tensor:
        """Hidden states ``(T, hidden)`` in and out; writes this layer's latent of the new tokens."""
        cfg, tokens = self.cfg, x.shape[0]
        h = rms_norm(x, self.input_norm, cfg.rms_norm_eps)
        if cfg.q_lora_rank is None:
            q = self.q_proj(h)
        else:
            q = self.q_b(rms_norm(self.q_a(h), self.q_a_norm, LATENT_NORM_EPS))
        q = q.view(tokens, self.num_heads, cfg.qk_head_dim)
        q_nope, q_pe = q.split((cfg.qk_nope_head_dim, cfg.head_dim), dim=-1)
        c_kv, k_pe = self.kv_a(h).split((cfg.kv_lora_rank, cfg.head_dim), dim=-1)
        c_kv = rms_norm(c_kv, self.kv_a_norm, LATENT_NORM_EPS)
        q = torch.cat((q_nope, self.rotate(q_pe, cos, sin)), dim=-1)
        k_pe = self.rotate(k_pe[:, None, :], cos, sin)[:, 0]
        if batch.layer_hook is not None:
            batch.layer_hook(self.layer_id)
        latent = torch.cat((c_kv, k_pe), dim=-1)
        out = attn.forward(q, latent, self.layer_id, batch, kv_pool, self.kv_b, self.absorbed)
        x = x + self.tp.row_parallel(
            self.o_proj(out.reshape(tokens, self.num_heads * cfg.v_head_dim)), self.o_bias
        )
        return x + self.mlp(rms_norm(x, self.post_norm, cfg.rms_norm_eps))


class DeepseekForCausalLM(LlamaForCausalLM):
    """``DeepseekV2ForCausalLM`` / ``DeepseekV3ForCausalLM`` (this rank's shard at tp > 1); ``attn`` is an
    ``MLAAttention``. Same constructor contract and errors as ``LlamaForCausalLM``."""

    def _make_layers(self, weights: _Weights, quantization: str | None) -> list:
        return [
            MLADecoderLayer(self.cfg, i, _mla_layer(weights, self.cfg, i, self.shard), quantization, self.tp)
            for i in range(self.cfg.num_hidden_layers)
        ]


def _mla_layer(weights: _Weights, cfg: ModelConfig, i: int, shard: TPShard) -> dict:
    """Layer ``i``'s tensors by transformers' DeepSeek names, shape-checked (``ModelLoadError`` otherwise),
    cut to ``shard``'s part (:func:`_shard_mla_layer`)."""
    p, lin = f"model.layers.{i}.", weights.linear_dtype
    attn = p + "self_attn."
    hidden, heads = cfg.hidden_size, cfg.num_attention_heads
    rank, rope, bias = cfg.kv_lora_rank, cfg.head_dim, cfg.attention_bias
    q_out = heads * cfg.qk_head_dim
    w: dict[str, torch.Tensor | None] = {
        "input_layernorm": weights.take(p + "input_layernorm.weight", (hidden,)),
        "post_attention_layernorm": weights.take(p + "post_attention_layernorm.weight", (hidden,)),
        "kv_a_proj": weights.take(attn + "kv_a_proj_with_mqa.weight", (rank + rope, hidden), lin),
        "kv_a_proj_b": weights.take(attn + "kv_a_proj_with_mqa.bias", (rank + rope,)) if bias else None,
        "kv_a_layernorm": weights.take(attn + "kv_a_layernorm.weight", (rank,)),
        "kv_b_proj": weights.take(
            attn + "kv_b_proj.weight", (heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), rank), lin
        ),
        "o_proj": weights.take(attn + "o_proj.weight", (hidden, heads * cfg.v_head_dim), lin),
        "o_proj_b": weights.take(attn + "o_proj.bias", (hidden,)) if bias else None,
        **weights.mlp(i),
    }
    if cfg.q_lora_rank is None:
        w["q_proj"] = weights.take(attn + "q_proj.weight", (q_out, hidden), lin)
    else:
        q_rank = cfg.q_lora_rank
        w["q_a_proj"] = weights.take(attn + "q_a_proj.weight", (q_rank, hidden), lin)
        w["q_a_proj_b"] = weights.take(attn + "q_a_proj.bias", (q_rank,)) if bias else None
        w["q_a_layernorm"] = weights.take(attn + "q_a_layernorm.weight", (q_rank,))
        w["q_b_proj"] = weights.take(attn + "q_b_proj.weight", (q_out, q_rank), lin)
    return _shard_mla_layer(w, cfg, shard) if shard.size > 1 else w


def _shard_mla_layer(w: dict, cfg: ModelConfig, shard: TPShard) -> dict:
    """This rank's part of one MLA layer: its heads' rows of ``q_proj`` / ``q_b_proj`` and ``kv_b_proj``
    (column-parallel) and their columns of ``o_proj`` (row-parallel); the latent path (``q_a_proj``,
    ``kv_a_proj_with_mqa``, the norms) whole, so every rank computes and caches the same latent (the MLP
    was cut when taken: ``_Weights.mlp``)."""
    heads = shard.num_heads

    def rows(per_head: int) -> slice:
        return slice(shard.rank * heads * per_head, (shard.rank + 1) * heads * per_head)

    out = dict(w)
    q = "q_proj" if cfg.q_lora_rank is None else "q_b_proj"
    out[q] = w[q][rows(cfg.qk_head_dim)].contiguous()
    out["kv_b_proj"] = w["kv_b_proj"][rows(cfg.qk_nope_head_dim + cfg.v_head_dim)].contiguous()
    out["o_proj"] = w["o_proj"][:, rows(cfg.v_head_dim)].contiguous()
    return out
