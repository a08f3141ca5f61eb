"""Tool-call parsers (``--tool-call-parser``): a model's tool calls in its text, as SGLang's detectors find.

Each parser knows one model family's format and the marker that starts it:

| name | format |
|---|---|
| ``qwen25``, ``qwen`` | ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, repeated (ChatML) |
| ``llama3`` | ``<|python_tag|>{"name": ..., "parameters": {...}}`` (or bare JSON), calls joined by ``;`` |
| ``mistral`` | ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`` |
| ``pythonic`` | ``[get_weather(city="Paris"), ...]`` (Python call syntax, literal arguments) |

``parse(text)`` returns the text before the first call and the calls; a call to a function the request did not
offer is dropped, as upstream does. ``default_parser(chat_template)`` is the parser a chat template implies.
Pure Python (imported by the launch flags).
"""

from __future__ import annotations

import ast
import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass

TOOL_CALL_PARSERS = ("llama3", "mistral", "pythonic", "qwen", "qwen25")


@dataclass(frozen=True)
class ToolCall:
    """One call: the function's name and its arguments as a JSON object string."""

    name: str
    arguments: str


class ToolCallParser(ABC):
    """Base: ``start`` is the marker that opens the calls (a stream holds text back from it on)."""

    start = ""

    def parse(self, text: str, names: set[str] | None = None) -> tuple[str, list[ToolCall]]:
        """``(text before the calls, calls)``; ``names``: the offered functions (None: any). Text without a
        call, or whose calls do not parse, is returned whole with no calls."""
        idx = text.find(self.start) if self.start else -1
        if idx < 0:
            return text, []
        try:
            calls = [
                c for c in self._calls(text[idx + len(self.start) :]) if names is None or c.name in names
            ]
        except (ValueError, SyntaxError, TypeError, KeyError, AttributeError):
            return text, []
        return (text[:idx].rstrip(), calls) if calls else (text, [])

    @abstractmethod
    def _calls(self, body: str) -> list[ToolCall]:
        """The calls in ``body`` (the text after the start marker); raises on text that is not calls."""

    def hold_from(self, text: str) -> int:
        """Where, in a stream's ``text`` so far, a call may begin: the marker, or a tail that could grow
        into it (``len(text)`` when none); text before it can go out as content."""
        idx = text.find(self.start)
        if idx >= 0:
            return idx
        for k in range(min(len(self.start) - 1, len(text)), 0, -1):
            if text.endswith(self.start[:k]):
                return len(text) - k
        return len(text)


def _call(obj: dict, args_key: str = "arguments") -> ToolCall:
    args = obj.get(args_key, obj.get("parameters", obj.get("arguments", {})))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        args = json.loads(args)
    if not isinstance(obj["name"], str) or not isinstance(args, dict):
        raise ValueError("not a call")
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _json_objects(body: str) -> list[dict]:
    """The JSON values at the start of ``body`` and after each separator (whitespace, ``;`` or ``,``)."""
    decoder = json.JSONDecoder()
    out, pos = [], 0
    while True:
        while pos < len(body) and body[pos] in " \t\r\n;,":
            pos += 1
        if pos >= len(body) or body[pos] not in "{[":
            return out
        value, pos = decoder.raw_decode(body, pos)
        out.extend(value if isinstance(value, list) else [value])


class Qwen25Parser(ToolCallParser):
    start = "<tool_call>"
    _call_re = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def _calls(self, body: str) -> list[ToolCall]:
        return [_call(json.loads(m)) for m in self._call_re.findall(self.start + body) if m]


class Llama3Parser(ToolCallParser):
    start = "<|python_tag|>"

    def parse(self, text: str, names: set[str] | None = None) -> tuple[str, list[ToolCall]]:
        if self.start not in text and text.lstrip().startswith("{"):  # Llama 3 also calls in bare JSON
            text = self.start + text.lstrip()
        return super().parse(text, names)

    def _calls(self, body: str) -> list[ToolCall]:
        return [_call(o, "parameters") for o in _json_objects(body)]

    def hold_from(self, text: str) -> int:
        return 0 if text.lstrip().startswith("{") or not text.strip() else super().hold_from(text)


class MistralParser(ToolCallParser):
    start = "[TOOL_CALLS]"

    def _calls(self, body: str) -> list[ToolCall]:
        return [_call(o) for o in _json_objects(body)]


class PythonicParser(ToolCallParser):
    start = "["

    def parse(self, text: str, names: set[str] | None = None) -> tuple[str, list[ToolCall]]:
        stripped = text.strip()
        if not (stripped.startswith("[") and stripped.endswith("]")):
            return text, []
        return super().parse(stripped, names)

    def _calls(self, body: str) -> list[ToolCall]:
        tree = ast.parse("[" + body, mode="eval").body
        if not isinstance(tree, ast.List):
            raise ValueError("not a list of calls")
        calls = []
        for node in tree.elts:
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
                raise ValueError("not a call")
            args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
            calls.append(ToolCall(node.func.id, json.dumps(args, ensure_ascii=False)))
        return calls

    def hold_from(self, text: str) -> int:
        return 0 if text.lstrip().startswith("[") or not text.strip() else len(text)


_PARSERS: dict[str, type[ToolCallParser]] = {
    "llama3": Llama3Parser,
    "mistral": MistralParser,
    "pythonic": PythonicParser,
    "qwen": Qwen25Parser,
    "qwen25": Qwen25Parser,
}
assert set(_PARSERS) == set(TOOL_CALL_PARSERS)


def get_parser(name: str) -> ToolCallParser:
    """The parser called ``name`` (one of ``TOOL_CALL_PARSERS``; KeyError otherwise)."""
    return _PARSERS[name]()


def default_parser(chat_template: str | None) -> str:
    """The parser a chat template implies: its own tool-call markers first, then its family (ChatML is
    Hermes' / Qwen 2.5's ``<tool_call>`` format, Llama 3 headers Llama 3's, ``[INST]`` Mistral's), else
    ``pythonic``."""
    template = chat_template or ""
    for marker, name in (
        ("<tool_call>", "qwen25"),
        ("<|python_tag|>", "llama3"),
        ("[TOOL_CALLS]", "mistral"),
        ("<|im_start|>", "qwen25"),
        ("<|start_header_id|>", "llama3"),
        ("[INST]", "mistral"),
    ):
        if marker in template:
            return name
    return "pythonic"
