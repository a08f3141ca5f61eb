"""Mixture-of-experts MLP: a router's top-k over routed experts, plus optional shared experts.

Follows transformers' ``Qwen3MoeSparseMoeBlock``, ``DeepseekV2Moe`` and ``DeepseekV3MoE`` (upstream SGLang's
``FusedMoE`` + ``TopK`` compute the same). Routers (``ModelConfig.topk_method``):

* ``softmax`` (Qwen3-MoE): softmax over the router logits, top-k, renormalised when ``norm_topk_prob``.
* ``greedy`` / ``group_limited_greedy`` (DeepSeek-V2): float32 softmax; group-limited keeps the experts of
  the ``topk_group`` groups (of ``n_group``) with the highest best score; top-k; times
  ``routed_scaling_factor`` (transformers' V2 never renormalises, so neither does this).
* ``noaux_tc`` (DeepSeek-V3): float32 sigmoid scores; the choice adds ``e_score_correction_bias``, ranks
  the groups by the sum of their two best biased scores, keeps ``topk_group`` of them and takes the top-k
  there; the weights are the unbiased scores of the chosen experts, renormalised when ``norm_topk_prob``,
  times ``routed_scaling_factor``.

Each chosen expert computes ``down(silu(gate(x)) * up(x))`` for its tokens, weighted and summed; shared
experts (one SiLU-gated MLP of ``moe_intermediate_size * n_shared_experts``) add their output for every token.
Tensor parallelism splits every expert's (and the shared MLP's) intermediate columns over the ranks, like the
dense MLP: the layer returns a rank's partial sum, which the caller all-reduces (the router is replicated,
so every rank picks the same experts). Expert parallelism (``--ep-size``) is not built.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from engine.model.config import ModelConfig
from engine.model.linear import make_linear

Take = Callable[..., torch.Tensor]


class MoE:
    """One layer's routed experts (and shared experts): ``moe(x)`` maps ``(T, hidden)`` to this rank's partial
    ``(T, hidden)``. ``w``: :func:`moe_weights`' dict (already this rank's shard)."""

    def __init__(self, cfg: ModelConfig, w: dict, quantization: str | None) -> None:
        self.cfg = cfg
        self.gate = w["gate"]  # (E, hidden), float32 for DeepSeek (transformers routes in float32)
        self.bias = w["e_score_correction_bias"]  # (E,) float32, noaux_tc only
        self.experts = [
            (make_linear(gu, None, quantization), make_linear(d, None, quantization))
            for gu, d in zip(w["experts_gate_up"], w["experts_down"], strict=True)
        ]
        self.shared = None
        if w["shared_gate_up"] is not None:
            self.shared = (
                make_linear(w["shared_gate_up"], None, quantization),
                make_linear(w["shared_down"], None, quantization),
            )

    def linears(self) -> list:
        """Every expert's (and the shared MLP's) linear layers."""
        out = [lin for pair in self.experts for lin in pair]
        return out + (list(self.shared) if self.shared else [])

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights (T, k) float32, expert ids (T, k) int64)`` for hidden states ``x`` ``(T, hidden)``."""
        cfg, k = self.cfg, self.cfg.num_experts_per_tok
        if cfg.topk_method == "softmax":
            logits = F.linear(x, self.gate.to(x.dtype))
            probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
            weights, ids = torch.topk(probs, k, dim=-1)
            if cfg.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return weights.to(logits.dtype).float(), ids
        logits = F.linear(x.float(), self.gate.float())
        experts, groups = logits.shape[-1], cfg.n_group
        if cfg.topk_method == "noaux_tc":
            scores = logits.sigmoid()
            choice = scores + self.bias
            group_scores = choice.view(-1, groups, experts // groups).topk(2, dim=-1)[0].sum(dim=-1)
            choice = choice.masked_fill(~self._group_mask(group_scores, experts), float("-inf"))
            ids = torch.topk(choice, k, dim=-1, sorted=False)[1]
            weights = scores.gather(1, ids)
            if cfg.norm_topk_prob:
                weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
            return weights * cfg.routed_scaling_factor, ids
        scores = logits.softmax(dim=-1, dtype=torch.float32)
        if cfg.topk_method == "group_limited_greedy":
            group_scores = scores.view(-1, groups, experts // groups).max(dim=-1).values
            scores = scores.masked_fill(~self._group_mask(group_scores, experts), 0.0)
        weights, ids = torch.topk(scores, k, dim=-1, sorted=False)
        return weights * cfg.routed_scaling_factor, ids

    def _group_mask(self, group_scores: torch.Tensor, experts: int) -> torch.Tensor:
        """Bool ``(T, E)``: the experts of each token's ``topk_group`` best groups."""
        groups = group_scores.shape[-1]
        best = torch.topk(group_scores, k=self.cfg.topk_group, dim=-1, sorted=False)[1]
        mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        return mask.unsqueeze(-1).expand(-1, groups, experts // groups).reshape(-1, experts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        out = torch.zeros_like(x)
        for expert in torch.unique(ids).tolist():
            tokens, slot = torch.where(ids == expert)
            gate_up, down = self.experts[expert]
            gate, up = gate_up(x[tokens]).chunk(2, dim=-1)
            y = down(F.silu(gate) * up) * weights[tokens, slot, None].to(x.dtype)
            out.index_add_(0, tokens, y)
        if self.shared is not None:
            gate, up = self.shared[0](x).chunk(2, dim=-1)
            out = out + self.shared[1](F.silu(gate) * up)
        return out


def moe_weights(
    take: Take,
    cfg: ModelConfig,
    prefix: str,
    linear_dtype: torch.dtype,
    cols: slice | None,
    shared_cols: slice | None,
) -> dict:
    """Layer tensors under ``prefix`` (``model.layers.<i>.mlp.``) by the checkpoints' names: ``gate.weight``,
    ``gate.e_score_correction_bias`` (noaux_tc), ``experts.<e>.{gate,up,down}_proj.weight``,
    ``shared_experts.{gate,up,down}_proj.weight`` (``n_shared_experts``). ``take(name, shape, dtype=None)``
    takes one tensor (shape-checked); ``cols`` / ``shared_cols``: this rank's intermediate columns (None:
    all)."""
    hidden, inter, experts = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
    router_dtype = torch.float32 if cfg.topk_method != "softmax" else None
    w: dict = {
        "gate": take(prefix + "gate.weight", (experts, hidden), router_dtype),
        "e_score_correction_bias": take(prefix + "gate.e_score_correction_bias", (experts,), torch.float32)
        if cfg.topk_method == "noaux_tc"
        else None,
        "experts_gate_up": [],
        "experts_down": [],
        "shared_gate_up": None,
        "shared_down": None,
    }
    for e in range(experts):
        gu, d = _mlp(take, f"{prefix}experts.{e}.", hidden, inter, linear_dtype, cols)
        w["experts_gate_up"].append(gu)
        w["experts_down"].append(d)
    if cfg.n_shared_experts:
        shared = inter * cfg.n_shared_experts
        w["shared_gate_up"], w["shared_down"] = _mlp(
            take, prefix + "shared_experts.", hidden, shared, linear_dtype, shared_cols
        )
    return w


def _mlp(
    take: Take, prefix: str, hidden: int, inter: int, dtype: torch.dtype, cols: slice | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One SiLU-gated MLP's fused ``(2 * I', hidden)`` gate/up and ``(hidden, I')`` down, cut to ``cols``."""
    gate = take(prefix + "gate_proj.weight", (inter, hidden), dtype)
    up = take(prefix + "up_proj.weight", (inter, hidden), dtype)
    down = take(prefix + "down_proj.weight", (hidden, inter), dtype)
    if cols is not None:
        gate, up, down = gate[cols], up[cols], down[:, cols]
    return torch.cat((gate, up)).contiguous(), down.contiguous()
