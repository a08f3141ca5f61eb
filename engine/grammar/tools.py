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
import re
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


# A call in JSON whose name comes first: ``{"name": "f", "arguments": `` (or ``"parameters"``), so its
# arguments can stream as the model writes them.
_CALL_HEAD = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')
# What may stand between two calls (or before the first): separators and the parsers' markers.
_BETWEEN = re.compile(r"(?:\s|[;,\[\]]|<tool_call>|</tool_call>|\[TOOL_CALLS\]|<\|python_tag\|>)*")
_SCALAR = set("+-0123456789.eEtrufalsn")


def dumps_prefix(raw: str) -> tuple[str, int | None]:
    """The part of ``json.dumps(json.loads(raw), ensure_ascii=False)`` that the complete tokens at the start
    of ``raw`` (one JSON value, possibly cut short) already fix, and where that value ends in ``raw`` (None
    while it is not complete). A string or a number goes out only once it is closed, so the prefix never
    changes afterwards; text that is not JSON ends the prefix where it starts."""
    out: list[str] = []
    depth, i, n = 0, 0, len(raw)
    while i < n:
        c = raw[i]
        if c in " \t\r\n":
            i += 1
            continue
        if c in "{[":
            out.append(c)
            depth += 1
        elif c in "}]":
            out.append(c)
            depth -= 1
        elif c == ",":
            out.append(", ")
        elif c == ":":
            out.append(": ")
        elif c == '"' or c in _SCALAR:
            token, i = _token(raw, i)
            if token is None:
                break
            out.append(token)
        else:
            break
        i += 1
        if depth == 0:
            return "".join(out), i
    return "".join(out), None


def _token(raw: str, i: int) -> tuple[str | None, int]:
    """The string or scalar starting at ``raw[i]`` as ``json.dumps`` writes it and the index of its last
    character, or None while it may not be complete (or is not JSON)."""
    n = len(raw)
    if raw[i] == '"':
        j = i + 1
        while j < n and raw[j] != '"':
            j += 2 if raw[j] == "\\" else 1
        if j >= n:
            return None, i
        text, last = raw[i : j + 1], j
    else:
        j = i
        while j < n and raw[j] in _SCALAR:
            j += 1
        if j >= n:
            return None, i  # the number or literal may go on
        text, last = raw[i:j], j - 1
    try:
        return json.dumps(json.loads(text), ensure_ascii=False), last
    except ValueError:
        return None, i


class ToolStream:
    """Turns a streamed chat's text deltas into OpenAI deltas when tools may be called: text that cannot
    start a call goes out as ``content`` at once; from where a call may start (the parser's marker, or all
    of a constrained output) it is held. A call written as JSON with its name first streams as the model
    writes it, as upstream does: one delta with its ``index``, ``id``, ``type`` and ``name`` (arguments
    ``""``) once the name is complete, then deltas that append to ``function.arguments`` (the arguments as
    ``json.dumps`` writes them, each string or number once it is complete). At the end the parser reads the
    calls from the whole text, the same as without streaming, and what has not gone out yet goes out (a whole
    call for one that did not stream, e.g. pythonic calls), so the concatenated arguments equal the
    non-streamed call's; held text that holds no call is sent as ``content``."""

    def __init__(self, tools: Tools, parser: ToolCallParser) -> None:
        self.tools = tools
        self.parser = parser
        self.text = ""
        self.sent = 0  # characters of ``text`` sent as content
        self.calls: list[ToolCall] = []
        self.streamed: list[list[str]] = []  # per call started: [id, name, arguments sent]

    def push(self, delta: str) -> list[dict]:
        """Deltas to send for ``delta`` (new text)."""
        self.text += delta
        hold = 0 if self.tools.constrained else self.parser.hold_from(self.text)
        hold = max(len(self.text[:hold].rstrip()), self.sent)  # whitespace before a call is not content
        out = [{"content": self.text[self.sent : hold]}] if hold > self.sent else []
        self.sent = hold
        if hold < len(self.text):
            for index, name, args in self._partial_calls():
                out += self._call_deltas(index, name, args)
        return out

    def _partial_calls(self) -> list[tuple[int, str, str]]:
        """``(index, name, arguments so far)`` of the calls in the held text that stream, in order; the
        first call that is not JSON with its name first ends the list."""
        found, pos, held = [], self.sent, self.text
        while True:
            m = _CALL_HEAD.search(held, pos)
            if m is None or not _BETWEEN.fullmatch(held, pos, m.start()):
                return found
            try:
                name = json.loads(f'"{m.group(1)}"')
            except ValueError:
                return found
            if name not in self.tools.names or held[m.end() : m.end() + 1] not in ("{", ""):
                return found
            args, end = dumps_prefix(held[m.end() :])
            found.append((len(found), name, args))
            if end is None:
                return found
            close = held.find("}", m.end() + end)  # the call object's own closing brace
            if close < 0:
                return found
            pos = close + 1

    def _call_deltas(self, index: int, name: str, args: str) -> list[dict]:
        out = []
        if index == len(self.streamed):
            call_id = f"call_{uuid.uuid4().hex[:24]}"
            self.streamed.append([call_id, name, ""])
            head = {"name": name, "arguments": ""}
            out.append(
                {"tool_calls": [{"index": index, "id": call_id, "type": "function", "function": head}]}
            )
        entry = self.streamed[index]
        if entry[1] == name and args.startswith(entry[2]) and len(args) > len(entry[2]):
            out.append({"tool_calls": [{"index": index, "function": {"arguments": args[len(entry[2]) :]}}]})
            entry[2] = args
        return out

    def finish(self) -> list[dict]:
        """The last deltas: the rest of the calls found in the held text, or the held text as content."""
        content, self.calls = self.tools.extract(self.text, self.parser)
        if self.calls:
            rest = content[self.sent :] if content.startswith(self.text[: self.sent]) else ""
            out = [{"content": rest}] if rest else []
            for index, call in enumerate(self.calls):
                if index >= len(self.streamed):
                    self.streamed.append([f"call_{uuid.uuid4().hex[:24]}", call.name, ""])
                    head = {"name": call.name, "arguments": call.arguments}
                    entry = {
                        "index": index,
                        "id": self.streamed[index][0],
                        "type": "function",
                        "function": head,
                    }
                    out.append({"tool_calls": [entry]})
                    continue
                sent = self.streamed[index][2]
                if call.arguments.startswith(sent) and len(call.arguments) > len(sent):
                    more = {"arguments": call.arguments[len(sent) :]}
                    out.append({"tool_calls": [{"index": index, "function": more}]})
            return out
        rest = self.text[self.sent :]
        return [{"content": rest}] if rest else []
