"""Llama-family decoder (Llama 2/3, SmolLM2, Qwen2/2.5, Qwen3, Qwen3-MoE) over the paged L1 KV pool.

Follows transformers' ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` / ``Qwen3ForCausalLM`` numerics: RMSNorm in
float32 then cast and scale, rotate-half RoPE from absolute positions, Qwen2 q/k/v biases, Qwen3 per-head q/k
RMSNorm before RoPE, SiLU-gated MLP (Qwen3-MoE: routed experts in its MoE layers, ``engine/model/moe.py``),
tied embeddings. Weights are plain contiguous tensors; q/k/v and
gate/up projections are fused into one matmul each. ``quantization="int8wo"`` / ``"int4wo-<group_size>"``
makes every linear layer (q/k/v, o, gate/up, down and the LM head; not the embedding) int8 / int4 weight-only
(``engine/model/linear.py``), quantized from the checkpoint's float32 weights.

Tensor parallelism (``tp``: a ``TPGroup`` of more than one rank): q/k/v and gate/up are column-parallel (a
rank computes its heads and its intermediate columns), o and down are row-parallel (a partial sum, all-reduced
before their bias), the embedding and the LM head are vocab-parallel (rows padded to a multiple of tp; the
embedding's partial lookups are all-reduced, the LM head's logits all-gathered). Which rows and columns a
rank owns: ``engine/distributed/sharding.py``. A quantized layer is quantized from its own shard.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F

from engine.cache.device_pool import DeviceKVPool
from engine.distributed import TPGroup, TPShard, single_rank
from engine.model.attention import AttentionBackend
from engine.model.config import ModelConfig
from engine.model.errors import ModelLoadError
from engine.model.forward_batch import ForwardBatch
from engine.model.linear import check_quantization, lm_head_quantization, make_linear
from engine.model.moe import MoE, moe_weights
from engine.model.rotary import apply_rotary, attention_factor, cos_sin, inv_freq, mrope_cos_sin

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_DENSE_MLP = ("gate_up_w", "gate_up_b", "down_w", "down_b")  # Weights.dense_mlp's keys


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF ``LlamaRMSNorm``: normalise the last dim in float32, cast to ``x.dtype``, scale by ``weight``."""
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


class MLP:
    """A layer's feed-forward, shared by the Llama family's and DeepSeek's layers: the SiLU-gated dense MLP
    (``gate_up``, ``down``) or, where ``w["moe"]`` holds experts, ``moe`` (``engine/model/moe.py``).

    ``w`` holds ``moe`` and the ``_DENSE_MLP`` tensors (``_Weights.mlp``: None in an MoE layer), this rank's
    shard. Under tensor parallelism ``down`` (and every expert's down) is row-parallel: its partial sums are
    all-reduced, then the bias is added once."""

    def __init__(self, cfg: ModelConfig, w: Mapping, quantization: str | None, tp: TPGroup) -> None:
        self.tp = tp
        split = tp.size > 1
        self.moe = None if w["moe"] is None else MoE(cfg, w["moe"], quantization)
        self.down_bias = w["down_b"] if split else None
        if self.moe is None:
            self.gate_up = make_linear(w["gate_up_w"], w["gate_up_b"], quantization)
            self.down = make_linear(w["down_w"], None if split else w["down_b"], quantization)

    def linears(self) -> list:
        """Its linear layers (``linear.py``'s), for a caller that picks their CPU kernels."""
        return self.moe.linears() if self.moe is not None else [self.gate_up, self.down]

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        """The normalised hidden states ``h`` ``(T, hidden)`` -> the MLP's output ``(T, hidden)`` (all-reduced
        over the ranks), to add to the residual."""
        if self.moe is not None:  # every expert's columns split like the dense MLP's: all-reduced
            return self.tp.row_parallel(self.moe(h), None)
        gate, up = self.gate_up(h).chunk(2, dim=-1)
        return self.tp.row_parallel(self.down(F.silu(gate) * up), self.down_bias)


class DecoderLayer:
    """One pre-norm block: attention (fused qkv, optional biases and q/k norm) and a SiLU-gated MLP."""

    def __init__(
        self,
        cfg: ModelConfig,
        layer_id: int,
        w: dict[str, torch.Tensor | None],
        quantization: str | None,
        tp: TPGroup | None = None,
    ) -> None:
        self.cfg = cfg
        self.layer_id = layer_id
        self.tp = tp or single_rank()
        shard = TPShard(cfg, self.tp.rank, self.tp.size)
        self.num_heads, self.num_kv_heads = shard.num_heads, shard.num_kv_heads
        self.input_norm = w["input_layernorm"]
        self.post_norm = w["post_attention_layernorm"]
        self.qkv = make_linear(w["qkv_w"], w["qkv_b"], quantization)
        # row-parallel: each rank's partial sums are all-reduced, then the bias is added once
        split = self.tp.size > 1
        self.o_bias = w["o_b"] if split else None
        self.o_proj = make_linear(w["o_w"], None if split else w["o_b"], quantization)
        self.q_norm, self.k_norm = w["q_norm"], w["k_norm"]
        self.mlp = MLP(cfg, w, quantization, self.tp)
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim

    def linears(self) -> list:
        """The layer's linear layers (``linear.py``'s), for a caller that picks their CPU kernels."""
        return [self.qkv, self.o_proj, *self.mlp.linears()]

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
        q = q.view(tokens, self.num_heads, cfg.head_dim)
        k = k.view(tokens, self.num_kv_heads, cfg.head_dim)
        v = v.view(tokens, self.num_kv_heads, cfg.head_dim)
        if self.q_norm is not None:
            q = rms_norm(q, self.q_norm, cfg.rms_norm_eps)
            k = rms_norm(k, self.k_norm, cfg.rms_norm_eps)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if batch.layer_hook is not None:
            batch.layer_hook(self.layer_id)
        out = attn.forward(q, k, v, self.layer_id, batch, kv_pool)
        x = x + self.tp.row_parallel(self.o_proj(out.reshape(tokens, self.q_size)), self.o_bias)
        return x + self.mlp(rms_norm(x, self.post_norm, cfg.rms_norm_eps))


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
        tp: TPGroup | None = None,
    ) -> None:
        """``tensors`` uses HF checkpoint names (``model.layers.0.self_attn.q_proj.weight``, ...); ``tp``:
        this rank's group (default one rank), whose shard of every weight is kept (``TPConfigError``, a
        ``ValueError``, when the head counts do not divide).

        Raises ``ModelLoadError`` naming ``source`` on a missing, unexpected or mis-shaped tensor, and
        ``QuantizationError`` (a ``ValueError``) for a ``quantization`` not in ``linear.QUANTIZATIONS``, int4
        with a dtype other than bfloat16, or a weight shape the int4 kernel cannot take.
        """
        self.cfg = cfg
        self.attn = attn
        self.dtype = dtype
        self.device = device
        self.tp = tp or single_rank()
        self.shard = TPShard(cfg, self.tp.rank, self.tp.size)
        self.rope_inv_freq = inv_freq(
            cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings
        ).to(device)
        self._rope_scale = attention_factor(cfg.rope_scaling, cfg.max_position_embeddings)
        check_quantization(quantization, dtype)
        # quantized layers are quantized from float32, dense ones use the model dtype
        weights = _Weights(
            cfg, tensors, dtype, device, source, torch.float32 if quantization else dtype, self.shard
        )
        vocab_shape = (cfg.vocab_size, cfg.hidden_size)
        embed = weights.vocab_rows(
            weights.take("model.embed_tokens.weight", vocab_shape, weights.linear_dtype)
        )
        self.embed = embed.to(dtype)
        self.layers = self._make_layers(weights, quantization)
        self.norm = weights.take("model.norm.weight", (cfg.hidden_size,))
        if cfg.tie_word_embeddings:
            weights.discard("lm_head.weight")
            head = embed
        else:
            head = weights.vocab_rows(weights.take("lm_head.weight", vocab_shape, weights.linear_dtype))
        self.lm_head = make_linear(head, None, lm_head_quantization(quantization))
        weights.check_all_used()
        # set by ModelRunner: a decode-only batch's forward in one C++ call (engine/model/fused_decode.py)
        self.fused_step: Callable[[ForwardBatch, DeviceKVPool], torch.Tensor | None] | None = None

    def _make_layers(self, weights: _Weights, quantization: str | None) -> list:
        """The decoder layers, built from (and taking their tensors out of) ``weights``."""
        return [
            DecoderLayer(self.cfg, i, weights.layer(i), quantization, self.tp)
            for i in range(self.cfg.num_hidden_layers)
        ]

    def forward(
        self, batch: ForwardBatch, kv_pool: DeviceKVPool, return_all_logits: bool = False
    ) -> torch.Tensor:
        """Float32 logits ``(B, vocab)`` at each sequence's last new token, or ``(T, vocab)`` for all."""
        self.attn.init_forward_metadata(batch)
        mm = batch.mm_embeds is not None or batch.mrope_positions is not None
        if self.fused_step is not None and not return_all_logits and not mm:
            logits = self.fused_step(batch, kv_pool)
            if logits is not None:
                return logits
        x = self.embed_tokens(batch)
        if batch.mrope_positions is not None:
            mrope = batch.mrope_positions.to(self.device)
            cfg = self.cfg
            cos, sin = mrope_cos_sin(
                mrope, self.rope_inv_freq, cfg.mrope_section, self.dtype, cfg.mrope_interleaved
            )
        else:
            cos, sin = cos_sin(batch.positions, self.rope_inv_freq, self.dtype, self._rope_scale)
        deepstack = self._deepstack(batch)
        for layer in self.layers:
            x = layer.forward(x, cos, sin, self.attn, batch, kv_pool)
            if deepstack is not None and layer.layer_id < deepstack[1].shape[1]:
                x[deepstack[0]] += deepstack[1][:, layer.layer_id]
        if not return_all_logits:
            x = x[batch.cu_seqlens[1:] - 1]
        logits = self.lm_head(rms_norm(x, self.norm, self.cfg.rms_norm_eps)).float()
        if self.tp.size > 1:  # vocab-parallel: every rank gets the whole row (padding cut off)
            logits = self.tp.all_gather(logits)[:, : self.cfg.vocab_size]
        return logits

    def _deepstack(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Image rows and their deepstack features ``(M, k, hidden)``, added after layers ``0 .. k - 1``
        (Qwen3-VL), or None when the image embeddings carry none."""
        if batch.mm_embeds is None or batch.mm_embeds[1].shape[1] == self.cfg.hidden_size:
            return None
        rows, embeds = batch.mm_embeds
        hidden = self.cfg.hidden_size
        deep = embeds[:, hidden:].reshape(embeds.shape[0], -1, hidden)
        return rows.to(self.device), deep.to(device=self.device, dtype=self.dtype)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Embeddings ``(T, hidden)`` of ``ids`` ``(T,)``; vocab-parallel: rows outside this rank's range
        are zero here and come from their owner through the all-reduce."""
        if self.tp.size == 1:
            return F.embedding(ids, self.embed)
        start = self.tp.rank * self.shard.vocab_per_rank
        local = ids - start
        inside = (local >= 0) & (local < self.shard.vocab_per_rank)
        x = F.embedding(local.clamp(0, self.shard.vocab_per_rank - 1), self.embed)
        return self.tp.all_reduce(x * inside.unsqueeze(-1).to(x.dtype))

    def embed_tokens(self, batch: ForwardBatch) -> torch.Tensor:
        """``(T, hidden)`` token embeddings; image rows (``batch.mm_embeds``) take their image embeddings."""
        if batch.mm_embeds is None:
            return self._embed(batch.input_ids)
        rows, embeds = batch.mm_embeds
        ids = batch.input_ids.clone()
        ids[rows.to(ids.device)] = 0  # pad values lie outside the vocabulary
        x = self._embed(ids)
        x[rows.to(x.device)] = embeds[:, : self.cfg.hidden_size].to(device=x.device, dtype=x.dtype)
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
        shard: TPShard,
    ) -> None:
        self.cfg, self.dtype, self.device, self.source = cfg, dtype, device, source
        self.shard = shard
        self.linear_dtype = linear_dtype  # dtype of the weights of linear layers (not biases or norms)
        self.remaining = {k: v for k, v in tensors.items() if not k.endswith(_IGNORED_SUFFIXES)}

    def take(self, name: str, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> torch.Tensor:
        if name not in self.remaining:
            raise ModelLoadError(self.source, f"missing tensor {name!r}")
        t = self.remaining.pop(name)
        if tuple(t.shape) != shape:
            raise ModelLoadError(self.source, f"tensor {name!r} has shape {tuple(t.shape)}, expected {shape}")
        return t.to(device=self.device, dtype=dtype or self.dtype).contiguous()

    def vocab_rows(self, w: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a ``(vocab, hidden)`` weight, zero-padded to ``vocab_per_rank`` rows."""
        if self.shard.size == 1:
            return w
        start, end = self.shard.vocab_rows()
        out = w.new_zeros((self.shard.vocab_per_rank, w.shape[1]))
        out[: end - start] = w[start:end]
        return out

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
        hidden = cfg.hidden_size
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
        return self._shard_layer(
            {
                "input_layernorm": self.take(p + "input_layernorm.weight", (hidden,)),
                "post_attention_layernorm": self.take(p + "post_attention_layernorm.weight", (hidden,)),
                "qkv_w": torch.cat(qkv_w).contiguous(),
                "qkv_b": qkv_b,
                "o_w": self.take(attn + "o_proj.weight", (hidden, q_out), self.linear_dtype),
                "o_b": self.take(attn + "o_proj.bias", (hidden,)) if cfg.o_proj_bias else None,
                "q_norm": self.take(attn + "q_norm.weight", (cfg.head_dim,)) if cfg.qk_norm else None,
                "k_norm": self.take(attn + "k_norm.weight", (cfg.head_dim,)) if cfg.qk_norm else None,
                **self.mlp(i),
            }
        )

    def mlp(self, i: int) -> dict:
        """Layer ``i``'s feed-forward tensors, as ``MLP`` takes them, this rank's shard: ``moe`` (:meth:`moe`)
        and the dense MLP's (:meth:`dense_mlp`, cut by :meth:`_shard_mlp`; None in an MoE layer)."""
        moe = self.moe(i)
        if moe is not None:
            return {"moe": moe, **dict.fromkeys(_DENSE_MLP)}
        dense = self.dense_mlp(f"model.layers.{i}.mlp.")
        return {"moe": None, **(self._shard_mlp(dense) if self.shard.size > 1 else dense)}

    def dense_mlp(self, mlp: str) -> dict[str, torch.Tensor | None]:
        """The dense SiLU-gated MLP under ``mlp`` (``model.layers.<i>.mlp.``): fused ``gate_up_w``
        ``(2 * inter, hidden)``, ``down_w`` and their biases (``mlp_bias``; else None), whole."""
        cfg, lin = self.cfg, self.linear_dtype
        hidden, inter = cfg.hidden_size, cfg.intermediate_size
        gate_up = [self.take(f"{mlp}{n}_proj.weight", (inter, hidden), lin) for n in ("gate", "up")]
        bias = cfg.mlp_bias
        return {
            "gate_up_w": torch.cat(gate_up).contiguous(),
            "gate_up_b": torch.cat([self.take(f"{mlp}{n}_proj.bias", (inter,)) for n in ("gate", "up")])
            if bias
            else None,
            "down_w": self.take(mlp + "down_proj.weight", (hidden, inter), lin),
            "down_b": self.take(mlp + "down_proj.bias", (hidden,)) if bias else None,
        }

    def moe(self, i: int) -> dict | None:
        """Layer ``i``'s MoE tensors (``engine/model/moe.py``), this rank's shard of every expert; None
        for a dense layer."""
        cfg = self.cfg
        if i not in cfg.moe_layers:
            return None
        split = self.shard.size > 1
        cols = self.shard.inter_cols(cfg.moe_intermediate_size) if split else None
        shared = self.shard.inter_cols(cfg.moe_intermediate_size * cfg.n_shared_experts) if split else None
        return moe_weights(self.take, cfg, f"model.layers.{i}.mlp.", self.linear_dtype, cols, shared)

    def _shard_layer(self, w: dict[str, torch.Tensor | None]) -> dict[str, torch.Tensor | None]:
        """This rank's part of one layer's attention weights: its q/k/v rows (column-parallel), the matching o
        columns (row-parallel); norms and row-parallel biases whole (the MLP was cut when taken: ``mlp``)."""
        if self.shard.size == 1:
            return w
        cfg = self.cfg
        q_rows, kv_rows = self.shard.head_rows()
        q_out, kv_out = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim

        def qkv(t: torch.Tensor) -> torch.Tensor:
            q, k, v = t.split((q_out, kv_out, kv_out))
            return torch.cat((q[q_rows], k[kv_rows], v[kv_rows])).contiguous()

        out = dict(w)
        out["qkv_w"] = qkv(w["qkv_w"])
        out["qkv_b"] = None if w["qkv_b"] is None else qkv(w["qkv_b"])
        out["o_w"] = w["o_w"][:, q_rows].contiguous()
        return out

    def _shard_mlp(self, w: dict[str, torch.Tensor | None]) -> dict[str, torch.Tensor | None]:
        """This rank's part of a dense MLP (``dense_mlp``'s tensors): its gate/up rows (column-parallel) and
        down columns (row-parallel); the down bias whole."""
        inter, cols = self.cfg.intermediate_size, self.shard.inter_cols()

        def gate_up(t: torch.Tensor) -> torch.Tensor:
            gate, up = t.split((inter, inter))
            return torch.cat((gate[cols], up[cols])).contiguous()

        out = dict(w)
        out["gate_up_w"] = gate_up(w["gate_up_w"])
        out["gate_up_b"] = None if w["gate_up_b"] is None else gate_up(w["gate_up_b"])
        out["down_w"] = w["down_w"][:, cols].contiguous()
        return out
