"""Tool calling: the JSON schema that forces a valid call (``tool_choice`` required or named),
and the parsers that turn a model's text into ``tool_calls`` (``--tool-call-parser``):

- ``hermes``: Hermes/Qwen ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks, any
  text before the first block is the message content;
- ``llama3_json``: Llama 3's JSON calls, ``{"name": ..., "parameters": {...}}`` (optionally after
  ``<|python_tag|>``, several separated by ``;``), the whole output being the calls.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

PARSERS = ("hermes", "llama3_json")


@dataclass
class Call:
    name: str
    arguments: str  # JSON text
    id: str = ""

    def __post_init__(self):
        self.id = self.id or f"chatcmpl-tool-{uuid.uuid4().hex[:24]}"


def _params(tool) -> dict:
    return tool.function.parameters or {"type": "object", "properties": {}}


def forced_schema(tools, tool_choice, parallel: bool | None) -> dict:
    """The schema guided decoding enforces when a call is forced: a named tool's arguments, or
    for ``required`` a list of ``{"name", "parameters"}`` calls (one, unless parallel calls are allowed)."""
    if not isinstance(tool_choice, str):  # named
        tool = next(t for t in tools if t.function.name == tool_choice.function.name)
        return _params(tool)
    items = [{"type": "object", "properties": {"name": {"enum": [t.function.name]}, "parameters": _params(t)},
              "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
    schema = {"type": "array", "items": items[0] if len(items) == 1 else {"anyOf": items}, "minItems": 1}
    if parallel is False:
        schema["maxItems"] = 1
    return schema


def forced_calls(text: str, tool_choice) -> list[Call]:
    """The calls in a forced output (its grammar made it valid JSON unless it was cut off)."""
    if not isinstance(tool_choice, str):
        return [Call(tool_choice.function.name, text)]
    try:
        calls = json.loads(text)
    except ValueError:
        return []
    return [Call(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in calls
            if isinstance(c, dict) and "name" in c and "parameters" in c]


_CALL_HEAD = '{"name": '
_PARAMS = ', "parameters": '


def scan_forced(text: str) -> list[tuple[str, int, int | None]]:
    """The calls of a ``required`` output so far, as its grammar writes them (compact JSON, keys
    in schema order): (name, where its parameters start, where they end or None while they run).
    A call whose name or parameters key is still being written is left out."""
    calls, i = [], 0
    while True:
        j = text.find(_CALL_HEAD, i)
        if j < 0 or j + len(_CALL_HEAD) >= len(text):
            return calls
        try:
            name, k = json.decoder.scanstring(text, j + len(_CALL_HEAD) + 1)
        except ValueError:  # the name is still being written
            return calls
        if not text.startswith(_PARAMS, k):
            return calls
        start = k + len(_PARAMS)
        end = _value_end(text, start)
        calls.append((name, start, end))
        if end is None:
            return calls
        i = end


def _value_end(text: str, start: int) -> int | None:
    """Where the JSON value starting at ``start`` ends (None: not yet)."""
    depth, in_str, esc = 0, False, False
    for i in range(start, len(text)):
        c = text[i]
        if in_str:
            if esc:
                esc = False
            elif c == "\\":
                esc = True
            elif c == '"':
                in_str = False
                if depth == 0:
                    return i + 1
        elif c == '"':
            in_str = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
        elif depth == 0 and c in ",}]":
            return i
    return None


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)


def _call_of(obj, names) -> Call | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    if names is not None and obj["name"] not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models send the arguments as JSON text already
        try:
            json.loads(args)
        except ValueError:
            return None
        return Call(obj["name"], args)
    return Call(obj["name"], json.dumps(args, ensure_ascii=False))


def parse(parser: str, text: str, names=None) -> tuple[str | None, list[Call]]:
    """(content, calls) of a model's output; no calls: the text is all content. ``names``: the
    request's tool names (calls to others are left as text)."""
    if parser == "hermes":
        start = text.find("<tool_call>")
        if start < 0:
            return text, []
        calls = []
        for body in _HERMES.findall(text[start:]):
            try:
                call = _call_of(json.loads(body), names)
            except ValueError:
                call = None
            if call is None:
                return text, []
            calls.append(call)
        content = text[:start].strip()
        return content or None, calls
    if parser == "llama3_json":
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return text, []
        calls = []
        dec = json.JSONDecoder()
        pos = 0
        while pos < len(body):
            try:
                obj, end = dec.raw_decode(body, pos)
            except ValueError:
                return text, []
            call = _call_of(obj, names)
            if call is None:
                return text, []
            calls.append(call)
            pos = end
            while pos < len(body) and body[pos] in " \n\t;":
                pos += 1
        return None, calls
    raise ValueError(f"unknown tool-call parser {parser!r} (available: {', '.join(PARSERS)})")


def may_start_calls(parser: str, text: str) -> int:
    """Where, in text streamed so far, tool calls may begin (``len(text)``: not yet): text before
    it can be sent as content, the rest is held back until the output ends."""
    if parser == "hermes":
        tag = "<tool_call>"
        i = text.find(tag)
        if i >= 0:
            return i
        for k in range(min(len(tag) - 1, len(text)), 0, -1):  # a tag may be starting at the end
            if tag.startswith(text[-k:]):
                return len(text) - k
        return len(text)
    stripped = text.lstrip()
    if not stripped:
        return 0
    return 0 if stripped.startswith(("{", "<|python_tag|>")) or "<|python_tag|>".startswith(stripped) else len(text)


def template_tools(tools) -> list[dict]:
    """Tools as the HF chat-template ``tools=`` argument takes them (OpenAI's shape)."""
    return [{"type": "function", "function": t.function.model_dump(exclude_none=True)} for t in tools]


def template_message(m) -> dict:
    """One request message as a chat template expects it: tool calls with their arguments as
    objects (HF's convention), tool results with their call id."""
    msg = {"role": "system" if m.role == "developer" else m.role, "content": m.text}
    if m.name is not None:
        msg["name"] = m.name
    if m.tool_calls:
        calls = []
        for c in m.tool_calls:
            try:
                args = json.loads(c.function.arguments)
            except ValueError:
                args = c.function.arguments
            calls.append({"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": args}})
        msg["tool_calls"] = calls
    if m.tool_call_id is not None:
        msg["tool_call_id"] = m.tool_call_id
    return msg
