"""Per-request sampling parameters, validated like SGLang's ``SamplingParams``.

Defaults follow upstream: ``max_new_tokens`` 128, ``temperature`` 1.0 (0 means greedy, normalised to
``top_k=1``), ``top_p`` 1.0, ``top_k`` -1 (all), ``min_p`` 0, ``ignore_eos`` false, ``skip_special_tokens``
true. Fields this engine does not act on but routers and SDKs send with their neutral values (for example
``n=1`` or penalties of 0) are accepted; a non-neutral value of an unsupported field is a ``ValueError``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# Upstream fields accepted only with their neutral value (field -> neutral value).
_NEUTRAL_ONLY = {
    "n": 1,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "stop_regex": None,
    "logit_bias": None,
}
# Upstream fields that only change output formatting or are hints this engine may ignore.
_IGNORED = {"spaces_between_special_tokens", "custom_params", "stream_interval", "lora_path"}


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop (SGLang names and defaults)."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    sampling_seed: int | None = None

    @property
    def greedy(self) -> bool:
        """True when decoding is argmax (temperature 0 or top_k 1)."""
        return self.temperature < 1e-6 or self.top_k == 1

    @classmethod
    def from_dict(cls, data: dict | None, names: dict[str, str] | None = None) -> SamplingParams:
        """Build from a request's ``sampling_params`` dict; ``ValueError`` names the bad field as
        ``sampling_params.<field>``, or as ``names[field]`` where given (the OpenAI routes name the client's
        field: ``max_tokens``, ``n``, ``seed``)."""
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ValueError("sampling_params must be a JSON object")
        data = dict(data)
        for name, neutral in _NEUTRAL_ONLY.items():
            value = data.pop(name, neutral)
            if value != neutral and value is not None:
                raise ValueError(f"{label(name, names)}={value!r} is not supported (only {neutral!r})")
        for name in _IGNORED:
            data.pop(name, None)
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown sampling_params field(s): {', '.join(unknown)}")
        if data.get("max_new_tokens") is None:
            data.pop("max_new_tokens", None)
        stop = data.pop("stop", None)
        params = cls(**{k: v for k, v in data.items() if v is not None})
        params.stop = [stop] if isinstance(stop, str) else list(stop or [])
        params.validate(names)
        return params

    def validate(self, names: dict[str, str] | None = None) -> None:
        """Raise ``ValueError`` naming the first field out of its upstream range (float fields must also be
        finite: NaN or infinity is rejected); ``names`` as in ``from_dict``."""

        def lbl(field: str) -> str:
            return label(field, names)

        if not isinstance(self.max_new_tokens, int) or isinstance(self.max_new_tokens, bool):
            raise ValueError(f"{lbl('max_new_tokens')} must be an integer, got {self.max_new_tokens!r}")
        if self.max_new_tokens < 0:
            raise ValueError(f"{lbl('max_new_tokens')} must be >= 0, got {self.max_new_tokens}")
        for name in ("temperature", "top_p", "min_p"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
                raise ValueError(f"{lbl(name)} must be a finite number, got {value!r}")
        if self.temperature < 0:
            raise ValueError(f"{lbl('temperature')} must be >= 0, got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"{lbl('top_p')} must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or (self.top_k < 1 and self.top_k != -1):
            raise ValueError(f"{lbl('top_k')} must be -1 or >= 1, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"{lbl('min_p')} must be in [0, 1], got {self.min_p!r}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"{lbl('stop')} must be a non-empty string or a list of them")
        if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"{lbl('stop_token_ids')} must be a list of token ids")
        if self.sampling_seed is not None and not isinstance(self.sampling_seed, int):
            raise ValueError(f"{lbl('sampling_seed')} must be an integer, got {self.sampling_seed!r}")


def label(field: str, names: dict[str, str] | None = None) -> str:
    """How an error names SamplingParams ``field``: ``names[field]`` or ``sampling_params.<field>``."""
    return (names or {}).get(field, f"sampling_params.{field}")
