"""The xgrammar backend (SGLang's default ``--grammar-backend``): constraints compiled on a thread pool.

A constraint is one of SGLang's sampling fields (``CONSTRAINT_FIELDS``) and its text: ``json_schema`` (a JSON
schema as a string; ``"$$ANY$$"`` is any JSON value, what upstream sends for ``response_format``
``json_object``), ``regex``, ``ebnf`` (GBNF, root rule ``root``) or ``structural_tag`` (xgrammar's structural
tag JSON, or upstream's older ``{"structures": [{"begin", "schema", "end"}], "triggers": [...]}``).
Compilation runs on the backend's own threads, never the scheduler's; results (and errors) are cached by
``(kind, text)``, so a repeated schema costs one dictionary lookup.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable

import xgrammar as xgr

CONSTRAINT_FIELDS = ("json_schema", "regex", "ebnf", "structural_tag")
ANY_JSON = "$$ANY$$"  # upstream's json_schema value for "any JSON" (response_format json_object)


class GrammarError(ValueError):
    """A constraint does not compile; ``field`` is the sampling field it came from, the message says why."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


def tokenizer_info(backend, vocab_size: int, stop_token_ids: Iterable[int]) -> xgr.TokenizerInfo:
    """xgrammar's view of a ``tokenizers.Tokenizer`` ``backend`` whose model has ``vocab_size`` logits.

    Added special tokens other than the stop tokens get an empty string, which xgrammar treats as special:
    a constraint never lets the model emit ``<|im_start|>`` and the like as text. Ids past the tokenizer's
    vocabulary (lm_head padding) are masked out.
    """
    stops = sorted(set(stop_token_ids))
    vocab = backend.get_vocab(with_added_tokens=True)
    encoded = [""] * vocab_size
    for token, idx in vocab.items():
        if idx < vocab_size:
            encoded[idx] = token
    for idx, added in backend.get_added_tokens_decoder().items():
        if added.special and idx < vocab_size and idx not in stops:
            encoded[idx] = ""
    meta = xgr.TokenizerInfo._detect_metadata_from_hf(backend.to_str())
    return xgr.TokenizerInfo(
        encoded,
        vocab_type=meta["vocab_type"],
        vocab_size=vocab_size,
        stop_token_ids=stops or None,
        add_prefix_space=meta["add_prefix_space"],
    )


class GrammarBackend:
    """Compiles constraints for one tokenizer off the caller's thread and caches them.

    ``tokenizer_backend``: the model's ``tokenizers.Tokenizer``; ``vocab_size``: the model's logits width
    (the mask's); ``stop_token_ids``: ids that end generation (a grammar allows them once it may end).
    ``cache_size``: compiled grammars kept (least recently used dropped first). Thread-safe.
    """

    def __init__(
        self,
        tokenizer_backend,
        vocab_size: int,
        stop_token_ids: Iterable[int],
        threads: int = 2,
        cache_size: int = 512,
    ) -> None:
        self.vocab_size = vocab_size
        self.info = tokenizer_info(tokenizer_backend, vocab_size, stop_token_ids)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=threads, cache_enabled=False)
        self.pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="grammar")
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], concurrent.futures.Future] = OrderedDict()
        self._cache_size = cache_size

    def compile(self, kind: str, text: str) -> concurrent.futures.Future:
        """A future of the ``xgr.CompiledGrammar`` of constraint ``kind`` (one of ``CONSTRAINT_FIELDS``) with
        ``text``; it raises ``GrammarError`` naming ``kind`` when the text is invalid. Never blocks."""
        key = (kind, text)
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None:
                self._cache.move_to_end(key)
                return fut
            fut = self.pool.submit(self._compile, kind, text)
            self._cache[key] = fut
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            return fut

    def _compile(self, kind: str, text: str) -> xgr.CompiledGrammar:
        if not isinstance(text, str):
            raise GrammarError(kind, f"must be a string, got {type(text).__name__}")
        try:
            if kind == "json_schema":
                if text == ANY_JSON:
                    return self.compiler.compile_builtin_json_grammar()
                _json(kind, text)
                return self.compiler.compile_json_schema(text)
            if kind == "regex":
                return self.compiler.compile_regex(text)
            if kind == "ebnf":
                return self.compiler.compile_grammar(text)
            if kind == "structural_tag":
                return self._structural_tag(text)
        except GrammarError:
            raise
        except Exception as exc:  # xgrammar raises RuntimeError / ValueError / its own errors
            raise GrammarError(kind, f"invalid {kind.replace('_', ' ')}: {_first_line(exc)}") from None
        raise GrammarError(kind, "unknown constraint kind")

    def _structural_tag(self, text: str) -> xgr.CompiledGrammar:
        tag = _json("structural_tag", text)
        if not isinstance(tag, dict):
            raise GrammarError("structural_tag", "must be a JSON object")
        if "structures" in tag:  # upstream's older format
            items = [
                xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
                for s in tag["structures"]
            ]
            return self.compiler.compile_structural_tag(items, tag.get("triggers", []))
        return self.compiler.compile_structural_tag(text)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def _json(kind: str, text: str):
    try:
        return json.loads(text)
    except ValueError as exc:
        raise GrammarError(kind, f"is not valid JSON: {exc}") from None


def _first_line(exc: Exception) -> str:
    """xgrammar's message without its ``[time] file.cc:line:`` prefix, first line, at most 300 chars."""
    text = str(exc).strip() or type(exc).__name__
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", text.splitlines()[0])[:300]
