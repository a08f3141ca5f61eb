"""Per-request sampling parameters, validated like SGLang's ``SamplingParams``.

Defaults follow upstream: ``max_new_tokens`` 128, ``temperature`` 1.0 (0 means greedy, normalised to
``top_k=1``), ``top_p`` 1.0, ``top_k`` -1 (all), ``min_p`` 0, ``ignore_eos`` false, ``skip_special_tokens``
true, ``n`` 1, penalties neutral (frequency / presence 0 in [-2, 2], repetition 1 in (0, 2]),
``min_new_tokens`` 0 (at most ``max_new_tokens``), ``logit_bias`` none (token id, as a string or int ->
a finite bias in [-100, 100]; the ids are checked against the vocabulary by the server), ``stop_regex`` none
(a pattern or a list; a bad pattern is a ``ValueError``). Fields this engine does not act on but routers and
SDKs send with their neutral values are accepted; a non-neutral value of an unsupported field is a
``ValueError``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

# Upstream fields accepted only with their neutral value (field -> neutral value).
_NEUTRAL_ONLY: dict[str, object] = {}
# Grammar constraints (engine/grammar), in the order a request's constraint is read.
_CONSTRAINTS = ("json_schema", "regex", "ebnf", "structural_tag")
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
    n: int = 1
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    logit_bias: dict[int, float] | None = None
    stop_regex: list[str] = field(default_factory=list)

    @property
    def adjusts_logits(self) -> bool:
        """True when a penalty, ``min_new_tokens`` or ``logit_bias`` changes the logits before sampling."""
        return bool(
            self.frequency_penalty
            or self.presence_penalty
            or self.repetition_penalty != 1.0
            or self.min_new_tokens
            or self.logit_bias
        )

    # Constrained decoding (engine/grammar): at most one of these, each a string.
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None

    @property
    def greedy(self) -> bool:
        """True when decoding is argmax (temperature 0 or top_k 1)."""
        return self.temperature < 1e-6 or self.top_k == 1

    @property
    def constraint(self) -> tuple[str, str] | None:
        """``(field, text)`` of the grammar constraint, or None when the output is unconstrained."""
        for name in _CONSTRAINTS:
            value = getattr(self, name)
            if value is not None:
                return name, value
        return None

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
        stop_regex = data.pop("stop_regex", None)
        bias = data.pop("logit_bias", None)
        params = cls(**{k: v for k, v in data.items() if v is not None})
        params.stop = [stop] if isinstance(stop, str) else list(stop or [])
        params.stop_regex = [stop_regex] if isinstance(stop_regex, str) else list(stop_regex or [])
        params.logit_bias = _logit_bias(bias, label("logit_bias", names))
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
        self._validate_extras(lbl)
        self._validate_constraint(lbl)

    def _validate_constraint(self, lbl) -> None:
        """At most one grammar constraint, a string (upstream: "Only one of regex, json_schema, or ebnf")."""
        constraints = [c for c in _CONSTRAINTS if getattr(self, c) is not None]
        for name in constraints:
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"{lbl(name)} must be a string")
        if len(constraints) > 1:
            raise ValueError(f"only one of {', '.join(lbl(c) for c in constraints)} may be set")

    def _validate_extras(self, lbl) -> None:
        """``n``, penalties, ``min_new_tokens``, ``stop_regex`` (``validate``'s second half)."""
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"{lbl('n')} must be an integer >= 1, got {self.n!r}")
        for name, lo, hi in (("frequency_penalty", -2.0, 2.0), ("presence_penalty", -2.0, 2.0)):
            value = getattr(self, name)
            if not _is_num(value) or not lo <= value <= hi:
                raise ValueError(f"{lbl(name)} must be a number in [{lo:g}, {hi:g}], got {value!r}")
        rep = self.repetition_penalty
        if not _is_num(rep) or not 0.0 < rep <= 2.0:
            raise ValueError(f"{lbl('repetition_penalty')} must be a number in (0, 2], got {rep!r}")
        if not _is_int(self.min_new_tokens) or not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(
                f"{lbl('min_new_tokens')} must be an integer in [0, {lbl('max_new_tokens')}], "
                f"got {self.min_new_tokens!r}"
            )
        for pattern in self.stop_regex:
            if not isinstance(pattern, str) or not pattern:
                raise ValueError(f"{lbl('stop_regex')} must be a non-empty string or a list of them")
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ValueError(f"{lbl('stop_regex')}: invalid pattern {pattern!r}: {exc}") from None


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_num(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _logit_bias(bias, name: str) -> dict[int, float] | None:
    """``{"<token id>": bias}`` (OpenAI's string keys, or ints) as ``{id: bias}``; ``ValueError`` naming
    ``name`` for a key that is not a token id or a bias that is not a finite number in [-100, 100]."""
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise ValueError(f"{name} must be an object mapping token ids to biases")
    out: dict[int, float] = {}
    for key, value in bias.items():
        try:
            tok = int(key)
        except (TypeError, ValueError):
            tok = -1
        if isinstance(key, bool) or tok < 0 or (isinstance(key, str) and not key.strip().isdigit()):
            raise ValueError(f"{name}: key {key!r} is not a token id")
        if not _is_num(value) or not -100.0 <= value <= 100.0:
            raise ValueError(f"{name}[{key}] must be a number in [-100, 100], got {value!r}")
        out[tok] = float(value)
    return out or None


def label(field: str, names: dict[str, str] | None = None) -> str:
    """How an error names SamplingParams ``field``: ``names[field]`` or ``sampling_params.<field>``."""
    return (names or {}).get(field, f"sampling_params.{field}")
