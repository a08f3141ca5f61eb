"""Model hyper-parameters of a Llama-family decoder, read from an HF ``config.json`` or GGUF metadata.

Follows transformers' field names and defaults (``LlamaConfig``, ``Qwen2Config``, ``Qwen3Config``).
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
}
# rope types whose inv_freq this engine computes (see engine/model/rotary.py)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
# --torchao-config values (engine/model/linear.py): int8 weight-only, int4 groupwise with upstream's groups
INT4_GROUP_SIZES = (32, 64, 128, 256)
QUANTIZATIONS = ("int8wo", *(f"int4wo-{g}" for g in INT4_GROUP_SIZES))


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and constants of one decoder model.

    ``rope_scaling`` holds the HF scaling dict (``rope_type`` plus its factors) or ``None`` for plain RoPE.
    ``eos_token_ids`` may hold several ids (Llama-3 instruct lists two).
    """

    architecture: str  # "llama" | "qwen2" | "qwen3"
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
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope_type {rope_type!r} is not supported (supported: {SUPPORTED_ROPE_TYPES})")

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], source: str = "config.json") -> ModelConfig:
        """Build from a parsed HF ``config.json``.

        Raises ``ModelLoadError`` naming ``source`` and the missing or bad field.
        """
        archs = cfg.get("architectures") or []
        arch = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            model_type = cfg.get("model_type")
            arch = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}.get(model_type)
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
            scaling = cfg.get("rope_scaling") or None
            theta = cfg.get("rope_theta", rope.get("rope_theta", (scaling or {}).get("rope_theta", 10000.0)))
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
                qk_norm=arch == "qwen3",
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=eos_ids,
            )
        except KeyError as exc:
            raise ModelLoadError(source, f"missing field {exc.args[0]!r}") from exc
        except (TypeError, ValueError) as exc:
            raise ModelLoadError(source, f"invalid value: {exc}") from exc

    @classmethod
    def from_gguf(cls, meta: dict[str, Any], source: str, tie_word_embeddings: bool) -> ModelConfig:
        """Build from GGUF metadata (``general.architecture`` = llama | qwen2 | qwen3 and ``<arch>.*`` keys).

        ``tie_word_embeddings`` is True when the file has no ``output.weight`` tensor.
        Follows llama.cpp's key names (``<arch>.block_count``, ``<arch>.attention.head_count_kv``, ...).
        Raises ``ModelLoadError`` naming ``source`` and the missing key.
        """
        arch = meta.get("general.architecture")
        if arch not in ("llama", "qwen2", "qwen3"):
            raise ModelLoadError(
                source, f"unsupported GGUF architecture {arch!r}; supported: llama, qwen2, qwen3"
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
        if key("rope.scaling.type", None) == "linear":
            scaling = {"rope_type": "linear", "factor": float(key("rope.scaling.factor"))}
        eos = meta.get("tokenizer.ggml.eos_token_id")
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
