"""The OpenAI routes' structured output: ``response_format`` to a grammar constraint, and a chat's tool calls
(the message's ``tool_calls``, the ``tool_calls`` finish reason) from the model's text.

``response_format`` (chat and completions, as upstream): ``text`` (none), ``json_object`` (any JSON object),
``json_schema`` (``json_schema.schema``; ``strict`` is how it is always applied: the output follows the schema
exactly, no properties it does not list) or ``structural_tag`` (xgrammar's structural tag, the object itself).
"""

from __future__ import annotations

import json

from engine.grammar.tool_parsers import ToolCallParser
from engine.grammar.tools import Tools, call_objects

JSON_OBJECT = '{"type": "object"}'  # upstream's json_schema for response_format json_object
_FORMATS = ("text", "json_object", "json_schema", "structural_tag")


def response_format(fmt) -> dict[str, tuple[str, str]] | None:
    """``{sampling field: (constraint text, the client's field name)}`` of a ``response_format``, or None
    when it does not constrain the output; ``ValueError`` names the bad field."""
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in _FORMATS:
        raise ValueError(f"response_format.type must be one of {', '.join(_FORMATS)}")
    kind = fmt["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_schema": (JSON_OBJECT, "response_format")}
    if kind == "structural_tag":
        tag = {k: v for k, v in fmt.items() if k != "type"}
        if "format" in tag:  # xgrammar's shape: {"type": "structural_tag", "format": {...}}
            tag = fmt
        return {"structural_tag": (json.dumps(tag), "response_format")}
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise ValueError("response_format.json_schema must be an object with a name")
    schema = spec.get("schema", spec.get("schema_"))
    if schema is None:
        return {"json_schema": (JSON_OBJECT, "response_format.json_schema")}
    if not isinstance(schema, dict | bool):
        raise ValueError("response_format.json_schema.schema must be a JSON schema object")
    return {"json_schema": (json.dumps(schema), "response_format.json_schema.schema")}


def tool_message(
    text: str, tools: Tools | None, parser: ToolCallParser, finish: str | None
) -> tuple[dict, str | None]:
    """The chat ``message`` for the model's ``text`` and the finish reason: with tool calls, ``tool_calls``
    (content the text before them, or None) and ``tool_calls``; else the text and ``finish``."""
    message: dict[str, object]
    message = {"role": "assistant", "content": text, "reasoning_content": None, "tool_calls": None}
    if tools is None:
        return message, finish
    content, calls = tools.extract(text, parser)
    if not calls:
        return message, finish
    message["content"] = content or None
    message["tool_calls"] = call_objects(calls)
    return message, "tool_calls"
