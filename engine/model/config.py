"""Model hyper-parameters of a decoder, read from an HF ``config.json`` or GGUF metadata.

Follows transformers' field names and defaults (``LlamaConfig``, ``Qwen2Config``, ``Qwen3Config``,
``DeepseekV2Config``, ``DeepseekV3Config``). A DeepSeek-V2/V3 config is multi-head latent attention (MLA):
its KV cache holds one compressed latent per token and layer (``kv_lora_rank`` + ``qk_rope_head_dim``
values, shared by every head), which :attr:`ModelConfig.kv_cache_heads` / ``kv_cache_head_dim`` describe.
Both rope spellings are accepted: the older top-level ``rope_theta``/``rope_scaling`` and the
transformers>=5 ``rope_parameters`` dict.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.model.errors import ModelLoadError

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}
MOE_ROUTERS = ("softmax", "greedy", "group_limited_greedy", "noaux_tc")  # ModelConfig.topk_method
MLA_ARCHITECTURES = ("deepseek_v2", "deepseek_v3")
GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "deepseek2")  # llama.cpp's general.architecture names
# rope types whose inv_freq this engine computes (see engine/model/rotary.py)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")  # yarn: MLA (DeepSeek) models only
# --torchao-config values (engine/model/linear.py): int8 weight-only, int4 groupwise with upstream's groups
INT4_GROUP_SIZES = (32, 64, 128, 256)
QUANTIZATIONS = ("int8wo", *(f"int4wo-{g}" for g in INT4_GROUP_SIZES))


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and constants of one decoder model.

    ``rope_scaling`` holds the HF scaling dict (``rope_type`` plus its factors) or ``None`` for plain RoPE.
    ``eos_token_ids`` may hold several ids (Llama-3 instruct lists two).
    """

    architecture: str  # "llama" | "qwen2" | "qwen3" | "qwen3_moe" | "deepseek_v2" | "deepseek_v3"
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v (and o for Llama) projections carry a bias
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: per-head RMSNorm on q and k before RoPE
    # M-RoPE (Qwen3-VL): rotary pairs split over (time, row, column) positions, interleaved; () = plain RoPE
    mrope_section: tuple[int, ...] = ()
    mrope_interleaved: bool = True  # False: consecutive sections (Qwen2.5-VL)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # MLA (DeepSeek-V2/V3): ``head_dim`` is then the rotary part ``qk_rope_head_dim`` (what RoPE rotates)
    kv_lora_rank: int | None = None  # None: not MLA
    q_lora_rank: int | None = None  # None: one q_proj, else q_a_proj -> q_a_layernorm -> q_b_proj
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False  # RoPE rotates (x0, x1), (x2, x3) ... pairs (DeepSeek) instead of halves
    # MoE (engine/model/moe.py): the layers in moe_layers replace the dense MLP by routed + shared experts
    moe_layers: tuple[int, ...] = ()
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    n_shared_experts: int = 0
    topk_method: str = ""  # one of MOE_ROUTERS
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0

    @property
    def moe(self) -> bool:
        """Some layers are mixture-of-experts."""
        return bool(self.moe_layers)

    @property
    def mla(self) -> bool:
        """Multi-head latent attention: the KV cache holds one latent per token and layer."""
        return self.kv_lora_rank is not None

    @property
    def qk_head_dim(self) -> int:
        """Width of one head's query and key: ``qk_nope_head_dim + qk_rope_head_dim`` (MLA), else
        ``head_dim``."""
        return self.qk_nope_head_dim + self.head_dim if self.mla else self.head_dim

    @property
    def kv_cache_heads(self) -> int:
        """KV heads a token's cache entry has per layer: 1 for MLA (the latent is shared by all heads)."""
        return 1 if self.mla else self.num_key_value_heads

    @property
    def kv_cache_head_dim(self) -> int:
        """Width of one cache row. The pools keep a K and a V row per token, layer and head; MLA stores
        its latent ``kv_lora_rank + qk_rope_head_dim`` split over the two, half in each (same bytes as
        upstream's one-buffer MLA pool, every tier and transfer unchanged)."""
        if self.mla:
            return (self.kv_lora_rank + self.head_dim) // 2
        return self.head_dim

    def __post_init__(self) -> None:
        if self.moe:
            self._check_moe()
        if self.mla and (self.kv_lora_rank + self.head_dim) % 2:
            raise ValueError(
                f"kv_lora_rank {self.kv_lora_rank} + qk_rope_head_dim {self.head_dim} must be even "
                "(the latent is stored as two half rows)"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope_type {rope_type!r} is not supported (supported: {SUPPORTED_ROPE_TYPES})")
        if rope_type == "yarn" and not self.mla:  # the fused decode step computes plain RoPE angles itself
            raise ValueError(
                f"rope_type 'yarn' is supported for DeepSeek (MLA) models only, not {self.architecture}"
            )

    def _check_moe(self) -> None:
        """Raise ``ValueError`` naming the field for an MoE config the router cannot run."""
        if self.topk_method not in MOE_ROUTERS:
            raise ValueError(f"topk_method {self.topk_method!r} is not supported (supported: {MOE_ROUTERS})")
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok {self.num_experts_per_tok} must be in [1, {self.num_experts}] "
                "(the experts)"
            )
        if self.topk_method in ("group_limited_greedy", "noaux_tc") and (
            self.n_group < 1 or self.num_experts % self.n_group or not 0 < self.topk_group <= self.n_group
        ):
            raise ValueError(
                f"n_group {self.n_group} must divide the {self.num_experts} experts and topk_group "
                f"{self.topk_group} be in [1, n_group]"
            )

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], source: str = "config.json") -> ModelConfig:
        """Build from a parsed HF ``config.json``.

        Raises ``ModelLoadError`` naming ``source`` and the missing or bad field.
        """
        archs = cfg.get("architectures") or []
        arch = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            model_type = cfg.get("model_type")
            arch = {a: a for a in SUPPORTED_ARCHITECTURES.values()}.get(model_type)
        if arch is None:
            raise ModelLoadError(
                source,
                f"unsupported architecture {archs or cfg.get('model_type')!r}; supported: "
                f"{sorted(SUPPORTED_ARCHITECTURES)}",
            )
        if cfg.get("use_sliding_window"):
            raise ModelLoadError(source, "sliding-window attention (use_sliding_window) is not supported")
        try:
            heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            rope = dict(cfg.get("rope_parameters") or {})
            scaling = dict(cfg.get("rope_scaling") or {}) or None
            theta = cfg.get("rope_theta", rope.get("rope_theta", (scaling or {}).get("rope_theta", 10000.0)))
            mrope, interleaved = _mrope_section(
                rope, scaling, int(cfg.get("head_dim") or hidden // heads), source
            )
            if scaling is None and rope.get("rope_type", "default") != "default":
                scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
            if scaling is not None:
                scaling = dict(scaling)
                scaling.setdefault("rope_type", scaling.pop("type", "default"))
                if scaling["rope_type"] == "default":
                    scaling = None
            eos = cfg.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
            bias = bool(cfg.get("attention_bias", False))
            if arch in MLA_ARCHITECTURES:
                return cls._from_hf_mla(cfg, arch, hidden, heads, theta, scaling, eos_ids, bias, source)
            return cls(
                architecture=arch,
                hidden_size=hidden,
                num_hidden_layers=int(cfg["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                intermediate_size=int(cfg["intermediate_size"]),
                vocab_size=int(cfg["vocab_size"]),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=float(theta),
                rope_scaling=scaling,
                max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=arch == "qwen2" or bias,
                o_proj_bias=arch == "llama" and bias,
                mlp_bias=bool(cfg.get("mlp_bias", False)),
                qk_norm=arch in ("qwen3", "qwen3_moe"),
                mrope_section=mrope,
                mrope_interleaved=interleaved,
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=eos_ids,
                **(_qwen3_moe_fields(cfg) if arch == "qwen3_moe" else {}),
            )
        except KeyError as exc:
            raise ModelLoadError(source, f"missing field {exc.args[0]!r}") from exc
        except (TypeError, ValueError) as exc:
            raise ModelLoadError(source, f"invalid value: {exc}") from exc

    @classmethod
    def _from_hf_mla(
        cls,
        cfg: dict[str, Any],
        arch: str,
        hidden: int,
        heads: int,
        theta: Any,
        scaling: dict[str, Any] | None,
        eos_ids: tuple[int, ...],
        bias: bool,
        source: str,
    ) -> ModelConfig:
        """A DeepSeek-V2/V3 config (transformers' ``DeepseekV2Config`` / ``DeepseekV3Config`` fields); layers
        from ``first_k_dense_replace`` on are MoE when ``n_routed_experts`` is set."""
        layers = int(cfg["num_hidden_layers"])
        q_lora = cfg.get("q_lora_rank")
        return cls(
            architecture=arch,
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=heads,  # MLA: every head has its own k_nope / v from the latent
            head_dim=int(cfg["qk_rope_head_dim"]),
            intermediate_size=int(cfg["intermediate_size"]),
            vocab_size=int(cfg["vocab_size"]),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            kv_lora_rank=int(cfg["kv_lora_rank"]),
            q_lora_rank=None if q_lora is None else int(q_lora),
            qk_nope_head_dim=int(cfg["qk_nope_head_dim"]),
            v_head_dim=int(cfg["v_head_dim"]),
            # transformers: V2 always rotates pairs (complex RoPE); V3 when rope_interleave (default True)
            rope_interleave=arch == "deepseek_v2" or bool(cfg.get("rope_interleave", True)),
            **_deepseek_moe_fields(cfg, arch, layers),
        )

    @classmethod
    def from_gguf(cls, meta: dict[str, Any], source: str, tie_word_embeddings: bool) -> ModelConfig:
        """Build from GGUF metadata (``general.architecture`` = llama | qwen2 | qwen3 | deepseek2 and
        ``<arch>.*`` keys).

        ``tie_word_embeddings`` is True when the file has no ``output.weight`` tensor.
        Follows llama.cpp's key names (``<arch>.block_count``, ``<arch>.attention.head_count_kv``, ...).
        Raises ``ModelLoadError`` naming ``source`` and the missing key.
        """
        arch = meta.get("general.architecture")
        if arch not in GGUF_ARCHITECTURES:
            raise ModelLoadError(
                source, f"unsupported GGUF architecture {arch!r}; supported: {', '.join(GGUF_ARCHITECTURES)}"
            )

        def key(name: str, default: Any = KeyError) -> Any:
            full = f"{arch}.{name}"
            if full in meta:
                return meta[full]
            if default is KeyError:
                raise ModelLoadError(source, f"missing GGUF metadata key {full!r}")
            return default

        heads = int(key("attention.head_count"))
        hidden = int(key("embedding_length"))
        scaling = None
        rope_type = key("rope.scaling.type", None)
        if rope_type == "linear":
            scaling = {"rope_type": "linear", "factor": float(key("rope.scaling.factor"))}
        elif rope_type == "yarn" and arch == "deepseek2":
            scaling = _gguf_deepseek_yarn(key)
        elif rope_type not in (None, "none"):
            raise ModelLoadError(source, f"GGUF {arch}.rope.scaling.type {rope_type!r} is not mapped")
        eos = meta.get("tokenizer.ggml.eos_token_id")
        if arch == "deepseek2":
            return cls._from_gguf_deepseek2(key, meta, hidden, heads, scaling, tie_word_embeddings)
        return cls(
            architecture=arch,
            hidden_size=hidden,
            num_hidden_layers=int(key("block_count")),
            num_attention_heads=heads,
            num_key_value_heads=int(key("attention.head_count_kv", heads)),
            head_dim=int(key("attention.key_length", hidden // heads)),
            intermediate_size=int(key("feed_forward_length")),
            vocab_size=int(key("vocab_size", len(meta.get("tokenizer.ggml.tokens", ())))),
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
            rope_theta=float(key("rope.freq_base", 10000.0)),
            rope_scaling=scaling,
            max_position_embeddings=int(key("context_length", 4096)),
            tie_word_embeddings=tie_word_embeddings,
            attention_bias=arch == "qwen2",
            qk_norm=arch == "qwen3",
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=() if eos is None else (int(eos),),
        )

    @classmethod
    def _from_gguf_deepseek2(
        cls,
        key: Any,
        meta: dict[str, Any],
        hidden: int,
        heads: int,
        scaling: dict[str, Any] | None,
        tie: bool,
    ) -> ModelConfig:
        """llama.cpp's ``deepseek2`` metadata (its converter's keys for DeepSeek-V2/V3): the latent sizes
        from ``attention.kv_lora_rank`` / ``q_lora_rank`` / ``rope.dimension_count``, the per-head sizes
        from ``attention.key_length_mla`` / ``value_length_mla`` (older files: ``key_length`` /
        ``value_length``); RoPE rotates pairs (llama.cpp's deepseek2 rope). Sigmoid expert gating
        (``expert_gating_func`` 2) is DeepSeek-V3's router (``noaux_tc``, with ``exp_probs_b``), otherwise
        V2's softmax (group-limited when ``expert_group_count`` > 1)."""
        layers = int(key("block_count"))
        rope = int(key("rope.dimension_count"))
        if "deepseek2.attention.key_length_mla" in meta:
            nope, v = int(key("attention.key_length_mla")) - rope, int(key("attention.value_length_mla"))
        else:
            nope, v = int(key("attention.key_length")) - rope, int(key("attention.value_length"))
        q_lora = key("attention.q_lora_rank", None)
        v3 = int(key("expert_gating_func", 1)) == 2
        experts = int(key("expert_count", 0))
        dense = int(key("leading_dense_block_count", layers))
        groups = int(key("expert_group_count", 1) or 1)
        moe: dict[str, Any] = {}
        if experts and dense < layers:
            moe = {
                "moe_layers": tuple(range(dense, layers)),
                "num_experts": experts,
                "num_experts_per_tok": int(key("expert_used_count")),
                "moe_intermediate_size": int(key("expert_feed_forward_length")),
                "n_shared_experts": int(key("expert_shared_count", 0)),
                "topk_method": "noaux_tc" if v3 else ("group_limited_greedy" if groups > 1 else "greedy"),
                "n_group": groups,
                "topk_group": int(key("expert_group_used_count", 1) or 1),
                "norm_topk_prob": bool(key("expert_weights_norm", False)),
                "routed_scaling_factor": float(key("expert_weights_scale", 1.0)),
            }
        eos = meta.get("tokenizer.ggml.eos_token_id")
        return cls(
            architecture="deepseek_v3" if v3 else "deepseek_v2",
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=heads,
            head_dim=rope,
            intermediate_size=int(key("feed_forward_length")),
            vocab_size=int(key("vocab_size", len(meta.get("tokenizer.ggml.tokens", ())))),
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
            rope_theta=float(key("rope.freq_base", 10000.0)),
            rope_scaling=scaling,
            max_position_embeddings=int(key("context_length", 4096)),
            tie_word_embeddings=tie,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=() if eos is None else (int(eos),),
            kv_lora_rank=int(key("attention.kv_lora_rank")),
            q_lora_rank=None if q_lora is None else int(q_lora),
            qk_nope_head_dim=nope,
            v_head_dim=v,
            rope_interleave=True,
            **moe,
        )


def _gguf_deepseek_yarn(key: Any) -> dict[str, Any]:
    """A ``deepseek2`` file's yarn RoPE as HF's ``rope_scaling``. llama.cpp's converter keeps DeepSeek's
    ``mscale_all_dim`` as ``yarn_log_multiplier`` (x 0.1) and drops ``mscale``; the released V2 / V3
    configs set both equal (0.707 / 1.0), which is what this reads back."""
    mscale = round(float(key("rope.scaling.yarn_log_multiplier")) / 0.1, 6)  # stored as float32
    return {
        "rope_type": "yarn",
        "factor": float(key("rope.scaling.factor")),
        "original_max_position_embeddings": int(key("rope.scaling.original_context_length")),
        "beta_fast": float(key("rope.scaling.yarn_beta_fast", 32.0)),
        "beta_slow": float(key("rope.scaling.yarn_beta_slow", 1.0)),
        "mscale": mscale,
        "mscale_all_dim": mscale,
    }


def _mrope_section(
    rope: dict[str, Any], scaling: dict[str, Any] | None, head_dim: int, source: str
) -> tuple[tuple[int, ...], bool]:
    """M-RoPE sections from ``rope_parameters`` (transformers>=5) or ``rope_scaling`` (older files),
    popped from both with ``mrope_interleaved``, and whether they interleave; ``((), True)`` without them.
    ``ModelLoadError`` naming the field for sections that do not cover ``head_dim / 2`` in three."""
    field, section, interleaved = "rope_parameters", None, False
    for name, d in (("rope_scaling", scaling or {}), ("rope_parameters", rope)):
        if d.get("mrope_section") is not None:
            field, section = name, d["mrope_section"]
        interleaved = bool(d.pop("mrope_interleaved", False)) or interleaved
        d.pop("mrope_section", None)
    if section is None:
        return (), True
    if (scaling or {}).get("rope_type", (scaling or {}).get("type")) == "mrope":  # older Qwen2-VL spelling
        scaling.pop("type", None)  # type: ignore[union-attr]
        scaling["rope_type"] = "default"  # type: ignore[index]
    out = tuple(int(x) for x in section)
    if len(out) != 3 or sum(out) * 2 != head_dim:
        raise ModelLoadError(source, f"{field}.mrope_section: three sections summing to head_dim / 2")
    return out, interleaved


def _deepseek_moe_fields(cfg: dict[str, Any], arch: str, layers: int) -> dict[str, Any]:
    """MoE fields of a DeepSeek config: layers ``first_k_dense_replace..`` route over ``n_routed_experts``
    with ``n_shared_experts`` beside them; V2 routes by ``topk_method`` (softmax greedy or group-limited),
    V3 by sigmoid scores with ``e_score_correction_bias`` (upstream's ``noaux_tc``)."""
    experts = int(cfg.get("n_routed_experts") or 0)
    dense = int(cfg.get("first_k_dense_replace", 0))
    if not experts or dense >= layers:
        return {}
    return {
        "moe_layers": tuple(range(dense, layers)),
        "num_experts": experts,
        "num_experts_per_tok": int(cfg["num_experts_per_tok"]),
        "moe_intermediate_size": int(cfg["moe_intermediate_size"]),
        "n_shared_experts": int(cfg.get("n_shared_experts") or 0),
        "topk_method": "noaux_tc" if arch == "deepseek_v3" else str(cfg.get("topk_method") or "greedy"),
        "n_group": int(cfg.get("n_group") or 1),
        "topk_group": int(cfg.get("topk_group") or 1),
        "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)),
        "routed_scaling_factor": float(cfg.get("routed_scaling_factor", 1.0)),
    }


def _qwen3_moe_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """MoE fields of a ``Qwen3MoeConfig``: layer i is MoE unless in ``mlp_only_layers``, when
    ``(i + 1) % decoder_sparse_step == 0``; softmax top-k, no shared experts."""
    experts = int(
        cfg.get("num_experts") or cfg.get("num_local_experts") or 0
    )  # transformers 5 writes the latter
    step = int(cfg.get("decoder_sparse_step", 1))
    dense = set(cfg.get("mlp_only_layers") or ())
    layers = int(cfg["num_hidden_layers"])
    moe = tuple(i for i in range(layers) if experts and i not in dense and (i + 1) % step == 0)
    if not moe:
        return {}
    return {
        "moe_layers": moe,
        "num_experts": experts,
        "num_experts_per_tok": int(cfg["num_experts_per_tok"]),
        "moe_intermediate_size": int(cfg["moe_intermediate_size"]),
        "topk_method": "softmax",
        "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)),
    }
