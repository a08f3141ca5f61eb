"""OpenAI ``tools`` / ``tool_choice`` on chat: their checks, the constraint they imply, the calls in the text.

``tool_choice`` (default ``auto`` with tools, ``none`` without): ``none`` (tools are not shown to the
template, no calls parsed), ``auto`` (the model decides; its calls are found by the ``--tool-call-parser``),
``required`` (at least one call) or ``{"type": "function", "function": {"name": ...}}`` (exactly that one).
``required`` and a named function constrain the output, as upstream does, to a JSON array of
``{"name", "parameters"}`` objects that follow each function's ``parameters`` schema, so the call is always
well formed whatever the model; the array is read back as the calls. Pure Python (no torch).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from engine.grammar.tool_parsers import ToolCall, ToolCallParser

TOOL_CHOICES = ("none", "auto", "required")


@dataclass
class Tools:
    """A chat request's tools: ``functions`` (OpenAI ``function`` objects, as the template receives them),
    ``choice`` (``auto``, ``required`` or a function name; a request with ``tool_choice`` ``none`` has no
    ``Tools``)."""

    functions: list[dict]
    choice: str
    names: set[str] = field(init=False)

    def __post_init__(self) -> None:
        self.names = {f["name"] for f in self.functions}

    @property
    def constrained(self) -> bool:
        """The output is the JSON array of calls (``required`` or a named function)."""
        return self.choice != "auto"

    def json_schema(self) -> str | None:
        """The JSON schema (text) the output must follow, or None for ``auto``."""
        if self.choice == "auto":
            return None
        if self.choice == "required":
            items = {"type": "object", "anyOf": [_call_schema(f) for f in self.functions]}
            return json.dumps({"type": "array", "minItems": 1, "items": items})
        (function,) = (f for f in self.functions if f["name"] == self.choice)
        return json.dumps({"type": "array", "minItems": 1, "maxItems": 1, "items": _call_schema(function)})

    def extract(self, text: str, parser: ToolCallParser) -> tuple[str, list[ToolCall]]:
        """``(content, calls)`` of the model's ``text``: the constrained array read back, or what ``parser``
        finds (calls to functions not offered are dropped)."""
        if not self.constrained:
            return parser.parse(text, self.names)
        try:
            items = json.loads(text)
            calls = [ToolCall(i["name"], json.dumps(i["parameters"], ensure_ascii=False)) for i in items]
        except (ValueError, TypeError, KeyError):  # cut short by max_tokens: not a whole array
            return text, []
        return "", [c for c in calls if c.name in self.names]


def _call_schema(function: dict) -> dict:
    params = function.get("parameters") or {"type": "object", "properties": {}}
    return {
        "properties": {"name": {"type": "string", "enum": [function["name"]]}, "parameters": params},
        "required": ["name", "parameters"],
    }


def parse_tools(tools, tool_choice) -> Tools | None:
    """``Tools`` of a chat body's ``tools`` and ``tool_choice``, or None when no tool may be called.
    ``ValueError`` names the field: ``tools.<i>.function.name``, ``tool_choice`` (unknown value, a function
    not among ``tools``, or ``required`` / a function without ``tools``)."""
    functions = [_function(i, t) for i, t in enumerate(tools or [])]
    if tool_choice is None:
        tool_choice = "auto" if functions else "none"
    if isinstance(tool_choice, str):
        if tool_choice not in TOOL_CHOICES:
            raise ValueError(
                f"tool_choice must be one of {', '.join(TOOL_CHOICES)} or a function, got {tool_choice!r}"
            )
        choice = tool_choice
    elif isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        name = (tool_choice.get("function") or {}).get("name")
        if not isinstance(name, str):
            raise ValueError("tool_choice.function.name must be a string")
        known = [f["name"] for f in functions]
        if name not in known:
            offered = ", ".join(repr(n) for n in known) or "none"
            raise ValueError(f"tool_choice: function {name!r} is not among the tools (offered: {offered})")
        choice = name
    else:
        raise ValueError('tool_choice must be a string or {"type": "function", "function": {"name": ...}}')
    if choice == "none":
        return None
    if not functions:
        if choice == "auto":
            return None
        raise ValueError(f"tool_choice {choice!r} needs tools")
    return Tools(functions, choice)


def _function(i: int, tool) -> dict:
    where = f"tools.{i}"
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise ValueError(f"{where}.type must be 'function'")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise ValueError(f"{where}.function must be an object")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}.function.name must be a non-empty string")
    params = function.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise ValueError(f"{where}.function.parameters must be a JSON schema object")
    return function


def call_objects(calls: list[ToolCall]) -> list[dict]:
    """OpenAI ``tool_calls`` entries: ``id``, ``index``, ``type``, ``function`` (``name``, ``arguments``)."""
    return [
        {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "index": i,
            "type": "function",
            "function": {"name": c.name, "arguments": c.arguments},
        }
        for i, c in enumerate(calls)
    ]


class ToolStream:
    """Turns a streamed chat's text deltas into OpenAI deltas when tools may be called: text that cannot
    start a call goes out as ``content`` at once; from where a call may start (the parser's marker, or all
    of a constrained output) it is held, and at the end it becomes ``tool_calls`` deltas (each call whole)
    or, when it held no call, ``content``."""

    def __init__(self, tools: Tools, parser: ToolCallParser) -> None:
        self.tools = tools
        self.parser = parser
        self.text = ""
        self.sent = 0  # characters of ``text`` sent as content
        self.calls: list[ToolCall] = []

    def push(self, delta: str) -> list[dict]:
        """Deltas to send for ``delta`` (new text)."""
        self.text += delta
        hold = 0 if self.tools.constrained else self.parser.hold_from(self.text)
        hold = max(len(self.text[:hold].rstrip()), self.sent)  # whitespace before a call is not content
        out = [{"content": self.text[self.sent : hold]}] if hold > self.sent else []
        self.sent = hold
        return out

    def finish(self) -> list[dict]:
        """The last deltas: the calls found in the held text, or the held text as content."""
        content, self.calls = self.tools.extract(self.text, self.parser)
        if self.calls:
            rest = content[self.sent :] if content.startswith(self.text[: self.sent]) else ""
            out = [{"content": rest}] if rest else []
            return out + [{"tool_calls": [c]} for c in call_objects(self.calls)]
        rest = self.text[self.sent :]
        return [{"content": rest}] if rest else []
