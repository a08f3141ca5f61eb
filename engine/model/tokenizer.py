"""Tokenizer: encode/decode with the ``tokenizers`` library, streaming detokenization, chat templates.

Chat templates render like transformers' ``apply_chat_template``: a sandboxed jinja2 environment with
``trim_blocks``/``lstrip_blocks``, the ``loopcontrols`` extension, a ``tojson`` filter, ``raise_exception``
and ``strftime_now`` globals, and ``bos_token``/``eos_token``/``add_generation_prompt`` variables.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any

import jinja2
import tokenizers
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers.decoders import DecodeStream


class ChatTemplateError(ValueError):
    """The model has no chat template, or the template rejected the messages."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, **_: Any) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent)


def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


class IncrementalDetokenizer:
    """Turns a stream of token ids into text pieces; a piece is held back until it is valid UTF-8.

    Wraps ``tokenizers.decoders.DecodeStream`` (the library's own streaming decoder).
    """

    def __init__(self, backend: tokenizers.Tokenizer, skip_special_tokens: bool = True) -> None:
        self._backend = backend
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)

    def step(self, token_id: int) -> str:
        """New text produced by ``token_id`` ("" while a multi-byte character is incomplete)."""
        return self._stream.step(self._backend, token_id) or ""


class Tokenizer:
    """A model's tokenizer, chat template and stop tokens.

    ``eos_token_ids``: ids that end generation (from the model config, generation config and tokenizer).
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        eos_token_ids: Iterable[int] = (),
    ) -> None:
        self.backend = backend
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        ids = set(eos_token_ids)
        if eos_token is not None and backend.token_to_id(eos_token) is not None:
            ids.add(backend.token_to_id(eos_token))
        self.eos_token_ids = frozenset(ids)
        self._template = _compile(chat_template) if chat_template else None

    @property
    def vocab_size(self) -> int:
        """Number of token ids including added tokens."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` applies the tokenizer's post-processor (e.g. BOS).

        Goes through ``encode_batch``, which releases the GIL while the Rust tokenizer runs (``encode`` holds
        it), so a long text encoded on a worker thread does not stall the server's other threads.
        """
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        """Id of a vocabulary token string, or None."""
        return self.backend.token_to_id(token)

    def detokenizer(self, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        """A fresh streaming decoder for one output sequence."""
        return IncrementalDetokenizer(self.backend, skip_special_tokens)

    def apply_chat_template(
        self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render ``messages`` (``[{"role", "content"}, ...]``) with the model's template.

        Extra ``kwargs`` (e.g. ``tools``) are passed to the template. Raises ``ChatTemplateError`` when the
        model has no template or the template raises.
        """
        if self._template is None:
            raise ChatTemplateError("this model has no chat template")
        try:
            return self._template.render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **kwargs,
            )
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template failed: {exc}") from exc

    def encode_chat(
        self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True
    ) -> list[int]:
        """Token ids of the rendered chat prompt (no extra special tokens: the template places them)."""
        return self.encode(
            self.apply_chat_template(messages, add_generation_prompt), add_special_tokens=False
        )
